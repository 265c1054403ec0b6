"""The wire codec: casts, blockwise quantization and 4-bit packing, as pure JAX functions.

Quantized formats cut a tensor, flattened row-major, into blocks of 32 elements (the last
one zero-padded). Per block ``scale = absmax / Qmax`` in F32 (``Qmax`` = 448 for F8_E4M3,
6 for F4, 7 for I4); codes are ``x / scale`` rounded to nearest even into
``float8_e4m3fn`` / ``float4_e2m1fn``, or ``clip(round(x / scale), -7, 7)`` for I4. A zero
block has scale 0 and zero codes. Decoding is ``code · scale`` in F32. 4-bit codes travel
two per byte, element ``2i`` in the low nibble.
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


def _blocks(x: jax.Array) -> jax.Array:
  flat = jnp.ravel(x).astype(jnp.float32)
  pad = num_blocks(flat.size) * BLOCK - flat.size
  if pad:
    flat = jnp.pad(flat, (0, pad))
  return flat.reshape(-1, BLOCK)


def quantize(x: jax.Array, precision: str) -> tuple[jax.Array, jax.Array]:
  """Blockwise absmax quantization of ``x``.

  Args:
    x: a float array of any shape.
    precision: ``"F8_E4M3"``, ``"F4"`` or ``"I4"``.

  Returns:
    ``(codes, scales)``: F8 codes as ``float8_e4m3fn`` of ``x``'s shape; F4/I4 codes packed
    two per byte as ``uint8`` of shape ``(ceil(n/2),)``; scales F32 of shape
    ``(ceil(n/32),)``. NaN/Inf propagate to the block's scale (``encode`` refuses them).
  """
  if precision not in QUANTIZED:
    raise ValueError(f"quantize: precision={precision!r} is not one of {list(QUANTIZED)}.")
  blocks = _blocks(x)
  qmax = QMAX[precision]
  scales = jnp.max(jnp.abs(blocks), axis=1) / jnp.float32(qmax)
  nonzero = scales > 0
  scaled = jnp.where(
      nonzero[:, None], blocks / jnp.where(nonzero, scales, 1.0)[:, None], 0.0
  )
  size = math.prod(x.shape)
  if precision == "F8_E4M3":
    # float8_e4m3fn has no infinity and does not saturate: 465 would become NaN.
    codes = jnp.clip(scaled, -qmax, qmax).astype(jnp.float8_e4m3fn)
    return codes.reshape(-1)[:size].reshape(x.shape), scales
  if precision == "F4":
    codes = jnp.clip(scaled, -qmax, qmax).astype(jnp.float4_e2m1fn)
  else:
    codes = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int4)
  # Blocks are 32 long, so the padded codes pair up; element 2i lands in the low nibble.
  packed = lax.bitcast_convert_type(codes.reshape(-1, 2), jnp.uint8)
  return packed[: packed_size(size)], scales


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
    values = jnp.ravel(codes).astype(jnp.float32)
    pad = blocks * BLOCK - size
    if pad:
      values = jnp.pad(values, (0, pad))
  else:
    packed = jnp.ravel(codes).astype(jnp.uint8)
    pad = blocks * BLOCK // 2 - packed.size
    if pad:
      packed = jnp.pad(packed, (0, pad))
    kind = jnp.float4_e2m1fn if precision == "F4" else jnp.int4
    values = lax.bitcast_convert_type(packed, kind).reshape(-1).astype(jnp.float32)
  values = values.reshape(blocks, BLOCK) * jnp.asarray(scales, jnp.float32)[:, None]
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
      target = _JNP[precision if precision is not None else dtypes[name]]
      encoded = jnp.asarray(value).astype(target)
      entries[name] = encoded
      finite[name] = jnp.all(jnp.isfinite(encoded))
  return entries, finite


@functools.partial(jax.jit, static_argnames=("dtypes", "precision"))
def _encode_jit(values, dtypes, precision):
  return _encode_values(values, dict(dtypes), precision)


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
  entries, finite = _encode_jit(values, dtypes, precision)
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
  return _decode_jit({n: entries[n] for n in wanted}, schema.parameters, precision)


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
