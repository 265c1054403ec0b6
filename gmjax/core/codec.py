"""The wire codec: casts, blockwise quantization and 4-bit packing, as pure JAX functions.

Quantized formats cut a tensor, flattened row-major, into blocks of 32 elements (the last
one zero-padded). Per block ``scale = absmax / Qmax`` in F32 (``Qmax`` = 448 for F8_E4M3,
6 for F4, 7 for I4); codes are ``x / scale`` rounded to nearest even into
``float8_e4m3fn`` / ``float4_e2m1fn``, or ``clip(round(x / scale), -7, 7)`` for I4. A zero
block has scale 0 and zero codes. Decoding is ``code · scale`` in F32. 4-bit codes travel
two per byte, element ``2i`` in the low nibble.

Subnormal F32 values count as zero wherever they appear (inputs, scales, decoded values):
XLA flushes them on CPU and TPU, and doing it explicitly gives the same bytes on every
backend.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmjax.core.records import DTYPES, PRECISIONS, QUANTIZED, Precision
from gmjax.core.schema import NUMPY_DTYPES, ParameterSpec, Schema, dtype_code, scale_name

BLOCK = 32
QMAX = {"F8_E4M3": 448.0, "F4": 6.0, "I4": 7.0}
_JNP = {"F32": jnp.float32, "F16": jnp.float16, "BF16": jnp.bfloat16}


def check_precision(precision: Any, argument: str = "precision") -> Precision:
  """Returns ``precision`` if gmjax knows it, else raises a ValueError naming it."""
  if precision not in PRECISIONS:
    raise ValueError(
        f"{argument}={precision!r} is not a known precision; use one of"
        f" {list(PRECISIONS)}."
    )
  return precision


def num_blocks(size: int) -> int:
  return -(-size // BLOCK)


def packed_size(size: int) -> int:
  return -(-size // 2)


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
# complement: its low four bits are the I4 nibble.
_ROUND_TO_INTEGER = np.float32(1.5 * 2.0**23)
# Where each of the eight nibbles of a packed little-endian uint32 word sits.
_NIBBLE_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


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


def _all_finite(value: jax.Array) -> jax.Array:
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


def _f4_nibbles(scaled: jax.Array) -> jax.Array:
  """e2m1 codes (int32 nibbles) of ``scaled``, rounded to nearest even, saturating at 6.

  A count of the steps below ``|scaled|``: XLA's CPU backend vectorizes these compares
  better than integer arithmetic on the bit patterns (as ``_f8_e4m3`` does).
  """
  magnitude = jnp.abs(scaled)
  code = jnp.zeros(scaled.shape, jnp.int32)
  for step, tie_up in _F4_STEPS:
    code = code + (magnitude >= step if tie_up else magnitude > step).astype(jnp.int32)
  negative = lax.bitcast_convert_type(scaled, jnp.int32) < 0
  return code | jnp.where(negative, 8, 0)


def _f8_e4m3(scaled: jax.Array) -> jax.Array:
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


def _f8_e4m3_values(codes: jax.Array) -> jax.Array:
  """F32 values of ``float8_e4m3fn`` codes, by integer arithmetic (vectorizes)."""
  byte = lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)
  magnitude = byte & 0x7F
  # Normal codes: exponent rebiased 7 -> 127, mantissa moved to the top of F32's.
  normal = lax.bitcast_convert_type((magnitude << 20) + ((127 - 7) << 23), jnp.float32)
  subnormal = magnitude.astype(jnp.float32) * jnp.float32(2.0**-9)
  value = jnp.where(magnitude < 8, subnormal, normal)
  value = jnp.where(magnitude == 0x7F, jnp.float32(np.nan), value)
  return jnp.where(byte >= 0x80, -value, value)


def _f4_values(nibbles: jax.Array) -> jax.Array:
  """F32 values of e2m1 nibbles (int32 in 0..15)."""
  exponent = (nibbles >> 1) & 3
  mantissa = nibbles & 1
  normal = lax.bitcast_convert_type((exponent + 126) << 23 | mantissa << 22, jnp.float32)
  magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 0.5, normal)
  return jnp.where(nibbles & 8 != 0, -magnitude, magnitude)


def _pack_nibbles(nibbles: jax.Array) -> jax.Array:
  """Packs int32 nibbles two per byte along the last axis (a multiple of 8 long): element
  ``2i`` in the low nibble.

  Eight nibbles make one little-endian uint32, ``sum(n_k << 4k)``, read back as four bytes.
  XLA's CPU backend vectorizes this sum over a short axis well, better than a bitwise-or
  reduction, strided even/odd slices, or uint8 -> uint32 bitcasts (it fuses those into
  scalar loops).
  """
  shape = nibbles.shape[:-1]
  eights = (nibbles & 0xF).astype(jnp.uint32).reshape(*shape, -1, 8)
  words = jnp.sum(eights << _NIBBLE_SHIFTS, axis=-1, dtype=jnp.uint32)
  return lax.bitcast_convert_type(words, jnp.uint8).reshape(*shape, -1)


def _unpack_nibbles(packed: jax.Array) -> jax.Array:
  """int32 nibbles of packed bytes along the last axis (a multiple of 4 long), low nibble
  first: the inverse of ``_pack_nibbles``, each uint32 word shifted right by ``4k``."""
  shape = packed.shape[:-1]
  words = lax.bitcast_convert_type(packed.reshape(*shape, -1, 4), jnp.uint32)
  nibbles = (words[..., None] >> _NIBBLE_SHIFTS) & 0xF
  return nibbles.astype(jnp.int32).reshape(*shape, -1)


def quantize(x: jax.Array, precision: str) -> tuple[jax.Array, jax.Array]:
  """Blockwise absmax quantization of ``x``.

  Args:
    x: a float array of any shape.
    precision: ``"F8_E4M3"``, ``"F4"`` or ``"I4"``.

  Returns:
    ``(codes, scales)``: F8 codes as ``float8_e4m3fn`` of ``x``'s shape; F4/I4 codes packed
    two per byte as ``uint8`` of shape ``(ceil(n/2),)``; scales F32 of shape
    ``(ceil(n/32),)``. NaN/Inf make the block's scale non-finite (``encode`` refuses them).
  """
  if precision not in QUANTIZED:
    raise ValueError(f"quantize: precision={precision!r} is not one of {list(QUANTIZED)}.")
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
  # The scale's rounding can take a quotient just past qmax; the specification clips.
  # (float8_e4m3fn has no infinity and does not saturate: 465 would become NaN.)
  scaled = jnp.clip(scaled, -qmax, qmax)
  size = math.prod(x.shape)
  if precision == "F8_E4M3":
    codes = _f8_e4m3(scaled)
    return codes.reshape(-1)[:size].reshape(x.shape), scales
  if precision == "F4":
    nibbles = _f4_nibbles(scaled)
  else:
    nibbles = lax.bitcast_convert_type(scaled + _ROUND_TO_INTEGER, jnp.int32)
  # Blocks are 32 long, so the padded codes pair up.
  return _pack_nibbles(nibbles).reshape(-1)[: packed_size(size)], scales


def dequantize(
    codes: jax.Array, scales: jax.Array, shape: tuple[int, ...], precision: str
) -> jax.Array:
  """The F32 tensor of ``shape`` that ``quantize`` codes and scales stand for."""
  if precision not in QUANTIZED:
    raise ValueError(
        f"dequantize: precision={precision!r} is not one of {list(QUANTIZED)}."
    )
  shape = tuple(int(d) for d in shape)
  size = math.prod(shape)
  blocks = num_blocks(size)
  codes = jnp.asarray(codes)
  if precision == "F8_E4M3":
    values = _f8_e4m3_values(jnp.ravel(codes).astype(jnp.float8_e4m3fn))
    pad = blocks * BLOCK - size
    if pad:
      values = jnp.pad(values, (0, pad))
  else:
    packed = jnp.ravel(codes).astype(jnp.uint8)
    pad = blocks * BLOCK // 2 - packed.size
    if pad:
      packed = jnp.pad(packed, (0, pad))
    nibbles = _unpack_nibbles(packed.reshape(blocks, BLOCK // 2))
    if precision == "F4":
      values = _f4_values(nibbles)
    else:
      values = ((nibbles << 28) >> 28).astype(jnp.float32)  # sign-extend two's complement
  values = values.reshape(blocks, BLOCK) * jnp.asarray(scales, jnp.float32)[:, None]
  # Subnormal products count as zero, on every backend (see quantize).
  # (NaN stays NaN, for the checks downstream.)
  values = jnp.where(jnp.abs(values) < _SMALLEST_NORMAL, jnp.float32(0), values)
  if blocks * BLOCK == size:
    return values.reshape(shape)
  return values.reshape(-1)[:size].reshape(shape)


def layout(schema: Schema, precision: Precision) -> Schema:
  """What ``schema``'s tensors travel as at ``precision``.

  Each leaf in that dtype, or as it is with ``None``; a quantized leaf as its codes (F8:
  ``F8_E4M3`` of the logical shape; F4/I4: ``U8`` of shape ``(ceil(n/2),)``) and
  ``<name>.scale`` (``F32`` of shape ``(ceil(n/32),)``).
  """
  check_precision(precision)
  specs = []
  for spec in schema.parameters:
    if precision is None:
      specs.append(spec)
    elif precision in DTYPES:
      specs.append(ParameterSpec(spec.name, precision, spec.shape))
    else:
      if precision == "F8_E4M3":
        specs.append(ParameterSpec(spec.name, "F8_E4M3", spec.shape))
      else:
        specs.append(ParameterSpec(spec.name, "U8", (packed_size(spec.size),)))
      specs.append(ParameterSpec(scale_name(spec.name), "F32", (num_blocks(spec.size),)))
  return Schema(tuple(specs), payload=True)


def _encode_values(values, dtypes, precision):
  entries, finite = {}, {}
  for name, value in values.items():
    if precision in QUANTIZED:
      codes, scales = quantize(value, precision)
      entries[name], entries[scale_name(name)] = codes, scales
      finite[name] = jnp.all(jnp.isfinite(scales))
    else:
      code = precision if precision is not None else dtypes[name]
      value = jnp.asarray(value)
      entries[name] = value.astype(_JNP[code])
      # Judged on the cast's output, which is half the bytes of an F32 input for F16 and
      # BF16: the cast rounds a value too large for the dtype to an infinity, as bad as
      # one that already was.
      finite[name] = _all_finite(entries[name])
  return entries, finite


@functools.partial(jax.jit, static_argnames=("dtypes", "precision", "unchanged"))
def _encode_jit(values, dtypes, precision, unchanged=()):
  entries, finite = _encode_values(values, dict(dtypes), precision)
  # A value already in its payload dtype is its own entry: returning it from here would
  # only copy it.
  return {n: e for n, e in entries.items() if n not in unchanged}, finite


def encode_flat(
    values: Mapping[str, Any],
    schema: Schema | None,
    precision: Precision,
    *,
    check_finite: bool = True,
) -> dict[str, jax.Array]:
  """Payload entries for ``values`` by leaf name, at ``precision``.

  With ``precision=None`` each value is cast to its schema dtype (its own without a schema).

  Raises:
    ValueError: a value holds NaN or Inf (or overflows the target dtype); names the leaf.
  """
  check_precision(precision)
  values = {name: jnp.asarray(v) for name, v in values.items()}
  if schema is not None:
    dtypes = tuple(sorted((n, schema[n].dtype) for n in values))
  else:
    dtypes = tuple(sorted((n, dtype_code(v.dtype, what=f"leaf {n!r}")) for n, v in values.items()))
  unchanged = ()
  if precision not in QUANTIZED:
    unchanged = tuple(
        name for name, code in dtypes
        if values[name].dtype == _JNP[precision or code]
    )
  entries, finite = _encode_jit(values, dtypes, precision, unchanged)
  entries.update({name: values[name] for name in unchanged})
  if check_finite:
    finite = jax.device_get(finite)
    bad = sorted(name for name, ok in finite.items() if not ok)
    if bad:
      raise ValueError(
          f"cannot encode leaf {bad[0]!r}"
          + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
          + f" at precision {precision!r}: it holds NaN or Inf"
          + (" after the cast" if precision in ("F16", "BF16") else "")
          + "; a payload must be finite, so check the loss and learning rate."
      )
  return entries


def decode_values(entries, specs, precision):
  """Pure (traceable) decode of payload ``entries`` for ``specs`` to F32 values by name."""
  out = {}
  for spec in specs:
    if precision in QUANTIZED:
      out[spec.name] = dequantize(
          entries[spec.name], entries[scale_name(spec.name)], spec.shape, precision
      )
    else:
      out[spec.name] = jnp.asarray(entries[spec.name]).astype(jnp.float32).reshape(spec.shape)
  return out


@functools.partial(jax.jit, static_argnames=("specs", "precision"))
def _decode_jit(entries, specs, precision):
  return decode_values(entries, specs, precision)


def decode_flat(
    entries: Mapping[str, Any], schema: Schema, precision: Precision
) -> dict[str, jax.Array]:
  """F32 values by leaf name from the payload ``entries`` ``encode_flat`` produced."""
  check_precision(precision)
  wanted = layout(schema, precision).names
  missing = [n for n in wanted if n not in entries]
  if missing:
    raise KeyError(f"payload lacks entries {missing}")
  if precision in QUANTIZED:
    return _decode_jit({n: entries[n] for n in wanted}, schema.parameters, precision)
  # An F32 entry of the right shape already is its value; decoding would only copy it.
  unchanged = {
      spec.name: entries[spec.name] for spec in schema.parameters
      if isinstance(entries[spec.name], jax.Array)
      and entries[spec.name].dtype == jnp.float32
      and tuple(entries[spec.name].shape) == spec.shape
  }
  rest = tuple(spec for spec in schema.parameters if spec.name not in unchanged)
  values = _decode_jit({s.name: entries[s.name] for s in rest}, rest, precision) if rest else {}
  return {spec.name: (unchanged.get(spec.name) if spec.name in unchanged else values[spec.name])
          for spec in schema.parameters}


def encode(tree: Any, precision: Precision) -> dict[str, jax.Array]:
  """Encodes a parameter pytree to payload entries by name (see ``layout``).

  Args:
    tree: a pytree of F32/F16/BF16 arrays.
    precision: None (each leaf in its own dtype), a parameter dtype, or a quantized format.

  Returns:
    The payload entries, keyed by leaf name (and ``<name>.scale`` when quantized).

  Raises:
    ValueError: an unknown precision, or a leaf holding NaN/Inf (named in the message).
  """
  check_precision(precision)
  schema = Schema.from_tree(tree)
  return encode_flat(schema.flatten(tree), schema, precision)


def decode(entries: Mapping[str, Any], schema: Schema, precision: Precision) -> Any:
  """Decodes payload entries to F32: a tree shaped like ``schema``'s source, or a dict."""
  values = decode_flat(entries, schema, precision)
  if schema.treedef is None:
    return values
  return schema.unflatten(values)


def to_numpy(entries: Mapping[str, Any], payload_schema: Schema) -> dict[str, np.ndarray]:
  """Host copies of payload entries, each in the numpy dtype its layout spec names."""
  host = jax.device_get(dict(entries))
  return {
      spec.name: np.asarray(host[spec.name]).astype(NUMPY_DTYPES[spec.dtype], copy=False)
      for spec in payload_schema.parameters
  }
