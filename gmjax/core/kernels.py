"""Bit-level kernels of the wire codec: blockwise quantization and 4- and 2-bit packing.

Quantized formats cut a tensor, flattened row-major, into blocks of 32 elements (the last
one zero-padded). Per block ``scale = absmax / Qmax`` in F32 (``Qmax`` = 448 for F8_E4M3,
6 for F4, 7 for I4, 1 for I2); codes are ``x / scale`` rounded to nearest even into
``float8_e4m3fn`` / ``float4_e2m1fn``, or ``clip(round(x / scale), -Qmax, Qmax)`` for the
integer formats. A zero block has scale 0 and zero codes. Decoding is ``code · scale`` in
F32. 4-bit codes travel two per byte, element ``2i`` in the low nibble; 2-bit codes four
per byte, element ``4i + j`` in bits ``2j, 2j+1`` of byte ``i``. Integer codes are two's
complement.

The integer formats have one code the encoder never produces: ``-8`` for I4 and ``-2`` for
I2 (``-Qmax - 1``). A payload is not rejected for holding it; it decodes as any other code
does, to ``-8 · scale`` or ``-2 · scale`` (finite for a finite scale, and subject to the
same checks downstream as every decoded value).

Subnormal F32 values count as zero wherever they appear (inputs, scales, decoded values):
XLA flushes them on CPU and TPU, and doing it explicitly gives the same bytes on every
backend.

Every function here is pure JAX on single arrays (jittable, vmappable); the pytree API
(layouts, payload entries by name) is ``gmjax.core.codec``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmjax.core.records import QUANTIZED

BLOCK = 32
QMAX = {"F8_E4M3": 448.0, "F4": 6.0, "I4": 7.0, "I2": 1.0}
CODE_BITS = {"F8_E4M3": 8, "F4": 4, "I4": 4, "I2": 2}
"""Bits per code of each quantized format."""


def num_blocks(size: int) -> int:
  return -(-size // BLOCK)


def packed_size(size: int, bits: int = 4) -> int:
  """Bytes of ``size`` codes of ``bits`` (4 or 2) packed ``8 // bits`` per byte."""
  per_byte = 8 // bits
  return -(-size // per_byte)


_ABS_BITS = 0x7FFFFFFF
_SMALLEST_NORMAL_BITS = 0x00800000
_SMALLEST_NORMAL = np.float32(2.0**-126)
# Per float dtype: the mask of a value's magnitude bits, and the bit pattern of infinity
# (magnitudes at or above it are Inf or NaN).
_INFINITY_BITS = {
    jnp.dtype(jnp.float32): (0x7FFFFFFF, 0x7F800000),
    jnp.dtype(jnp.float16): (0x7FFF, 0x7C00),
    jnp.dtype(jnp.bfloat16): (0x7FFF, 0x7F80),
}
# Magnitudes where an e2m1 code steps up, with whether the tie itself steps (to an even
# code): 0.25→0, 0.75→1.0, 1.25→1.0, 1.75→2.0, 2.5→2.0, 3.5→4.0, 5.0→4.0.
_F4_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
             (3.5, True), (5.0, False))
# Adding 1.5 * 2**23 to a float of magnitude below 2**22 rounds it to an integer, to
# nearest even, and leaves that integer in the low bits of the sum's bit pattern, in two's
# complement: its low four bits are the I4 code, its low two the I2 code.
_ROUND_TO_INTEGER = np.float32(1.5 * 2.0**23)
# Where each code of ``bits`` sits in a packed little-endian uint32 word, by ``bits``.
_SHIFTS = {bits: np.arange(0, 32, bits, dtype=np.uint32) for bits in (2, 4)}


def _shape(shape: Any) -> tuple[int, ...]:
  """``dequantize``'s ``shape`` as a tuple of non-negative ints: 64.7 was taken as 64,
  and a bare 64 failed with "'int' object is not iterable"."""
  try:
    dims = tuple(operator.index(d) for d in shape)
  except TypeError:
    dims = None
  if dims is None or any(d < 0 for d in dims):
    raise ValueError(f"dequantize: shape must be a tuple of non-negative ints (the array's"
                     f" shape, e.g. (64,)), got {shape!r}.")
  return dims


