"""What a parameter tree's structure fixes for ``gmjax.diloco``: ``Layout``.

Its schema and fragment plan (layer blocks included), the round schedule as a table the
step looks up, how the state shaped like the parameters is flattened and written piece by
piece, and how each fragment's pieces lie in its buckets, which hold the masters (whole,
or one learner's rows) and over which the outer states are built.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gmjax.core import eager
from gmjax.core.codec import JNP_DTYPES
from gmjax.core.diloco import DiLoCo
from gmjax.core.layers import Piece
from gmjax.core.schedule import RoundSchedule
from gmjax.core.schema import Schema
from gmjax.transform import explicit, shards
from gmjax.transform.buckets import Buckets
from gmjax.transform.state import DelayState, Kept


def mismatch(params: Any, anchor: Any, names: tuple[str, str] = ("params", "the anchor")
             ) -> tuple[str, str, Any, Any] | None:
  """How ``params`` differs from the state's ``anchor``, or None if it does not.

  Returns ``("structure", said, None, None)`` for another tree structure, where
  ``said`` says where, calling the two trees ``names`` (a leaf one has at a path the
  other lacks, or the first node of another type), else ``("shape", path, got,
  want)`` for the first leaf of another shape (``path`` as ``jax.tree_util.keystr``
  writes it), for the callers' messages.
  """
  got, want = jax.tree.structure(params), jax.tree.structure(anchor)
  if got != want:
    paths = [[jax.tree_util.keystr(p) or "the root"
              for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]] for t in (params, anchor)]
    for (one, other), (here, there) in ((names, paths), (names[::-1], paths[::-1])):
      extra = [p for p in here if p not in set(there)]
      if extra:
        return "structure", f"a leaf at {extra[0]} in {one}, not in {other}", None, None
    g, w = _first_other_node(got, want) or ("other", "other")
    return ("structure", f"the same leaves, in {g} nodes in {names[0]} and {w} nodes in"
            f" {names[1]}", None, None)
  for (path, p), a in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(anchor)):
    if jnp.shape(p) != jnp.shape(a):
      return "shape", jax.tree_util.keystr(path), jnp.shape(p), jnp.shape(a)
  return None


def _first_other_node(got: Any, want: Any) -> tuple[str, str] | None:
  """The type names of the first nodes (depth first) where two tree structures with
  the same leaf paths differ, e.g. ``nnx.Param`` against ``nnx.OptVariable``."""
  if got.node_data() != want.node_data() or len(got.children()) != len(want.children()):
    name = lambda t: "leaf" if t.node_data() is None else t.node_data()[0].__name__
    return name(got), name(want)
  for g, w in zip(got.children(), want.children()):
    found = _first_other_node(g, w)
    if found is not None:
      return found
  return None


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
  """The node of ``tree`` at key path ``path`` (None where there is none)."""
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey):
      if hasattr(tree, "_fields") and key.name not in tree._fields:
        return None  # a NamedTuple's method, such as count, is no node of it
      tree = getattr(tree, key.name, None)
    elif isinstance(key, jax.tree_util.SequenceKey):
      tree = tree[key.idx] if isinstance(tree, (list, tuple)) and key.idx < len(tree) else None
    elif isinstance(key, jax.tree_util.DictKey):
      tree = tree.get(key.key) if hasattr(tree, "get") else None
    else:
      return None
  return tree


class _Shown(str):
  """Text that a tree's ``repr`` shows as it is (no quotes)."""

  def __repr__(self) -> str:
    return str(self)


def _layout(tree: Any) -> str:
  """``tree`` with each array as its shape, as the message shows it (at most 300 characters)."""
  shown = lambda x: (_Shown("MaskedNode()") if isinstance(x, optax.MaskedNode) else
                     jnp.shape(x) if hasattr(x, "shape") else _Shown(type(x).__name__))
  text = repr(jax.tree.map(shown, tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode)))
  return text if len(text) <= 300 else text[:297] + "..."


def dtype(x: Any) -> np.dtype:
  """``x``'s dtype as ``jit`` takes it (a restored int64 count is int32 without x64; a
  typed PRNG key, as ``optax.add_noise`` keeps, is its key dtype)."""
  kind = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
  if jax.dtypes.issubdtype(kind, jax.dtypes.extended):
    return kind  # canonicalize_dtype refuses extended dtypes; jit keeps them as they are
  return jax.dtypes.canonicalize_dtype(kind)


