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
from jax.sharding import PartitionSpec as P

from gmjax.core.codec import BLOCK
from gmjax.transform import explicit


def row_count(size: int, learners: int) -> int:
  """``R``: rows of ``learners`` codec blocks that hold ``size`` elements."""
  return max(1, -(-size // (BLOCK * learners)))


def shard_shape(shape: tuple[int, ...], learners: int) -> tuple[int, int]:
  """The shape ``(R, 32)`` of one learner's shard of a leaf of ``shape``."""
  return (row_count(math.prod(shape), learners), BLOCK)


def _leading(x: jax.Array) -> jax.Array:
  """``x`` with its explicit sharding, if any, on the leading dimension only.

  The rows are cut from the row-major flattening, which keeps a split of the leading
  dimension local to each device; a split of another dimension (tensor parallel) is
  moved there by one all-to-all (each device keeps ``1/F`` of the leaf), or, when the
  leading dimension does not divide, undone.
  """
  entries = explicit.spec(x)
  if entries is None or all(e is None for e in entries[1:]):
    return x
  axes = tuple(a for e in entries if e is not None
               for a in (e if isinstance(e, tuple) else (e,)))
  mesh = jax.typeof(x).sharding.mesh
  devices = math.prod(mesh.shape[a] for a in axes)
  lead = axes if x.shape[0] % devices == 0 else None
  return jax.sharding.reshard(x, P(lead, *([None] * (x.ndim - 1))))


def _kept_axes(x: jax.Array, learners: int) -> tuple:
  """The explicit mesh axes that split the rows of ``x`` (its leading dimension's).

  Empty when ``x`` is not explicitly sharded, or when a device's piece of the leaf is not
  whole rows of ``32·M`` elements (the rows are then replicated over those axes).
  """
  entries = explicit.spec(x)
  if entries is None or not entries or entries[0] is None:
    return ()
  axes = entries[0] if isinstance(entries[0], tuple) else (entries[0],)
  size = math.prod(x.shape)
  rows = row_count(size, learners)
  devices = math.prod(jax.typeof(x).sharding.mesh.shape[a] for a in axes)
  if rows * learners * BLOCK != size or rows % devices:
    return ()
  return axes


def shard_spec(x: jax.Array, learners: int) -> tuple | None:
  """The explicit sharding of a learner's shard ``(R, 32)`` of ``x`` (None: not explicit).

  The state's shards (master, outer state) are created with it, so that the rare steps
  produce values laid out as the state they replace.
  """
  x = _leading(x)
  if explicit.spec(x) is None:
    return None
  axes = _kept_axes(x, learners)
  return (axes or None, None)


def to_rows(x: jax.Array, learners: int) -> jax.Array:
  """``x`` in F32, flattened, zero-padded and viewed as rows ``(R, learners, 32)``.

  Under explicit sharding a leaf split over other axes along its leading dimension keeps
  that split on the rows when every device holds whole rows; a leaf too small for that
  (or whose pieces are not whole rows: fewer than ``32·M`` elements a device, or a size
  that needs padding) is replicated over those axes first.
  """
  x = _leading(x)
  axes = _kept_axes(x, learners)
  flat = jnp.ravel(x).astype(jnp.float32)
  if explicit.spec(flat) is not None and not axes and explicit.spec(flat)[0] is not None:
    flat = jax.sharding.reshard(flat, P(None))
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
  return jnp.sum(explicit.where(mine, rows, jnp.zeros_like(rows)), axis=1)


def valid(shape: tuple[int, ...], learners: int, learner: jax.Array) -> jax.Array:
  """Which elements of shard ``learner`` of a leaf of ``shape`` are real (not padding)."""
  size = math.prod(shape)
  rows = row_count(size, learners)
  row = lax.broadcasted_iota(jnp.int32, (rows, BLOCK), 0)
  column = lax.broadcasted_iota(jnp.int32, (rows, BLOCK), 1)
  return (row * learners + learner) * BLOCK + column < size