def _blocks(x: jax.Array) -> jax.Array:
  flat = jnp.ravel(x).astype(jnp.float32)
  pad = num_blocks(flat.size) * BLOCK - flat.size
  if pad:
    flat = jnp.pad(flat, (0, pad))
  return flat.reshape(-1, BLOCK)


def _abs_bits_max(values: jax.Array, axis=None) -> jax.Array:
  """The largest ``|x|`` as its int32 bit pattern.

  For non-negative floats the bit patterns order like the values, with Inf above every
  finite value and NaN above Inf, so an integer max finds the absmax and flags non-finite
  values in one vectorizable pass (a float max must also propagate NaN, which XLA's CPU
  backend compiles to much slower code).
  """
  bits = lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32) & _ABS_BITS
  return jnp.max(bits, axis=axis)


def all_finite(value: jax.Array) -> jax.Array:
  """Whether every element of an F32, F16 or BF16 array is finite."""
  mask, infinity = _INFINITY_BITS[value.dtype]
  bits = lax.bitcast_convert_type(value, jnp.int32 if mask == _ABS_BITS else jnp.int16)
  bits = jnp.ravel(bits).astype(jnp.int32) & mask
  if value.size % BLOCK == 0 and value.size:
    # The largest magnitude of each short row by integer max, then one boolean reduction:
    # XLA's CPU backend runs the row reductions as a parallel loop, much faster than one
    # reduction over the whole tensor (the comparison in between keeps it from merging
    # the two) or than a float max, which must propagate NaN.
    return jnp.all(jnp.max(bits.reshape(-1, BLOCK), axis=1) < infinity)
  return jnp.all(bits < infinity)


def f4_codes(scaled: jax.Array) -> jax.Array:
  """e2m1 codes (int32 nibbles) of ``scaled``, rounded to nearest even, saturating at 6.

  A count of the steps below ``|scaled|``: XLA's CPU backend vectorizes these compares
  better than integer arithmetic on the bit patterns (as ``f8_e4m3_codes`` does).
  """
  magnitude = jnp.abs(scaled)
  code = jnp.zeros(scaled.shape, jnp.int32)
  for step, tie_up in _F4_STEPS:
    code = code + (magnitude >= step if tie_up else magnitude > step).astype(jnp.int32)
  negative = lax.bitcast_convert_type(scaled, jnp.int32) < 0
  return code | jnp.where(negative, 8, 0)


def f8_e4m3_codes(scaled: jax.Array) -> jax.Array:
  """``scaled`` (F32, ``|scaled| <= 448`` or NaN) as ``float8_e4m3fn``, rounded to nearest even.

  Integer arithmetic on the F32 bit patterns: XLA's CPU backend converts F32 to F8 with
  scalar code, several times slower than this vectorized form. Same bytes as the convert.
  """
  bits = lax.bitcast_convert_type(scaled, jnp.int32)
  magnitude = bits & _ABS_BITS
  # Normal codes (|x| >= 2^-6): keep 3 of the 23 mantissa bits, rounding to nearest even
  # (a carry out of the mantissa steps the exponent, as it should), then rebias 127 -> 7.
  normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - ((127 - 7) << 3)
  # Subnormal codes are multiples of 2^-9: adding 2^14 (whose ulp is 2^-9) rounds |x| to
  # one, to nearest even, and leaves the multiple in the low mantissa bits; 2^-6 itself
  # comes out as 8, the smallest normal code.
  absolute = lax.bitcast_convert_type(magnitude, jnp.float32)
  subnormal = lax.bitcast_convert_type(absolute + jnp.float32(2.0**14), jnp.int32) - 0x46800000
  code = jnp.where(magnitude < 0x3C800000, subnormal, normal)  # 0x3C800000 is 2^-6
  code = jnp.where(magnitude > 0x7F800000, 0x7F, code)  # NaN stays NaN
  code = code | ((bits >> 24) & 0x80)
  return lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn)


def f8_e4m3_values(codes: jax.Array) -> jax.Array:
  """F32 values of ``float8_e4m3fn`` codes, by integer arithmetic (vectorizes)."""
  byte = lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)
  magnitude = byte & 0x7F
  # Normal codes: exponent rebiased 7 -> 127, mantissa moved to the top of F32's.
  normal = lax.bitcast_convert_type((magnitude << 20) + ((127 - 7) << 23), jnp.float32)
  subnormal = magnitude.astype(jnp.float32) * jnp.float32(2.0**-9)
  value = jnp.where(magnitude < 8, subnormal, normal)
  value = jnp.where(magnitude == 0x7F, jnp.float32(np.nan), value)
  return jnp.where(byte >= 0x80, -value, value)


