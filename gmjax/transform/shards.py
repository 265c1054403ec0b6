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

A leaf split along other dimensions too (tensor parallel: Megatron-style weights split on
their last dimension; a block of stacked layers split on the dimension after its layers)
holds, on each device, runs of consecutive elements of the row-major flattening. When
every run is whole codec blocks (a multiple of 32 elements) and each device holds whole
rows (a multiple of ``32·M``), the rows are ordered device by device: device ``d``'s
elements come ``d``-th, in their row-major order, cut into rows of ``M`` blocks. The
codec's blocks are those of the row-major order and every learner owns ``R`` of them;
which learner owns which block differs from the row-major layout, and nothing moves
between devices. Otherwise the split is moved to the leading dimension or undone first.
"""

from __future__ import annotations

import math
from typing import Any

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


def _axes_of(entry: Any) -> tuple[str, ...]:
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _local_runs(x: jax.Array, learners: int) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
  """The split dimensions of ``x`` and their mesh axes, when rows go device by device.

  None off explicit meshes, when only the leading dimension is split (the row-major
  order is then already device by device), when a device's runs of consecutive
  elements are not whole codec blocks or its elements not whole rows of ``32·M``, and
  for an empty leaf (one row of padding, ``to_rows``).
  """
  entries = explicit.spec(x)
  if entries is None or x.size == 0:
    return None
  dims = tuple(d for d, e in enumerate(entries) if e is not None)
  if not dims or dims == (0,):
    return None
  mesh = jax.typeof(x).sharding.mesh
  sizes = [math.prod(mesh.shape[a] for a in _axes_of(entries[d])) for d in dims]
  if any(x.shape[d] % size for d, size in zip(dims, sizes)):
    return None
  last = dims[-1]
  run = x.shape[last] // sizes[-1] * math.prod(x.shape[last + 1:])
  if run % BLOCK or (x.size // math.prod(sizes)) % (BLOCK * learners):
    return None
  return dims, tuple(a for d in dims for a in _axes_of(entries[d]))


def _split(shape: tuple[int, ...], entries: tuple, dims: tuple[int, ...], mesh: Any):
  """The shape and spec of a leaf whose split dimensions ``d`` are cut as
  ``(devices_d, n_d / devices_d)``, and the positions of the device dimensions."""
  split, spec, devices = [], [], []
  for d, n in enumerate(shape):
    if d in dims:
      size = math.prod(mesh.shape[a] for a in _axes_of(entries[d]))
      devices.append(len(split))
      split += [size, n // size]
      spec += [entries[d], None]
    else:
      split.append(n)
      spec.append(None)
  return tuple(split), tuple(spec), devices


def _to_local_rows(x: jax.Array, learners: int, dims: tuple[int, ...],
                   axes: tuple[str, ...]) -> jax.Array:
  entries, mesh = explicit.spec(x), jax.typeof(x).sharding.mesh
  split, spec, devices = _split(x.shape, entries, dims, mesh)
  y = jnp.reshape(x, split, out_sharding=P(*spec))
  rest = [i for i in range(len(split)) if i not in devices]
  y = jnp.transpose(y, devices + rest)  # device dimensions first: a local relabelling
  rows = row_count(x.size, learners)
  return jnp.reshape(y.astype(jnp.float32), (rows, learners, BLOCK),
                     out_sharding=P(axes, None, None))


def _from_local_rows(rows: jax.Array, like: jax.Array, dims: tuple[int, ...]) -> jax.Array:
  entries, mesh = explicit.spec(like), jax.typeof(like).sharding.mesh
  split, spec, devices = _split(like.shape, entries, dims, mesh)
  rest = [i for i in range(len(split)) if i not in devices]
  order = devices + rest
  y = jnp.reshape(rows, tuple(split[i] for i in order),
                  out_sharding=P(*(spec[i] for i in order)))
  y = jnp.transpose(y, [order.index(i) for i in range(len(split))])
  return jnp.reshape(y, like.shape, out_sharding=P(*entries))


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
  local = _local_runs(x, learners)
  if local is not None:
    return (local[1], None)
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
  that needs padding) is replicated over those axes first. A leaf split along other
  dimensions in runs of whole blocks keeps its split (device by device: see the module
  docstring).
  """
  if x.size == 0:
    # One row of padding. JAX cannot flatten an empty array split over a mesh (under
    # ``vmap``, the learners' axis); its empty sum is a zero batched as it is.
    zero = jnp.sum(x, dtype=jnp.float32)
    return jnp.broadcast_to(zero, (row_count(0, learners), learners, BLOCK))
  local = _local_runs(x, learners)
  if local is not None:
    return _to_local_rows(x, learners, *local)
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


def from_rows(rows: jax.Array, shape: tuple[int, ...], like: jax.Array | None = None
              ) -> jax.Array:
  """The leaf of ``shape`` that ``rows`` ``(R, M, …)`` hold (padding dropped).

  ``like``: the leaf the rows were cut from (``to_rows``), whose split decides their
  order, and whose layout the result takes; None for rows in the row-major order.
  """
  local = None if like is None else _local_runs(like, rows.shape[1])
  if local is not None:
    return _from_local_rows(rows, like, local[0])
  if like is not None:
    return explicit.like(from_rows(rows, shape), like)
  size = math.prod(shape)
  if size == 0:  # (``to_rows``) an empty sum: no reshape of an array split over a mesh
    return jnp.broadcast_to(jnp.sum(rows[:0], dtype=rows.dtype), shape)
  flat = rows.reshape(rows.shape[0] * rows.shape[1], -1).reshape(-1)
  if flat.size != size:
    flat = flat[:size]
  return flat.reshape(shape)


def own(rows: jax.Array, learner: jax.Array, axis: int = 1) -> jax.Array:
  """Shard ``learner`` of ``rows`` ``(R, M, 32)``, shape ``(R, 32)`` (or of any array whose
  learners' dimension is ``axis``, e.g. a bucket ``(F, S, M, 32)`` with ``axis=2``).

  A masked sum over the learner dimension rather than an index: exact (it adds zeros),
  local to each device, and the same code whether ``learner`` is a scalar
  (``shard_map``, ``pmap``) or batched (``vmap``).
  """
  shape = [1] * rows.ndim
  shape[axis] = rows.shape[axis]
  mine = lax.broadcasted_iota(jnp.int32, tuple(shape), axis) == learner
  return jnp.sum(explicit.where(mine, rows, jnp.zeros_like(rows)), axis=axis)


def valid(shape: tuple[int, ...], learners: int, learner: jax.Array) -> jax.Array:
  """Which elements of shard ``learner`` of a leaf of ``shape`` are real (not padding)."""
  size = math.prod(shape)
  rows = row_count(size, learners)
  row = lax.broadcasted_iota(jnp.int32, (rows, BLOCK), 0)
  column = lax.broadcasted_iota(jnp.int32, (rows, BLOCK), 1)
  return (row * learners + learner) * BLOCK + column < size
