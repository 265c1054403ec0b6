"""Sparse top-k deltas: per chunk of a flattened leaf, its ``k`` largest magnitudes.

A leaf of ``n`` values, flattened row-major, is cut into chunks of ``chunk`` values (the
last one may be shorter). Each chunk keeps ``min(k, its length)`` values: those of the
largest magnitude, ties going to the lower index. Magnitudes are compared as
``gmjax.core.kernels`` treats values: subnormals count as zero (NaN ranks above Inf,
above every finite value; such a delta is refused anyway).

The kept values, chunk after chunk and by ascending index within a chunk, form a vector
of ``K`` values that travels as a dense tensor of shape ``(K,)`` at the delta precision
(``gmjax.core.wire``: a cast, or codes with one F32 scale per 32 kept values) under the
leaf's name; ``<name>.index`` holds each kept value's index within its chunk, ``(K,)``
in the smallest unsigned dtype that holds ``chunk`` (``U8`` up to 256, ``U16`` up to
65536, else ``U32``). Decoding scatters the decoded values to their positions, zeros
elsewhere.

Here are the selection, the scatter back and the index checks; ``gmjax.core.wire.Wire``
encodes and decodes with them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmjax.core.kernels import BLOCK
from gmjax.core.schema import INDEX

_ABS_BITS = 0x7FFFFFFF
_SMALLEST_NORMAL_BITS = 0x00800000
JNP_INDEX = {"U8": jnp.uint8, "U16": jnp.uint16, "U32": jnp.uint32}


def index_name(name: str) -> str:
  return name + INDEX


def index_dtype(chunk: int) -> str:
  """The dtype code of ``<name>.index`` entries for chunks of ``chunk`` values."""
  if chunk <= 256:
    return "U8"
  if chunk <= 65536:
    return "U16"
  return "U32"


def chunk_counts(size: int, topk: int, chunk: int) -> tuple[int, ...]:
  """Values kept in each chunk of a leaf of ``size`` values."""
  full, last = divmod(size, chunk)
  return (min(topk, chunk),) * full + ((min(topk, last),) if last else ())


def kept_size(size: int, topk: int, chunk: int) -> int:
  """``K``: values a leaf of ``size`` keeps."""
  return sum(chunk_counts(size, topk, chunk))


def whole_run(topk: int, chunk: int) -> int:
  """The values of a flat leaf that a device's piece must hold a multiple of to encode,
  travel and decode on its own.

  Whole chunks (each chunk chooses its values among its own), enough of them that their
  ``min(topk, chunk)`` kept values each fill whole blocks of 32 (the blocks of the
  quantized formats' scales and of the finiteness probe run over the kept values end
  to end): ``chunk · 32 / gcd(min(topk, chunk), 32)``.
  """
  return chunk * (BLOCK // math.gcd(min(topk, chunk), BLOCK))


def select(value: jax.Array, topk: int, chunk: int) -> tuple[jax.Array, jax.Array]:
  """The kept values of ``value`` (flattened) and their indices within their chunks.

  Chunk by chunk: one sort of each chunk's magnitudes with their positions, the first
  ``k`` of each kept, then one sort of those by position. A value split row-major over
  devices (FSDP) in pieces of whole chunks is selected where it lies: nothing is
  gathered.

  Returns:
    ``(values, indices)``, both ``(K,)``: ``value``'s dtype, and int32.
  """
  flat = jnp.ravel(value)
  size = flat.size
  chunk = _length(chunk, size)
  chunks = -(-size // chunk)
  kept = min(topk, chunk)
  key = lax.bitcast_convert_type(flat.astype(jnp.float32), jnp.int32) & _ABS_BITS
  key = jnp.where(key < _SMALLEST_NORMAL_BITS, 0, key)
  pad = chunks * chunk - size
  if pad:
    # Padding ranks below every value, so it is kept only where a chunk is shorter than
    # k, and then after every real index. A padded leaf's chunks cannot be its devices'
    # pieces: its kept values are read from the leaf by position.
    key = jnp.pad(key, (0, pad), constant_values=-1).reshape(chunks, chunk)
    order = lax.broadcasted_iota(jnp.int32, key.shape, 1)
    _, order = lax.sort((-key, order), dimension=1, num_keys=2)
    indices = jnp.sort(order[:, :kept], axis=1).reshape(-1)[:kept_size(size, topk, chunk)]
    return flat[_chunk_starts(size, topk, chunk) + indices], indices
  # Whole chunks: the values ride the sorts with their positions, so that chunks lying on
  # different devices are selected where they lie; the positions take the magnitudes'
  # layout (on an explicit mesh a sort's operands must share one).
  key, flat = key.reshape(chunks, chunk), flat.reshape(chunks, chunk)
  order = lax.broadcasted_iota(jnp.int32, key.shape, 1,
                               out_sharding=jax.typeof(key).sharding)
  _, order, flat = lax.sort((-key, order, flat), dimension=1, num_keys=2)
  order, flat = lax.sort((order[:, :kept], flat[:, :kept]), dimension=1, num_keys=1)
  return flat.reshape(-1), order.reshape(-1)


def _length(chunk: int, size: int) -> int:
  """The chunk length a leaf of ``size`` values is worked in: a leaf shorter than a chunk
  is one chunk of its own length (the same indices), so that selecting and scattering
  it take memory and sorts of its size, not of ``chunk``."""
  return max(1, min(chunk, size))


def _chunk_starts(size: int, topk: int, chunk: int) -> np.ndarray:
  """The first position of the chunk of each kept value (static)."""
  counts = chunk_counts(size, topk, chunk)
  return np.repeat(np.arange(len(counts), dtype=np.int32) * chunk, counts)


def scatter(values: jax.Array, indices: jax.Array, size: int, topk: int, chunk: int
            ) -> jax.Array:
  """The ``(size,)`` F32 vector holding ``values`` at their chunks' ``indices``, else 0.

  Chunk by chunk (one scatter batched over the chunks), so that values split over
  devices in pieces of whole chunks are written where they lie.
  """
  chunk = _length(chunk, size)
  chunks = -(-size // chunk)
  kept = min(topk, chunk)
  values = jnp.asarray(values).astype(jnp.float32)
  indices = jnp.asarray(indices).astype(jnp.int32)
  missing = chunks * kept - values.size
  if missing:  # the last chunk keeps fewer: its extra positions lie past the chunk
    values = jnp.pad(values, (0, missing))
    indices = jnp.pad(indices, (0, missing), constant_values=chunk)
  values, indices = values.reshape(chunks, kept), indices.reshape(chunks, kept)
  out = jax.vmap(lambda i, v: jnp.zeros(chunk, jnp.float32).at[i].set(v, mode="drop"))(
      indices, values).reshape(-1)
  return out if out.size == size else out[:size]


def index_problem(index: np.ndarray, size: int, topk: int, chunk: int) -> str | None:
  """Why a ``<name>.index`` entry of a leaf of ``size`` is invalid, or None.

  Each chunk's indices must lie in ``[0, chunk length)`` and rise strictly (sorted,
  no repeats). The entry's dtype and shape are checked against the layout beforehand.
  """
  counts = chunk_counts(size, topk, chunk)
  index = np.asarray(index).astype(np.int64).reshape(-1)
  starts = np.cumsum((0,) + counts[:-1])
  lengths = np.array([min(chunk, size - c * chunk) for c in range(len(counts))], np.int64)
  length = np.repeat(lengths, counts)
  out = np.flatnonzero(index >= length)
  if out.size:
    i = int(out[0])
    chunk_of = int(np.searchsorted(starts, i, side="right") - 1)
    return (f"index {int(index[i])} at position {i} is out of range for chunk {chunk_of}"
            f" of {int(length[i])} values")
  first = np.zeros(index.size, bool)
  first[starts[np.asarray(counts) > 0]] = True
  step = np.diff(index, prepend=-1)
  bad = np.flatnonzero(~first & (step <= 0))
  if bad.size:
    i = int(bad[0])
    chunk_of = int(np.searchsorted(starts, i, side="right") - 1)
    what = "repeats" if step[i] == 0 else "is below"
    return (f"index {int(index[i])} at position {i} {what} the index before it in chunk"
            f" {chunk_of}: indices must rise strictly within a chunk")
  return None