def f4_values(nibbles: jax.Array) -> jax.Array:
  """F32 values of e2m1 nibbles (int32 in 0..15)."""
  exponent = (nibbles >> 1) & 3
  mantissa = nibbles & 1
  normal = lax.bitcast_convert_type((exponent + 126) << 23 | mantissa << 22, jnp.float32)
  magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 0.5, normal)
  return jnp.where(nibbles & 8 != 0, -magnitude, magnitude)


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
  """Packs int32 codes of ``bits`` (4 or 2) ``8 // bits`` per byte along the last axis (a
  multiple of ``32 // bits`` long): element ``k`` of each byte in bits ``k·bits`` and up.

  ``32 // bits`` codes make one little-endian uint32, ``sum(c_k << k·bits)``, read back as
  four bytes. XLA's CPU backend vectorizes this sum over a short axis well, better than a
  bitwise-or reduction, strided slices, or uint8 -> uint32 bitcasts (it fuses those into
  scalar loops).
  """
  shape = codes.shape[:-1]
  shifts = _SHIFTS[bits]
  mask = (1 << bits) - 1
  # Explicit lengths: ``-1`` cannot be inferred for an empty array.
  count = codes.shape[-1] // shifts.size
  words = (codes & mask).astype(jnp.uint32).reshape(*shape, count, shifts.size)
  words = jnp.sum(words << shifts, axis=-1, dtype=jnp.uint32)
  return lax.bitcast_convert_type(words, jnp.uint8).reshape(*shape, 4 * count)


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
  """int32 codes of ``bits`` (4 or 2) of packed bytes along the last axis (a multiple of 4
  long), low bits first: the inverse of ``pack_codes``, each uint32 word shifted right by
  ``k·bits``."""
  shape, count = packed.shape[:-1], packed.shape[-1] // 4
  words = lax.bitcast_convert_type(packed.reshape(*shape, count, 4), jnp.uint32)
  codes = (words[..., None] >> _SHIFTS[bits]) & ((1 << bits) - 1)
  return codes.astype(jnp.int32).reshape(*shape, count * _SHIFTS[bits].size)


