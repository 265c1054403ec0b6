"""The arithmetic of a round over every learner at once: the learners are an array dimension.

A round's deltas are held stacked, the learners along one dimension of each array (the
mail closer's contributions by slot, an in-mesh bucket's source learners), so each step
below is one operation however many learners there are: no program grows with ``M``.

* ``weighted_sum``: ``g = Σ_m w_m · Δ_m`` in F32, in learner order (``m = 0, 1, …``),
  as a ``lax`` loop: the order every runtime sums in, whatever XLA would reassociate.
* ``gram``: the ``M × M`` dot products of the deltas, one contraction per array.
* ``non_finite``: each learner's count of NaN and Inf values.
* ``outer_round``: the outer step on the aggregate, the published Θ, and whether the
  round is kept (the skip rule).

Both runtimes call these, the mail closer (``gmjax.core.aggregator``) and the in-mesh
exchanges (``gmjax.transform``), so they add, screen, step and skip alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gmjax.core import outer
from gmjax.core.schema import ParameterSpec
from gmjax.core.wire import Wire


def weighted_sum(stacked: jax.Array, weights: jax.Array, axis: int = 0,
                 keep: jax.Array | None = None) -> jax.Array:
  """``Σ_m weights[m] · stacked[m]`` along ``axis``, in F32, summed in the order of ``m``.

  Args:
    stacked: the learners' values, learner ``m`` at index ``m`` of ``axis``.
    weights: ``(M,)``, one weight a learner.
    axis: the learners' dimension of ``stacked``.
    keep: bool ``(M,)``, whose values enter the sum (None: all); a learner left out adds
      zeros, whatever its values (a NaN times a zero weight would be NaN).

  Returns:
    ``stacked``'s shape without ``axis``, in F32.
  """
  count = stacked.shape[axis]
  w = jnp.asarray(weights, jnp.float32)

  def term(m):
    value = w[m] * lax.dynamic_index_in_dim(stacked, m, axis, keepdims=False).astype(
        jnp.float32)
    # Inside the loop: the mask is read from the loop's operands, so XLA does not copy
    # the screening that made it into every reader.
    return value if keep is None else jnp.where(keep[m], value, jnp.float32(0))

  # From zeros, every term in the loop: a loop of one trip would be inlined, and its
  # terms (and the weights' computation) copied into every fusion that reads the sum.
  # ``0 + w_0·Δ_0`` is ``w_0·Δ_0``, but for the sign of a zero.
  zeros = jnp.zeros_like(lax.index_in_dim(stacked, 0, axis, keepdims=False), jnp.float32)
  return lax.fori_loop(0, count, lambda m, total: total + term(m), zeros)


def tree_weighted_sum(deltas: Sequence[Any], weights: Sequence[Any]) -> Any:
  """``Σ_m w_m · Δ_m`` of pytrees in F32, each leaf's deltas stacked and summed by
  ``weighted_sum`` (in the given, sorted learner, order)."""
  w = jnp.stack([jnp.asarray(x, jnp.float32) for x in weights])
  return jax.tree.map(lambda *leaves: weighted_sum(jnp.stack(leaves), w), *deltas)


def gram(stacked: Sequence[jax.Array], axis: int, batch: int | None = None) -> jax.Array:
  """The ``M × M`` F32 matrix of the deltas' dot products, over every array of ``stacked``.

  Args:
    stacked: arrays holding the learners' deltas along ``axis`` (each delta is all of an
      array's other elements, over all the arrays).
    axis: the learners' dimension.
    batch: a dimension (other than ``axis``) contracted last, as a batch of products
      summed afterwards: a dimension split over devices, so that each device contracts
      its own piece and only the ``M × M`` sums cross.
  """
  total = None
  for x in stacked:
    x = x.astype(jnp.float32)
    # Products of every pair, reduced where they are formed: one fused reduction that
    # reads the deltas where they lie. A ``dot_general`` contracting the elements around
    # the learners' dimension makes XLA:CPU write two transposed F32 copies of them
    # first; it is slower up to about 16 learners, and about 2x faster at 32.
    products = jnp.expand_dims(x, axis + 1) * jnp.expand_dims(x, axis)
    place = None if batch is None else batch + (batch > axis)  # past the new dimension
    kept = sorted({axis, axis + 1, place} - {None})
    dots = jnp.sum(products, axis=tuple(d for d in range(products.ndim) if d not in kept))
    if batch is not None:
      dots = jnp.sum(dots, axis=kept.index(place))
    total = dots if total is None else total + dots
  return total


def gram_rows(stacked: Sequence[jax.Array], axis: int = 0) -> jax.Array:
  """``gram`` computed a row at a time (a ``lax`` loop over the learners), each entry a
  reduction over the deltas' elements alone.

  An entry does not depend on how many learners are stacked, so deltas padded with zero
  learners (the mail closer's slots) give the same values; ``gram`` contracts all at
  once, faster, in an order that may change with the count.
  """
  flat = [jnp.moveaxis(x, axis, 0).reshape(x.shape[axis], -1).astype(jnp.float32)
          for x in stacked]
  count = flat[0].shape[0]

  def row(i, matrix):
    dots = sum(jnp.sum(x * lax.dynamic_index_in_dim(x, i, 0), axis=1) for x in flat)
    return lax.dynamic_update_index_in_dim(matrix, dots, i, 0)

  return lax.fori_loop(0, count, row, jnp.zeros((count, count), jnp.float32))


def non_finite_flag(x: jax.Array, axis: Any = None) -> jax.Array:
  """F32 1 where ``x`` (reduced over ``axis``, all by default) holds a NaN or Inf, else 0.

  ``Σ (x − x)`` is 0 when every term is finite and NaN otherwise (``Inf − Inf`` is NaN;
  XLA does not fold ``x − x`` for floats): one reduction that XLA fuses with its input.
  A count of ``~isfinite(x)`` makes XLA:CPU write a mask the size of ``x`` to the step's
  scratch, and ``x·0`` a broadcast of zeros, for every leaf of a round.
  """
  x = x.astype(jnp.float32)
  probe = jnp.sum(x - x, axis=axis)
  return jnp.isnan(probe).astype(jnp.float32)


def non_finite(stacked: Sequence[jax.Array], axis: int) -> jax.Array:
  """``(M,)`` F32: for each learner, how many of the arrays hold a NaN or Inf in its
  values (0 exactly when all are finite)."""
  total = None
  for x in stacked:
    others = tuple(d for d in range(x.ndim) if d != axis)
    bad = non_finite_flag(x, others)
    total = bad if total is None else total + bad
  return total


def _stacked_total(counts: Iterable[jax.Array]) -> jax.Array:
  return jnp.sum(jnp.stack([jnp.asarray(c, jnp.float32) for c in counts]))


def count_non_finite(values: Iterable[jax.Array],
                     total: Callable[[Iterable[jax.Array]], jax.Array] = _stacked_total
                     ) -> jax.Array:
  """How many of ``values`` (float arrays; others are skipped) hold a NaN or Inf, F32.

  ``total`` adds the per-array flags (``non_finite_flag``): one reduction of their
  vector by default (a chain of additions would be copied by XLA into every fusion that
  reads it).
  """
  counts = [non_finite_flag(v) for v in values
            if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating)]
  return total(counts) if counts else jnp.float32(0)


def count_non_finite_fused(values: Iterable[jax.Array],
                           total: Callable[[Iterable[jax.Array]], jax.Array] = _stacked_total
                           ) -> jax.Array:
  """Whether ``values`` hold a NaN or Inf, as ``count_non_finite`` tells it (0 exactly
  when all are finite), in one reduction per shape.

  The arrays of one shape are probed together, ``Σ ((a − a) + (b − b) + …)``, so that XLA
  fuses everything that computes them into that one reduction: counted apart, a value
  that two of them read (an outer step's new momentum, read by its own count and by the
  new master's) is written to the step's scratch first.
  """
  groups: dict[tuple, list] = {}
  for v in values:
    if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating):
      groups.setdefault(jnp.shape(v), []).append(v.astype(jnp.float32))
  # ``|x| − |x|``: as ``x − x``, 0 or NaN, but not the expression other counts of the
  # same values use (``non_finite_flag``), which XLA would merge and then write out.
  probe = lambda x: jnp.abs(x) - jnp.abs(x)
  flags = [non_finite_flag(sum((probe(x) for x in group[1:]), probe(group[0])))
           for group in groups.values()]
  return total(flags) if flags else jnp.float32(0)


class OuterRound(NamedTuple):
  """What the outer step of a round produced.

  Attributes:
    theta: the new Θ by name, at the parameter dtype.
    master: the new F32 master by name.
    state: the outer optimizer's new state.
    update: the commit's update entries (``commit_wire``), or None (Θ travels itself,
      or ``publish`` was given).
    bad: F32, how many arrays of the gradient, the new master, the new outer state and
      Θ hold a NaN or Inf (plus 1 if no delta was kept): the round is kept only if it is
      0.
  """

  theta: dict[str, jax.Array]
  master: dict[str, jax.Array]
  state: Any
  update: dict[str, jax.Array] | None
  bad: jax.Array


def outer_round(
    tx: optax.GradientTransformation,
    gradient: Mapping[str, jax.Array],
    state: Any,
    master: Mapping[str, jax.Array],
    anchor: Mapping[str, jax.Array],
    specs: Sequence[ParameterSpec],
    commit_wire: Wire,
    *,
    publish: Callable[[dict[str, jax.Array]], tuple[dict[str, jax.Array], jax.Array]]
    | None = None,
    total: Callable[[Iterable[jax.Array]], jax.Array] = _stacked_total,
    as_tuple: bool = False,
    any_kept: jax.Array | None = None,
    count: Callable[..., jax.Array] = count_non_finite,
) -> OuterRound:
  """The outer step on the round's outer gradient, Θ published from it, and its health.

  ``master ← master + tx.update(g, state, master)`` (``outer.apply_outer``), then Θ:
  ``cast(master)``, or with a commit precision ``rebuild(Θ_old, encode(master − Θ_old))``
  (``outer.publish``). The skip rule: a round none of whose deltas was kept, or whose
  gradient, new master, new outer state or Θ holds a NaN or Inf, is not kept (the
  fragment keeps its Θ, master and outer state).

  Args:
    tx: the outer optimizer.
    gradient: ``g`` by name (F32), in ``specs``' order.
    state: ``tx``'s state over the fragment's masters: the dict by name (the mail
      closer, whose stored records are named by its paths), or with ``as_tuple`` the
      tuple in ``specs``' order (in-mesh).
    master: the F32 masters by name (``Θ`` in F32 where none is kept).
    anchor: the current Θ by name.
    specs: the fragment's specs (the shapes ``gradient`` has).
    commit_wire: how commits travel (``DiLoCo.commit_wire``).
    publish: ``publish(new_master, updates)`` (by name; ``new_master`` is ``master +
      updates``): Θ from the new masters by another route, and its count of non-finite
      values, or the published values themselves (a list, counted with the rest) (the
      in-mesh rounds: each learner publishes its part); None: ``outer.publish`` on
      whole leaves.
    total: how per-array counts are added (explicit meshes need a chain of additions).
    as_tuple: the outer state is over a tuple (see ``state``).
    any_kept: whether the screening kept any delta (None: the caller aggregates only
      kept ones, as the mail closer does).
    count: how the non-finite values are counted (``count_non_finite`` or
      ``count_non_finite_fused``), given the arrays and ``total``.

  Returns:
    The ``OuterRound``; ``bad`` counts this caller's values (a sharded round adds the
    learners' counts).
  """
  names = [s.name for s in specs]
  if as_tuple:
    new_master, new_state, updates = outer.apply_outer(
        tx, tuple(gradient[n] for n in names), state, tuple(master[n] for n in names),
        with_updates=True)
    new_master, updates = dict(zip(names, new_master)), dict(zip(names, updates))
  else:
    new_master, new_state, updates = outer.apply_outer(
        tx, {n: gradient[n] for n in names}, state, {n: master[n] for n in names},
        with_updates=True)
  values = [*gradient.values(), *new_master.values(), *jax.tree.leaves(new_state)]
  if publish is None:
    theta, update = outer.publish(new_master, anchor, specs, commit_wire)
    values += [*theta.values(), *(update or {}).values()]
    published = 0.0
  else:
    (theta, published), update = publish(new_master, updates), None
    if isinstance(published, list):
      values, published = values + published, 0.0
  bad = published + count(values, total)
  if any_kept is not None:
    bad = bad + jnp.where(any_kept, 0.0, 1.0)
  return OuterRound(theta, new_master, new_state, update, bad)
