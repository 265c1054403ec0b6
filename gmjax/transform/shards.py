"""Where learner ``k``'s shard of a leaf lies: padding, rows of codec blocks, masks.

With ``M`` learners, a leaf of ``n`` elements is flattened row-major, zero-padded to
``L = ⌈n / (32·M)⌉ · 32·M`` and viewed as ``rows`` of shape ``(R, M, 32)`` with
``R = L / (32·M)``: element ``i`` sits at ``(i // 32M, (i // 32) mod M, i mod 32)``.
Learner ``k`` owns ``rows[:, k, :]``: every ``M``-th codec block, ``R`` whole blocks, the
same count for every learner. Blocks of 32 stay the codec's blocks (the padding only
appends zeros, as the codec's own padding of the last block does), so quantizing rows
gives the codes and scales of the whole leaf.

The blocks of one shard are interleaved rather than contiguous: a leaf whose first
dimension is sharded over other mesh axes (FSDP) holds whole rows on each device
whenever its piece is a multiple of ``32·M`` elements, so the flattening, the
``all_to_all`` over the learner axis and the way back are local to each device, and no
parameter is gathered over the other axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from gmjax.core.codec import BLOCK


def row_count(size: int, learners: int) -> int:
  """``R``: rows of ``learners`` codec blocks that hold ``size`` elements."""
  return max(1, -(-size // (BLOCK * learners)))


def shard_shape(shape: tuple[int, ...], learners: int) -> tuple[int, int]:
  """The shape ``(R, 32)`` of one learner's shard of a leaf of ``shape``."""
  return (row_count(math.prod(shape), learners), BLOCK)


def to_rows(x: jax.Array, learners: int) -> jax.Array:
  """``x`` in F32, flattened, zero-padded and viewed as rows ``(R, learners, 32)``."""
  flat = jnp.ravel(x).astype(jnp.float32)
  rows = row_count(flat.size, learners)
  pad = rows * learners * BLOCK - flat.size
  if pad:
    flat = jnp.pad(flat, (0, pad))
  return flat.reshape(rows * learners, BLOCK).reshape(rows, learners, BLOCK)


def from_rows(rows: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The leaf of ``shape`` that ``rows`` ``(R, M, …)`` hold (padding dropped)."""
  size = math.prod(shape)
  flat = rows.reshape(rows.shape[0] * rows.shape[1], -1).reshape(-1)
  if flat.size != size:
    flat = flat[:size]
  return flat.reshape(shape)


def own(rows: jax.Array, learner: jax.Array) -> jax.Array:
  """Shard ``learner`` of ``rows`` ``(R, M, 32)``, shape ``(R, 32)``.

  A masked sum over the learner dimension rather than an index: exact (it adds zeros),
  local to each device, and the same code whether ``learner`` is a scalar
  (``shard_map``, ``pmap``) or batched (``vmap``).
  """
  mine = lax.broadcasted_iota(jnp.int32, (1, rows.shape[1], 1), 1) == learner
  return jnp.sum(jnp.where(mine, rows, jnp.zeros_like(rows)), axis=1)


def valid(shape: tuple[int, ...], learners: int, learner: jax.Array) -> jax.Array:
  """Which elements of shard ``learner`` of a leaf of ``shape`` are real (not padding)."""
  size = math.prod(shape)
  rows = row_count(size, learners)
  row = lax.broadcasted_iota(jnp.int32, (rows, BLOCK), 0)
  column = lax.broadcasted_iota(jnp.int32, (rows, BLOCK), 1)
  return (row * learners + learner) * BLOCK + column < size
