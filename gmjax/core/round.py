"""The arithmetic of a round over every learner at once: the learners are an array dimension.

A round's deltas are held stacked, the learners along one dimension of each array (the
mail closer's contributions by slot, an in-mesh bucket's source learners), so each step
below is one operation however many learners there are: no program grows with ``M``.

* ``weighted_sum``: ``g = Σ_m w_m · Δ_m`` in F32, in learner order (``m = 0, 1, …``),
  as a ``lax`` loop: the order every runtime sums in, whatever XLA would reassociate.
* ``gram``: the ``M × M`` dot products of the deltas, one contraction per array.
* ``non_finite``: each learner's count of NaN and Inf values.

Both runtimes call these, the mail closer (``gmjax.core.aggregator``) and the in-mesh
exchanges (``gmjax.transform``), so they add and screen alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def weighted_sum(stacked: jax.Array, weights: jax.Array, axis: int = 0) -> jax.Array:
  """``Σ_m weights[m] · stacked[m]`` along ``axis``, in F32, summed in the order of ``m``.

  Args:
    stacked: the learners' values, learner ``m`` at index ``m`` of ``axis``.
    weights: ``(M,)``, one weight a learner.
    axis: the learners' dimension of ``stacked``.

  Returns:
    ``stacked``'s shape without ``axis``, in F32.
  """
  count = stacked.shape[axis]
  w = jnp.asarray(weights, jnp.float32)

  def term(m):
    return w[m] * lax.dynamic_index_in_dim(stacked, m, axis, keepdims=False).astype(
        jnp.float32)

  # From zeros, every term in the loop: a loop of one trip would be inlined, and its
  # terms (and the weights' computation) copied into every fusion that reads the sum.
  # ``0 + w_0·Δ_0`` is ``w_0·Δ_0``, but for the sign of a zero.
  zeros = jnp.zeros_like(lax.index_in_dim(stacked, 0, axis, keepdims=False), jnp.float32)
  return lax.fori_loop(0, count, lambda m, total: total + term(m), zeros)


def gram(stacked: Sequence[jax.Array], axis: int, batch: int | None = None) -> jax.Array:
  """The ``M × M`` F32 matrix of the deltas' dot products, over every array of ``stacked``.

  Args:
    stacked: arrays holding the learners' deltas along ``axis`` (each delta is all of an
      array's other elements, over all the arrays).
    axis: the learners' dimension.
    batch: a dimension (before ``axis``) contracted last, as a batch of products summed
      afterwards: a dimension split over devices, so that each device contracts its own
      piece and only the ``M × M`` sums cross.
  """
  total = None
  for x in stacked:
    x = x.astype(jnp.float32)
    others = [d for d in range(x.ndim) if d not in (axis, batch)]
    batched = () if batch is None else (batch,)
    dots = lax.dot_general(x, x, ((others, others), (batched, batched)),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    if batch is not None:
      dots = jnp.sum(dots, axis=0)
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


def non_finite(stacked: Sequence[jax.Array], axis: int) -> jax.Array:
  """``(M,)`` F32: how many of each learner's values (over every array) are NaN or Inf."""
  total = None
  for x in stacked:
    others = tuple(d for d in range(x.ndim) if d != axis)
    bad = jnp.sum(~jnp.isfinite(x), axis=others).astype(jnp.float32)
    total = bad if total is None else total + bad
  return total
