"""``Wire``: how a fragment's tensors travel, and its payload layout, encode and decode.

A tensor travels at a *precision*: cast to F32/F16/BF16 (round to nearest even), or
blockwise quantized to F8_E4M3, F4, I4 or I2 codes with one F32 scale per 32 values,
stored as ``<name>`` and ``<name>.scale``. With ``topk`` only the ``k`` largest
magnitudes of each chunk of ``chunk`` values of a flattened leaf travel, as one vector at
that precision, with their indices within the chunk in ``<name>.index``
(``gmjax.core.sparse``). Deltas travel on ``DiLoCo.delta_wire``, commits on
``DiLoCo.commit_wire``; the mail runtime and both in-mesh exchanges use the same object.

``encode_values``/``decode_values`` are pure and traceable (inside a jitted step);
``encode``/``decode`` are the host API, one compiled program per layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gmjax.core import sparse
from gmjax.core.kernels import CODE_BITS, all_finite, dequantize, num_blocks, packed_size
from gmjax.core.kernels import BLOCK, quantize
from gmjax.core.records import DTYPES, PRECISIONS, QUANTIZED, Precision
from gmjax.core.schema import NUMPY_DTYPES, ParameterSpec, Schema, dtype_code, scale_name

# The JAX dtype of each parameter dtype code.
JNP_DTYPES = {"F32": jnp.float32, "F16": jnp.float16, "BF16": jnp.bfloat16}
# The largest F32 value: a number the outer step takes (in F32) must not pass it.
F32_MAX = float(np.finfo(np.float32).max)


def check_precision(precision: Any, argument: str = "precision") -> Precision:
  """Returns ``precision`` if gmjax knows it, else raises a ValueError naming it."""
  if precision not in PRECISIONS:
    raise ValueError(
        f"{argument}={precision!r} is not a known precision; use one of"
        f" {list(PRECISIONS)}."
    )
  return precision


@dataclasses.dataclass(frozen=True)
class Wire:
  """How tensors travel: ``precision``, and dense or top-``k`` of each ``chunk``.

  Hashable and static under ``jax.jit``.

  Attributes:
    precision: None (each leaf in its own dtype), F32/F16/BF16, or a quantized format.
    topk: None (dense), or the values each chunk keeps.
    chunk: the chunk length of ``topk``.
  """

  precision: Precision = None
  topk: int | None = None
  chunk: int = 4096

  def __post_init__(self):
    check_precision(self.precision)
    for field in ("topk", "chunk"):  # numpy integers, as gmjax.DiLoCo takes them
      if isinstance(getattr(self, field), np.integer):
        object.__setattr__(self, field, int(getattr(self, field)))
    topk, chunk = self.topk, self.chunk
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
      raise ValueError(
          f"Wire(topk={topk!r}): topk must be None (dense) or a positive int, the values"
          " each chunk keeps.")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 2**32:
      raise ValueError(
          f"Wire(chunk={chunk!r}): chunk must be a positive int (at most 2**32), the"
          " length of the chunks topk keeps values of (4096 by default).")

  @property
  def sparse(self) -> bool:
    return self.topk is not None

  @property
  def whole_run(self) -> int:
    """The values of a flat leaf that a device's piece must hold a multiple of for the
    encoding of the piece to be the piece of the encoding: with ``topk``, whole chunks
    whose kept values fill whole blocks of 32 (``sparse.whole_run``); dense, a block."""
    if self.topk is not None:
      return sparse.whole_run(self.topk, self.chunk)
    return BLOCK

  def code(self, dtype: str) -> str:
    """The dtype code a dense leaf of ``dtype`` travels as (its codes when quantized)."""
    return dtype if self.precision is None else self.precision

  def _kept(self, specs: Sequence[ParameterSpec]) -> tuple[ParameterSpec, ...]:
    if self.topk is None:
      return tuple(specs)
    return tuple(ParameterSpec(s.name, s.dtype, (sparse.kept_size(s.size, self.topk,
                                                                   self.chunk),))
                 for s in specs)

  def layout(self, schema: Schema, where: str = "Wire.layout") -> Schema:
    """What ``schema``'s tensors travel as (``where``: the caller, for a bad ``schema``).

    Each (kept) leaf in the precision's dtype, or as it is with ``None``; a quantized one
    as its codes (F8: ``F8_E4M3`` of the logical shape; F4/I4: ``U8`` of shape
    ``(ceil(n/2),)``; I2: ``U8`` of shape ``(ceil(n/4),)``) and ``<name>.scale`` (``F32``
    of shape ``(ceil(n/32),)``); with ``topk`` the kept values ``(K,)`` and
    ``<name>.index`` beside them.
    """
    specs = []
    for spec in self._kept(Schema.given(schema, where).parameters):
      if self.precision is None:
        specs.append(spec)
      elif self.precision in DTYPES:
        specs.append(ParameterSpec(spec.name, self.precision, spec.shape))
      else:
        if self.precision == "F8_E4M3":
          specs.append(ParameterSpec(spec.name, "F8_E4M3", spec.shape))
        else:
          size = packed_size(spec.size, CODE_BITS[self.precision])
          specs.append(ParameterSpec(spec.name, "U8", (size,)))
        specs.append(ParameterSpec(scale_name(spec.name), "F32", (num_blocks(spec.size),)))
    if self.topk is not None:
      code = sparse.index_dtype(self.chunk)
      specs += [ParameterSpec(sparse.index_name(s.name), code, s.shape)
                for s in self._kept(schema.parameters)]
    return Schema(tuple(specs), payload=True)

  def encode_values(self, values: Mapping[str, Any], dtypes: Mapping[str, str]
                    ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Pure (traceable) encode of values by name to payload entries.

    Args:
      values: arrays by leaf name.
      dtypes: each leaf's schema dtype code, the target with ``precision=None``.

    Returns:
      ``(entries, finite)``: the payload entries by name (``layout``), and per leaf a
      boolean scalar, whether it encoded to finite values.
    """
    indices = {}
    if self.topk is not None:
      kept = {}
      for name, value in values.items():
        kept[name], indices[name] = sparse.select(jnp.asarray(value), self.topk, self.chunk)
      values = kept
    entries, finite = {}, {}
    for name, value in values.items():
      if self.precision in QUANTIZED:
        codes, scales = quantize(value, self.precision)
        entries[name], entries[scale_name(name)] = codes, scales
        finite[name] = jnp.all(jnp.isfinite(scales))
      else:
        value = jnp.asarray(value)
        entries[name] = value.astype(JNP_DTYPES[self.code(dtypes[name])])
        # Judged on the cast's output, which is half the bytes of an F32 input for F16
        # and BF16: the cast rounds a value too large for the dtype to an infinity, as
        # bad as one that already was.
        finite[name] = all_finite(entries[name])
    if indices:
      code = sparse.JNP_INDEX[sparse.index_dtype(self.chunk)]
      for name, index in indices.items():
        entries[sparse.index_name(name)] = index.astype(code)
    return entries, finite

  def decode_values(self, entries: Mapping[str, Any], specs: Sequence[ParameterSpec]
                    ) -> dict[str, jax.Array]:
    """Pure (traceable) decode of payload ``entries`` for ``specs`` to F32 values by name."""
    out = {}
    for spec, kept in zip(specs, self._kept(specs)):
      if self.precision in QUANTIZED:
        value = dequantize(entries[spec.name], entries[scale_name(spec.name)], kept.shape,
                           self.precision)
      else:
        value = jnp.asarray(entries[spec.name]).astype(jnp.float32).reshape(kept.shape)
      if self.topk is not None:
        value = sparse.scatter(value, entries[sparse.index_name(spec.name)], spec.size,
                               self.topk, self.chunk).reshape(spec.shape)
      out[spec.name] = value
    return out

  def encode(self, values: Mapping[str, Any], schema: Schema | None, *,
             check_finite: bool = True) -> dict[str, jax.Array]:
    """Payload entries for ``values`` by leaf name (host API).

    With ``precision=None`` each value is cast to its schema dtype (its own without a
    schema).

    Raises:
      ValueError: a (kept) value holds NaN or Inf, or overflows the target dtype; names
        the leaf.
    """
    values = {name: jnp.asarray(v) for name, v in values.items()}
    if schema is not None:
      _check_values(values, schema)
      dtypes = tuple(sorted((n, schema[n].dtype) for n in values))
    else:
      dtypes = tuple(sorted((n, dtype_code(v.dtype, what=f"leaf {n!r}"))
                            for n, v in values.items()))
    unchanged = ()
    if self.precision not in QUANTIZED and self.topk is None:
      unchanged = tuple(name for name, code in dtypes
                        if values[name].dtype == JNP_DTYPES[self.code(code)])
    entries, finite = _encode_jit(self, values, dtypes, unchanged)
    entries.update({name: values[name] for name in unchanged})
    if check_finite:
      bad = sorted(name for name, ok in jax.device_get(finite).items() if not ok)
      if bad:
        raise ValueError(
            f"cannot encode leaf {bad[0]!r}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + f" at precision {self.precision!r}"
            + (f" with delta_topk={self.topk}: a kept value is NaN or Inf"
               if self.topk is not None else ": it holds NaN or Inf"
               + (" after the cast" if self.precision in ("F16", "BF16") else ""))
            + "; a payload must be finite, so check the loss and learning rate.")
    return entries

  def decode(self, entries: Mapping[str, Any], schema: Schema) -> dict[str, jax.Array]:
    """F32 values by leaf name from the payload ``entries`` ``encode`` produced.

    Raises:
      KeyError: an entry of the layout is missing.
      ValueError: an entry's shape or dtype is not the layout's, or (``topk``) an index
        entry is out of its chunk's range or does not rise (``sparse.index_problem``).
    """
    layout = self.layout(schema, "Wire.decode")
    wanted = layout.names
    missing = [n for n in wanted if n not in entries]
    if missing:
      raise KeyError(f"payload lacks entries {missing}")
    self._check_entries(entries, layout, schema)
    if self.precision in QUANTIZED or self.topk is not None:
      return _decode_jit(self, {n: entries[n] for n in wanted}, schema.parameters)
    # An F32 entry of the right shape already is its value; decoding would only copy it.
    unchanged = {
        spec.name: entries[spec.name] for spec in schema.parameters
        if isinstance(entries[spec.name], jax.Array)
        and entries[spec.name].dtype == jnp.float32
        and tuple(entries[spec.name].shape) == spec.shape
    }
    rest = tuple(spec for spec in schema.parameters if spec.name not in unchanged)
    values = _decode_jit(self, {s.name: entries[s.name] for s in rest}, rest) if rest else {}
    return {spec.name: unchanged[spec.name] if spec.name in unchanged else values[spec.name]
            for spec in schema.parameters}

  def _check_entries(self, entries: Mapping[str, Any], layout: Schema,
                     schema: Schema) -> None:
    """Raises a ValueError for an entry unlike ``layout``'s spec, or a bad index entry:
    decoded as they are, short codes would decode as zeros, a short scale entry would be
    broadcast, and codes of another dtype converted instead of read."""
    for spec in layout.parameters:
      value = entries[spec.name]
      dtype = np.dtype(value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype)
      want = np.dtype(NUMPY_DTYPES[spec.dtype])
      if tuple(np.shape(value)) != spec.shape or dtype != want:
        raise ValueError(
            f"decode: entry {spec.name!r} has shape {tuple(np.shape(value))} and dtype"
            f" {dtype.name}; precision={self.precision!r} lays it out as {spec.shape} of"
            f" {want.name} (see gmjax.layout(schema, precision)): pass the entries encode"
            " made for this schema and precision.")
    if self.topk is None:
      return
    for spec in schema.parameters:
      name = sparse.index_name(spec.name)
      problem = sparse.index_problem(np.asarray(entries[name]), spec.size, self.topk,
                                     self.chunk)
      if problem is not None:
        raise ValueError(f"decode: entry {name!r}: {problem} (topk={self.topk},"
                         f" chunk={self.chunk}).")

  def zeros(self, schema: Schema) -> dict[str, np.ndarray]:
    """Host entries of all-zero tensors (with ``topk``, the first indices of each chunk)."""
    entries = {s.name: np.zeros(s.shape, NUMPY_DTYPES[s.dtype])
               for s in self.layout(schema, "Wire.zeros").parameters}
    if self.topk is not None:
      for spec in schema.parameters:
        counts = sparse.chunk_counts(spec.size, self.topk, self.chunk)
        index = np.concatenate([np.arange(c) for c in counts]) if counts else np.zeros(0)
        entries[sparse.index_name(spec.name)] = index.astype(
            NUMPY_DTYPES[sparse.index_dtype(self.chunk)])
    return entries