def pack_nibbles(nibbles: jax.Array) -> jax.Array:
  """Packs int32 nibbles two per byte along the last axis (a multiple of 8 long): element
  ``2i`` in the low nibble (``pack_codes`` of 4 bits)."""
  return pack_codes(nibbles, 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """int32 nibbles of packed bytes along the last axis (a multiple of 4 long), low nibble
  first: the inverse of ``pack_nibbles``."""
  return unpack_codes(packed, 4)


def quantize(x: jax.Array, precision: str) -> tuple[jax.Array, jax.Array]:
  """Blockwise absmax quantization of ``x``.

  Args:
    x: a float array of any shape.
    precision: ``"F8_E4M3"``, ``"F4"``, ``"I4"`` or ``"I2"``.

  Returns:
    ``(codes, scales)``: F8 codes as ``float8_e4m3fn`` of ``x``'s shape; F4/I4 codes packed
    two per byte as ``uint8`` of shape ``(ceil(n/2),)``, I2 codes four per byte, shape
    ``(ceil(n/4),)``; scales F32 of shape ``(ceil(n/32),)``. NaN/Inf make the block's
    scale non-finite (``encode`` refuses them).
  """
  if precision not in QUANTIZED:
    raise ValueError(f"quantize: precision={precision!r} is not one of {list(QUANTIZED)}.")
  x = jnp.asarray(x)  # a list or numpy array too
  blocks = _blocks(x)
  qmax = QMAX[precision]
  absmax = lax.bitcast_convert_type(_abs_bits_max(blocks, axis=1), jnp.float32)
  # XLA rewrites a division by a broadcast value into a multiplication by its reciprocal,
  # which rounds twice and moves some quotients by an ulp. Each divisor below depends on
  # the value it divides, so it is no broadcast and the division stays exact; the values
  # it takes where it differs (1 for zeros) give the same quotient.
  scales = absmax / jnp.where(absmax != 0, jnp.float32(qmax), jnp.float32(1))
  # Subnormals count as zero (XLA flushes them on CPU and TPU; saying so here keeps the
  # bytes the same on every backend): a scale below the smallest normal float is 0.
  # (Written so that a NaN or infinite scale stays one: encode refuses those blocks.)
  scales = jnp.where(scales < _SMALLEST_NORMAL, jnp.float32(0), scales)
  scale = scales[:, None]
  normal = (lax.bitcast_convert_type(blocks, jnp.int32) & _ABS_BITS) >= _SMALLEST_NORMAL_BITS
  divisor = jnp.where(normal, scale, jnp.float32(1))
  # A zero block, or one whose scale is zero, has all-zero codes; so has a zero or
  # subnormal value.
  scaled = jnp.where(normal & (scale > 0), blocks / divisor, jnp.float32(0))
  # The scale's rounding can take a quotient just past qmax; clipping keeps every code
  # within ±Qmax, the codes the format defines (README.md, "The codec").
  # (float8_e4m3fn has no infinity and does not saturate: 465 would become NaN.)
  scaled = jnp.clip(scaled, -qmax, qmax)
  size = math.prod(x.shape)
  if precision == "F8_E4M3":
    codes = f8_e4m3_codes(scaled)
    return codes.reshape(-1)[:size].reshape(x.shape), scales
  if precision == "F4":
    fields = f4_codes(scaled)
  else:  # I4 and I2: |scaled| <= Qmax, the rounded integer in two's complement
    fields = lax.bitcast_convert_type(scaled + _ROUND_TO_INTEGER, jnp.int32)
  # Blocks are 32 long, so the padded codes fill whole words.
  bits = CODE_BITS[precision]
  return pack_codes(fields, bits).reshape(-1)[: packed_size(size, bits)], scales


def dequantize(
    codes: jax.Array, scales: jax.Array, shape: tuple[int, ...], precision: str
) -> jax.Array:
  """The F32 tensor of ``shape`` that ``quantize`` codes and scales stand for."""
  if precision not in QUANTIZED:
    raise ValueError(
        f"dequantize: precision={precision!r} is not one of {list(QUANTIZED)}."
    )
  shape = _shape(shape)
  size = math.prod(shape)
  blocks = num_blocks(size)
  codes = jnp.asarray(codes)
  # quantize's sizes, checked: a short scale vector broadcast, short codes padded with
  # zeros, both decoded silently to other values.
  count = size if precision == "F8_E4M3" else packed_size(size, CODE_BITS[precision])
  if jnp.size(codes) != count or jnp.shape(scales) != (blocks,):
    raise ValueError(
        f"dequantize: {precision} codes of {size} values in shape {shape} are {count}"
        f" codes and {blocks} scales (quantize's), got {jnp.size(codes)} codes and scales"
        f" of shape {jnp.shape(scales)}; pass quantize's codes and scales of that shape.")
  if precision == "F8_E4M3":
    values = f8_e4m3_values(jnp.ravel(codes).astype(jnp.float8_e4m3fn))
    pad = blocks * BLOCK - size
    if pad:
      values = jnp.pad(values, (0, pad))
  else:
    bits = CODE_BITS[precision]
    packed = jnp.ravel(codes).astype(jnp.uint8)
    pad = blocks * BLOCK * bits // 8 - packed.size
    if pad:
      packed = jnp.pad(packed, (0, pad))
    fields = unpack_codes(packed.reshape(blocks, BLOCK * bits // 8), bits)
    if precision == "F4":
      values = f4_values(fields)
    else:  # sign-extend two's complement: I4 -8 and I2 -2 decode as they read
      values = ((fields << (32 - bits)) >> (32 - bits)).astype(jnp.float32)
  scales = jnp.asarray(scales, jnp.float32)
  # A subnormal scale is zero, as quantize makes it (a hostile payload may hold one; a
  # backend that keeps subnormals would otherwise decode a normal product).
  scales = jnp.where(jnp.abs(scales) < _SMALLEST_NORMAL, jnp.float32(0), scales)
  values = values.reshape(blocks, BLOCK) * scales[:, None]
  # Subnormal products count as zero, on every backend (see quantize).
  # (NaN stays NaN, for the checks downstream.)
  values = jnp.where(jnp.abs(values) < _SMALLEST_NORMAL, jnp.float32(0), values)
  if blocks * BLOCK == size:
    return values.reshape(shape)
  return values.reshape(-1)[:size].reshape(shape)