def state_mismatch(state: Any, expected: Any) -> tuple[str, str, str] | None:
  """Where ``state`` differs from ``expected`` (what ``init`` builds for the parameters
  now), or None if it does not.

  Returns ``(path, got, want)`` for the first leaf in flattening order whose kind
  (``optax.MaskedNode`` for a part the configuration leaves out), shape or dtype (as
  ``jit`` canonicalizes it) differs, or,
  where the two trees' leaves lie at different paths, for the part that holds them
  (the node below the paths' common prefix, each side with its arrays as shapes);
  ``path`` as ``jax.tree_util.keystr`` writes it, for the callers' messages.
  """
  is_masked = lambda x: isinstance(x, optax.MaskedNode)
  describe = lambda x: "optax.MaskedNode()" if is_masked(x) else f"shape {jnp.shape(x)}"
  got = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_masked)[0]
  want = jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_masked)[0]
  for (got_path, g), (want_path, w) in zip(got, want):
    if got_path != want_path:
      # The part whose layout differs: the node below the paths' common prefix.
      common = 0
      while common < min(len(got_path), len(want_path)) and (
          got_path[common] == want_path[common]):
        common += 1
      # The first of the two paths' nodes that the trees lay out otherwise (a part one
      # side holds empty, e.g. another inner optimizer's, has no leaf to name it by).
      # Else the node that holds both.
      for node in (got_path[:common + 1], want_path[:common + 1], got_path[:common]):
        here = _at(state, node), _at(expected, node)
        shown = _layout(here[0]), _layout(here[1])
        if None not in here and shown[0] != shown[1]:
          break
      return (jax.tree_util.keystr(node), *shown)
    if is_masked(g) != is_masked(w) or (not is_masked(g) and jnp.shape(g) != jnp.shape(w)):
      return jax.tree_util.keystr(got_path), describe(g), describe(w)
    if not is_masked(g) and dtype(g) != dtype(w):
      # The round's loops carry the state: another dtype fails inside JAX.
      return jax.tree_util.keystr(got_path), f"dtype {dtype(g)}", f"dtype {dtype(w)}"
  if len(got) != len(want):
    longer, other = (got, "nothing") if len(got) > len(want) else (want, None)
    path, leaf = longer[min(len(got), len(want))]
    if other is None:
      return "", f"{len(got)} leaves", f"{len(want)} leaves, up to state{jax.tree_util.keystr(path)}"
    return jax.tree_util.keystr(path), describe(leaf), other
  if jax.tree.structure(state, is_leaf=is_masked) != jax.tree.structure(expected,
                                                                        is_leaf=is_masked):
    for field in getattr(state, "_fields", ()):  # the part that differs, if one does
      here = getattr(state, field), getattr(expected, field, None)
      if jax.tree.structure(here[0], is_leaf=is_masked) != jax.tree.structure(
          here[1], is_leaf=is_masked):
        return f".{field}", _layout(here[0]), _layout(here[1])
    return "", str(jax.tree.structure(state)), str(jax.tree.structure(expected))
  return None


class SyncTable(NamedTuple):
  """Which fragment syncs at global step ``t``: ``1 + fragment`` at ``t mod H`` in
  ``positions``, 0 elsewhere (``lookup``). ``P`` entries, whatever ``sync_every``."""
  sync_every: int
  positions: np.ndarray
  fragments: np.ndarray


def sync_table(schedule: RoundSchedule) -> SyncTable:
  """The ``SyncTable`` of ``schedule``: round ``r < P`` syncs fragment ``r`` at
  ``step_of(r)``, and every ``H`` steps after."""
  rounds = range(schedule.fragments)
  positions = [schedule.step_of(r) % schedule.sync_every for r in rounds]
  return SyncTable(schedule.sync_every, np.asarray(positions, np.int32),
                   np.asarray([schedule.fragment_of(r) + 1 for r in rounds], np.int32))


def lookup(table: SyncTable, index: jax.Array) -> jax.Array:
  """``1 + fragment`` that syncs at ``index`` (``t mod H``), or 0: a masked sum over the
  table's ``P`` entries.

  An indexed read of a constant by a learner-batched index is a gather, which explicit
  sharding refuses to place on its own; a comparison and a sum are elementwise, and the
  step's program and work do not grow with ``sync_every``.
  """
  if table.positions.size == 0:
    return jnp.zeros([], jnp.int32)
  matches = table.positions == index
  return jnp.sum(jnp.where(matches, jnp.asarray(table.fragments), 0))