@functools.partial(jax.jit, static_argnames=("wire", "dtypes", "unchanged"))
def _encode_jit(wire, values, dtypes, unchanged=()):
  entries, finite = wire.encode_values(values, dict(dtypes))
  # A value already in its payload dtype is its own entry: returning it from here would
  # only copy it.
  return {n: e for n, e in entries.items() if n not in unchanged}, finite


@functools.partial(jax.jit, static_argnames=("wire", "specs"))
def _decode_jit(wire, entries, specs):
  return wire.decode_values(entries, specs)


def _check_values(values: Mapping[str, jax.Array], schema: Schema) -> None:
  """Raises a ValueError unless ``values`` are the schema's leaves, by name, each of its
  spec's shape and a float: a short leaf was encoded with a short index, a missing one
  gave no entry, an integer one was cast, and only ``decode`` refused them later."""
  names = [p.name for p in schema.parameters]
  if sorted(values) != names:
    missing, extra = sorted(set(names) - set(values)), sorted(set(values) - set(names))
    raise ValueError(f"Wire.encode: values must hold the schema's leaves by name: missing"
                     f" {missing}, not in the schema {extra}.")
  for spec in schema.parameters:
    value = values[spec.name]
    if value.shape != spec.shape or not jnp.issubdtype(value.dtype, jnp.floating):
      raise ValueError(
          f"Wire.encode: leaf {spec.name!r} is {value.dtype}{list(value.shape)}, where the"
          f" schema has a float of shape {spec.shape}; pass the leaf's values in its shape.")
