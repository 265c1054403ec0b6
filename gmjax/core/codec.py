"""The wire codec's pytree API: layouts, and payload entries by leaf name.

A tensor travels at a *precision*: cast to F32/F16/BF16 (round to nearest even), or
blockwise quantized to F8_E4M3, F4, I4 or I2 codes with one F32 scale per 32 values, stored
as ``<name>`` and ``<name>.scale`` (``layout``). The bit-level kernels are in
``gmjax.core.kernels``; ``quantize``, ``dequantize`` and the block constants are
re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gmjax.core.kernels import BLOCK as BLOCK
from gmjax.core.kernels import CODE_BITS as CODE_BITS
from gmjax.core.kernels import QMAX as QMAX
from gmjax.core.kernels import all_finite
from gmjax.core.kernels import dequantize as dequantize
from gmjax.core.kernels import num_blocks as num_blocks
from gmjax.core.kernels import packed_size as packed_size
from gmjax.core.kernels import quantize as quantize
from gmjax.core.records import DTYPES, PRECISIONS, QUANTIZED, Precision
from gmjax.core.schema import NUMPY_DTYPES, ParameterSpec, Schema, dtype_code, scale_name

# The JAX dtype of each parameter dtype code.
JNP_DTYPES = {"F32": jnp.float32, "F16": jnp.float16, "BF16": jnp.bfloat16}


def check_precision(precision: Any, argument: str = "precision") -> Precision:
  """Returns ``precision`` if gmjax knows it, else raises a ValueError naming it."""
  if precision not in PRECISIONS:
    raise ValueError(
        f"{argument}={precision!r} is not a known precision; use one of"
        f" {list(PRECISIONS)}."
    )
  return precision



def layout(schema: Schema, precision: Precision) -> Schema:
  """What ``schema``'s tensors travel as at ``precision``.

  Each leaf in that dtype, or as it is with ``None``; a quantized leaf as its codes (F8:
  ``F8_E4M3`` of the logical shape; F4/I4: ``U8`` of shape ``(ceil(n/2),)``; I2: ``U8`` of
  shape ``(ceil(n/4),)``) and ``<name>.scale`` (``F32`` of shape ``(ceil(n/32),)``).
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
        size = packed_size(spec.size, CODE_BITS[precision])
        specs.append(ParameterSpec(spec.name, "U8", (size,)))
      specs.append(ParameterSpec(scale_name(spec.name), "F32", (num_blocks(spec.size),)))
  return Schema(tuple(specs), payload=True)


def encode_values(
    values: Mapping[str, Any], dtypes: Mapping[str, str], precision: Precision
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """Pure (traceable) encode of F32 values by name to payload entries at ``precision``.

  Args:
    values: arrays by leaf name.
    dtypes: each leaf's schema dtype code, the target with ``precision=None``.
    precision: a known precision (see ``check_precision``).

  Returns:
    ``(entries, finite)``: the payload entries by name (``<name>.scale`` beside quantized
    codes), and per leaf a boolean scalar, whether it encoded to finite values.
  """
  entries, finite = {}, {}
  for name, value in values.items():
    if precision in QUANTIZED:
      codes, scales = quantize(value, precision)
      entries[name], entries[scale_name(name)] = codes, scales
      finite[name] = jnp.all(jnp.isfinite(scales))
    else:
      code = precision if precision is not None else dtypes[name]
      value = jnp.asarray(value)
      entries[name] = value.astype(JNP_DTYPES[code])
      # Judged on the cast's output, which is half the bytes of an F32 input for F16 and
      # BF16: the cast rounds a value too large for the dtype to an infinity, as bad as
      # one that already was.
      finite[name] = all_finite(entries[name])
  return entries, finite


@functools.partial(jax.jit, static_argnames=("dtypes", "precision", "unchanged"))
def _encode_jit(values, dtypes, precision, unchanged=()):
  entries, finite = encode_values(values, dict(dtypes), precision)
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
        if values[name].dtype == JNP_DTYPES[precision or code]
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
