"""Payload files in the safetensors format: an 8-byte little-endian header length, a JSON
header naming each entry's dtype, shape and byte range (plus ``__metadata__`` strings),
then the data.

Written by hand rather than through the ``safetensors`` package: its numpy API has no
bfloat16 or float8, and its raw API takes memory addresses; the format itself is a few
lines, and a reader of untrusted bytes must check every field anyway (this one does, and
raises ``PayloadError`` for anything malformed).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from gmjax.core.schema import NUMPY_DTYPES

MAX_HEADER_BYTES = 100 * 1024 * 1024
_CODE_OF = {dtype: code for code, dtype in NUMPY_DTYPES.items()}


class PayloadError(ValueError):
  """A payload that is not a well-formed safetensors file of known dtypes."""


def dumps(entries: Mapping[str, Any], metadata: Mapping[str, Any] | None = None) -> bytes:
  """Serializes ``entries`` (name -> array of a known dtype) and string ``metadata``."""
  header: dict[str, Any] = {}
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  chunks, offset = [], 0
  for name in sorted(entries):
    array = np.asarray(entries[name], order="C")  # ascontiguousarray would make scalars 1-d
    code = _CODE_OF.get(array.dtype)
    if code is None:
      raise ValueError(f"payload entry {name!r} has unsupported dtype {array.dtype}")
    data = array.tobytes()
    header[name] = {
        "dtype": code,
        "shape": list(array.shape),
        "data_offsets": [offset, offset + len(data)],
    }
    chunks.append(data)
    offset += len(data)
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as safetensors does
  return b"".join([struct.pack("<Q", len(text)), text, *chunks])


def loads(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """Parses a payload, checking every field.

  Returns:
    ``(entries, metadata)``: arrays by name (read-only views of ``data``) and the
    ``__metadata__`` strings.

  Raises:
    PayloadError: truncated data, a bad header, unknown dtypes, shapes that disagree with
      byte ranges, or ranges that overlap, leave gaps or run past the end.
  """
  if not isinstance(data, (bytes, bytearray, memoryview)):
    raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
  data = bytes(data)
  if len(data) < 8:
    raise PayloadError(f"payload of {len(data)} bytes is too short for a header length")
  (length,) = struct.unpack("<Q", data[:8])
  if length > MAX_HEADER_BYTES or 8 + length > len(data):
    raise PayloadError(f"header length {length} exceeds the payload ({len(data)} bytes)")
  try:
    header = json.loads(data[8 : 8 + length].decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as error:
    raise PayloadError(f"header is not JSON: {error}") from None
  if not isinstance(header, dict):
    raise PayloadError("header is not a JSON object")
  metadata = header.pop("__metadata__", {}) or {}
  if not isinstance(metadata, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
  ):
    raise PayloadError("__metadata__ must map strings to strings")
  body = memoryview(data)[8 + length :]
  entries, ranges = {}, []
  for name, info in header.items():
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
      raise PayloadError(f"entry {name!r} is not {{dtype, shape, data_offsets}}")
    dtype = NUMPY_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
      raise PayloadError(f"entry {name!r} has unknown dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
      raise PayloadError(f"entry {name!r} has a bad shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= len(body)
    ):
      raise PayloadError(f"entry {name!r} has bad data_offsets {offsets!r}")
    size = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != size:
      raise PayloadError(
          f"entry {name!r}: shape {shape} of {info['dtype']} needs {size} bytes, its range"
          f" holds {offsets[1] - offsets[0]}"
      )
    entries[name] = np.frombuffer(
        body[offsets[0] : offsets[1]], dtype=dtype
    ).reshape(tuple(shape))  # a tuple: reshape([]) would give (1,), not a scalar
    ranges.append(tuple(offsets))
  position = 0
  for start, end in sorted(ranges):
    if start != position:
      raise PayloadError("entry byte ranges overlap or leave gaps")
    position = end
  if position != len(body):
    raise PayloadError(f"payload has {len(body) - position} bytes past its last entry")
  return entries, dict(metadata)