class Layout:
  """What a parameter tree's structure fixes: schema, fragments, schedule, masters, shards.

  ``learners`` is the axis size ``M`` when the outer step is sharded, else None.
  ``beta`` is ``config.error_feedback`` (None: off). ``schema`` is the schema the
  fragments hold (``DiLoCo.cut``: with ``layer_axis``, stacked leaves are cut into blocks
  of layers, the *pieces*); ``names`` are the tree's leaves. State shaped like the
  parameters keeps whole leaves, and a sync or merge reads and writes its fragment's
  pieces in them (``view``, ``write``). Masters and outer states are kept per fragment
  as buckets (``buckets``): each bucket its pieces' rows end to end, this learner's part
  ``(F, S, 32)`` (all of it when replicated), so the outer step is a few arrays a
  fragment whatever the number of leaves.
  """

  def __init__(self, config: DiLoCo, params: Any, learners: int | None,
               tx: optax.GradientTransformation, axis_name: Any, elementwise: bool):
    self.config = config
    self.wire = config.delta_wire
    self.tx = tx
    self.axis_name = axis_name
    self.elementwise = elementwise
    self.tree = Schema.from_tree(params)
    self.schema = config.cut(self.tree)
    config.check_parameters(self.schema)
    self.beta = config.error_feedback
    self.delay = config.outer_delay == 1
    self.eager = config.eager
    self.plan = config.plan(self.schema)
    self.schedule = config.schedule(len(self.plan))
    self.table = sync_table(self.schedule)
    self.names = self.tree.leaf_names
    self.cuts = self.schema.pieces or {n: (Piece(n, n),) for n in self.names}
    self.pieces = {p.name: p for ps in self.cuts.values() for p in ps}
    self.learners = learners

  def flatten(self, tree: Any) -> dict[str, Any]:
    return dict(zip(self.names, self.tree.treedef.flatten_up_to(tree)))

  def unflatten(self, flat: dict[str, Any]) -> Any:
    return self.tree.treedef.unflatten([flat[n] for n in self.names])

  def view(self, flat: dict[str, Any], names: Any = None) -> dict[str, Any]:
    """The pieces ``names`` (all by default) of the whole leaves ``flat``."""
    names = self.pieces if names is None else names
    return {n: self.pieces[n].take(flat[self.pieces[n].leaf]) for n in names}

  def write(self, flat: dict[str, Any], values: dict[str, Any]) -> None:
    """Writes the pieces ``values`` into the whole leaves ``flat``, in place."""
    for n, v in values.items():
      piece = self.pieces[n]
      flat[piece.leaf] = piece.put(flat[piece.leaf], v)

  def cast(self, tree: Any) -> Any:
    """A copy of ``tree`` at the schema dtypes (float64 input becomes F32).

    A copy, so that the state never shares a buffer with the parameters (both can be
    donated to a jitted step).
    """
    flat = self.flatten(tree)
    return self.unflatten(
        {n: jnp.array(v, JNP_DTYPES[self.tree[n].dtype], copy=True) for n, v in flat.items()}
    )

  @property
  def row_learners(self) -> int:
    """The learners a leaf's rows are cut for: ``M`` sharded, 1 replicated."""
    return self.learners or 1

  def rows(self, values: dict[str, Any]) -> dict[str, Any]:
    """Each piece's F32 rows ``(R, row_learners, 32)`` (``gmjax.transform.shards``)."""
    return {n: shards.to_rows(v, self.row_learners) for n, v in values.items()}

  def buckets(self, rows: dict[str, Any]) -> Buckets:
    """How a fragment's pieces lie in its buckets, from their ``rows``.

    Pieces share a bucket when their deltas travel alike (one wire code), they publish
    alike (one parameter dtype) and their rows lie alike; a bucket's pieces come in the
    fragment's name order.
    """
    dtypes = {n: self.schema[n].dtype for n in rows}
    return Buckets(rows, {n: self.wire.code(d) for n, d in dtypes.items()},
                   self.axis_name, dtypes)

  def own(self, bucket: jax.Array, learner: Any) -> jax.Array:
    """This learner's part ``(F, S, 32)`` of a bucket of rows ``(F, S, M, 32)``."""
    if self.learners is None:
      return bucket[:, :, 0]
    return shards.own(bucket, learner, 2)

  def keeps(self, buckets: Buckets) -> tuple[bool, ...]:
    """Whether each bucket keeps an F32 master beside Θ (else Θ in F32 is the master)."""
    return tuple(self.config.keeps_master(d) for d in buckets.dtypes)

  def theta_buckets(self, theta: dict[str, Any], learner: Any) -> tuple[Buckets, list]:
    """The buckets of the pieces ``theta`` (F32, this learner's part) and their layout."""
    rows = self.rows(theta)
    buckets = self.buckets(rows)
    return buckets, [self.own(b, learner) for b in buckets.pack(rows)]

  def masters(self, buckets: Buckets, values: list) -> Kept:
    """The state's masters of one fragment: ``values`` where kept, else MaskedNode."""
    return Kept((v if keep else optax.MaskedNode()
                 for v, keep in zip(values, self.keeps(buckets))), buckets.rows,
                self.learners)

  def outer_tx(self, tx: optax.GradientTransformation, buckets: Buckets,
               like: dict[str, Any]) -> optax.GradientTransformation:
    """The outer optimizer over a fragment's master buckets.

    ``tx`` itself when it acts element by element (the sharded step's requirement); else
    (replicated, e.g. global-norm clipping or LAMB) ``tx`` over the pieces in their own
    shapes, unpacked from the buckets and packed back, so it sees the leaves a user
    gave it and not the buckets' padding. ``like``: the fragment's pieces by name (laid
    out as the parameters, whose layout orders their rows).
    """
    if self.elementwise:
      return tx
    names = list(like)

    def pieces(values):
      rows = buckets.unpack([v[:, :, None] for v in values])
      return tuple(shards.from_rows(rows[n], like[n].shape, like[n]) for n in names)

    def packed(values):
      rows = self.rows(dict(zip(names, values)))
      return tuple(self.own(b, None) for b in buckets.pack(rows))

    def init(params):
      return tx.init(pieces(params))

    def update(updates, state, params=None):
      new, state = tx.update(pieces(updates), state,
                             None if params is None else pieces(params))
      return packed(new), state

    return optax.GradientTransformation(init, update)

  def master_init(self, params: Any) -> tuple[tuple, tuple]:
    """The masters and outer states before the first update: zeros, per fragment.

    Laid out as the rare steps make them (the buckets of the parameters' rows), so that
    ``lax.cond`` finds the same sharding on both sides and never has to gather one.
    """
    flat = self.view(self.flatten(params))
    masters, states = [], []
    for names in self.plan:
      buckets, values = self.theta_buckets({n: flat[n] for n in names}, None
                                           if self.learners is None else 0)
      zeros = [jnp.zeros_like(v) for v in values]
      masters.append(self.masters(buckets, zeros))
      states.append(self.outer_tx(self.tx, buckets, {n: flat[n] for n in names}).init(
          tuple(zeros)))
    return tuple(masters), tuple(states)

  def residual_init(self, params: Any) -> Any:
    """The residuals before any delta: F32 zeros laid out like ``params``, or
    ``optax.MaskedNode()`` without error feedback."""
    if self.beta is None:
      return optax.MaskedNode()
    return self.unflatten({
        n: explicit.zeros(self.tree[n].shape, jnp.float32, explicit.spec(p))
        for n, p in self.flatten(params).items()})

  def delay_init(self, tx: optax.GradientTransformation, params: Any) -> Any:
    """The ``DelayState`` before any round (its start: ``params`` in F32), or
    ``optax.MaskedNode()`` without ``outer_delay``."""
    if not self.delay:
      return optax.MaskedNode()
    flat = self.flatten(params)
    start = self.unflatten({n: explicit.like(jnp.array(p, jnp.float32, copy=True), p)
                            for n, p in flat.items()})
    if not self.eager:
      return DelayState(start)
    zeros = {n: explicit.zeros(self.tree[n].shape, jnp.float32, explicit.spec(p))
             for n, p in flat.items()}
    copy = lambda: self.unflatten({n: jnp.array(z, copy=True) for n, z in zeros.items()})
    # A negative weight stands for 1/M, which only the sync, inside the axis, knows.
    return DelayState(start, copy(), copy(), -jnp.ones([len(self.plan)], jnp.float32),
                      tuple(eager.initial_state(tx, self.view(zeros, names), names)
                            for names in self.plan))
