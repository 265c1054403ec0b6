"""What a parameter tree's structure fixes for ``gmjax.diloco``: ``Layout``.

Its schema and fragment plan (layer blocks included), the round schedule as a table the
step looks up, which leaves keep an F32 master, and how the state shaped like the
parameters, the masters (whole or one learner's shard) and the outer states are built,
flattened and written piece by piece.
"""

from __future__ import annotations

from typing import Any

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
from gmjax.transform.state import DelayState


def sync_table(schedule: RoundSchedule) -> np.ndarray:
  """``table[t mod H]``: 1 + the fragment that syncs at global step ``t``, or 0."""
  table = np.zeros(schedule.sync_every, np.int32)
  for step in range(1, schedule.sync_every + 1):
    r = schedule.round_at(step)
    if r is not None:
      table[step % schedule.sync_every] = schedule.fragment_of(r) + 1
  return table


def lookup(table: np.ndarray, index: jax.Array) -> jax.Array:
  """``table[index]`` as a masked sum over the (short) constant table.

  An indexed read of a constant by a learner-batched index is a gather, which explicit
  sharding refuses to place on its own; a comparison and a sum are elementwise.
  """
  positions = np.arange(table.size, dtype=np.int32)
  return jnp.sum(jnp.where(positions == index, jnp.asarray(table), 0))


class Layout:
  """What a parameter tree's structure fixes: schema, fragments, schedule, masters, shards.

  ``learners`` is the axis size ``M`` when the outer step is sharded, else None.
  ``beta`` is ``config.error_feedback`` (None: off). ``schema`` is the schema the
  fragments hold (``DiLoCo.cut``: with ``layer_axis``, stacked leaves are cut into blocks
  of layers, the *pieces*); ``names`` are the tree's leaves. State shaped like the
  parameters keeps whole leaves, and a sync or merge reads and writes its fragment's
  pieces in them (``view``, ``write``); masters and outer states are kept per piece.
  """

  def __init__(self, config: DiLoCo, params: Any, learners: int | None):
    self.tree = Schema.from_tree(params)
    self.schema = config.cut(self.tree)
    config.check_parameters(self.schema)
    self.beta = config.error_feedback
    self.delay = config.outer_delay == 1
    self.eager = config.eager
    self.plan = config.plan(self.schema)
    self.schedule = config.schedule(len(self.plan))
    self.table = sync_table(self.schedule)
    self.keep = {s.name: config.keeps_master(s.dtype) for s in self.schema}
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

  def master_tree(self, values: dict[str, Any]) -> Any:
    """The master tree of per-piece ``values``: a cut leaf holds a tuple of its pieces'."""
    return self.unflatten({
        n: values[ps[0].name] if ps[0].axis is None else tuple(values[p.name] for p in ps)
        for n, ps in self.cuts.items()})

  def master_pieces(self, tree: Any) -> dict[str, Any]:
    """The per-piece values of a master tree (``master_tree``'s inverse)."""
    flat, out = self.flatten(tree), {}
    for n, ps in self.cuts.items():
      if ps[0].axis is None:
        out[n] = flat[n]
      else:
        out.update((p.name, v) for p, v in zip(ps, flat[n]))
    return out

  def cast(self, tree: Any) -> Any:
    """A copy of ``tree`` at the schema dtypes (float64 input becomes F32).

    A copy, so that the state never shares a buffer with the parameters (both can be
    donated to a jitted step).
    """
    flat = self.flatten(tree)
    return self.unflatten(
        {n: jnp.array(v, JNP_DTYPES[self.tree[n].dtype], copy=True) for n, v in flat.items()}
    )

  def master_value(self, name: str, theta: jax.Array, learner: Any) -> jax.Array:
    """The F32 master of piece ``name`` whose Θ is ``theta``: whole, or this learner's shard."""
    if self.learners is None:
      return jnp.array(theta, jnp.float32, copy=True)
    return shards.own(shards.to_rows(theta, self.learners), learner)

  def zeros(self, name: str, like: jax.Array) -> jax.Array:
    """F32 zeros of piece ``name``'s master: whole, or one learner's shard.

    ``like`` is the piece of the parameters: on an explicit mesh the zeros take the
    layout that the rare steps give the master (the parameter's, or its rows'), so that
    ``lax.cond`` finds the same sharding on both sides and never has to gather one.
    """
    spec = self.schema[name]
    if self.learners is None:
      return explicit.zeros(spec.shape, jnp.float32, explicit.spec(like))
    return explicit.zeros(shards.shard_shape(spec.shape, self.learners), jnp.float32,
                          shards.shard_spec(like, self.learners))

  def master_init(self, params: Any) -> tuple[Any, dict[str, Any]]:
    """The master tree before the first update (zeros where kept) and every piece's zeros."""
    zeros = {n: self.zeros(n, v) for n, v in self.view(self.flatten(params)).items()}
    return self.master_tree(
        {n: z if self.keep[n] else optax.MaskedNode() for n, z in zeros.items()}), zeros

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

  def outer_init(self, tx: optax.GradientTransformation, values: dict[str, Any]) -> tuple:
    """Per fragment, ``tx.init`` over the fragment's pieces (``values``: name → array)."""
    return tuple(tx.init(tuple(values[n] for n in names)) for names in self.plan)
