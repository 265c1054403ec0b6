"""Payload files in the safetensors format: an 8-byte little-endian header length, a JSON
header naming each entry's dtype, shape and byte range (plus ``__metadata__`` strings),
then the data.

Written by hand rather than through the ``safetensors`` package: its numpy API has no
bfloat16 or float8, and its raw API takes memory addresses; the format itself is a few
lines, and a reader of untrusted bytes must check every field anyway (this one does, and
raises ``PayloadError`` for anything malformed).

The header is untrusted JSON: before it is parsed its length is checked against the
reader's bound (``bounds`` gives the one a layout implies) and its nesting depth against
``MAX_HEADER_DEPTH``; any failure to parse is a ``PayloadError``, never another exception,
and messages quote hostile text only as a short escaped prefix (``guards.quote``).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from gmjax.core.guards import quote
from gmjax.core.schema import NUMPY_DTYPES, Schema

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The longest header any reader accepts; readers of a known layout pass ``bounds``'."""
MAX_HEADER_DEPTH = 4
"""The format nests three deep (header, entry, shape); deeper is hostile (json.loads would
recurse into it until RecursionError)."""
MAX_RANK = 32
"""The most dimensions an entry may have (numpy's own limit is 32 or 64 by version)."""
MAX_DIMENSION = 2**48
"""The longest dimension an entry may have, and the most its non-zero dimensions may
hold together (numpy refuses sizes near 2^63, even of an empty array)."""
METADATA_BYTES = 4096
"""Room ``bounds`` leaves for ``__metadata__``: its honest fields take a few hundred."""
# A string token of JSON, escapes included (unrolled: no backtracking). A string left
# open runs to the end of the text: a pattern that failed there would be retried from
# every later quote, quadratic in the header's length.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_OPEN = np.frombuffer(b"[{", np.uint8)
_CLOSE = np.frombuffer(b"]}", np.uint8)
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


def bounds(payload_layout: Schema) -> tuple[int, int]:
  """The most header bytes, and total bytes, an honest payload of ``payload_layout`` has.

  A payload's data is exactly the layout's bytes; its header holds, per entry, the name
  (JSON-escaped: at most 12 bytes a character), the dtype, the shape and two offsets (at
  most 24 bytes a number), plus ``METADATA_BYTES`` of metadata. A reader checks a file's
  size against the total before it reads it, and passes the header bound to ``loads``.

  Args:
    payload_layout: the payload's entries (``gmjax.layout(schema, precision)``).

  Returns:
    ``(max_header_bytes, max_total_bytes)``.
  """
  header = METADATA_BYTES + sum(12 * len(spec.name) + 24 * (len(spec.shape) + 2) + 64
                                for spec in payload_layout.parameters)
  header += -header % 8
  return header, 8 + header + sum(spec.nbytes for spec in payload_layout.parameters)


class _Repeated(Exception):
  """A JSON object names a key twice (``json.loads`` would keep the last silently)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  """A JSON object, refusing a repeated key: safetensors readers refuse one too, and a
  first definition that no check reads must not ride along under a signature."""
  result: dict[str, Any] = {}
  for key, value in pairs:
    if key in result:
      raise _Repeated(key)
    result[key] = value
  return result


def _depth(text: bytes) -> int:
  """How deep JSON ``text`` nests, counted without parsing it (brackets in strings aside)."""
  codes = np.frombuffer(_STRING.sub(b'""', text), np.uint8)
  steps = np.isin(codes, _OPEN).astype(np.int64) - np.isin(codes, _CLOSE).astype(np.int64)
  return int(np.cumsum(steps).max(initial=0))


def loads(data: bytes, *, max_header_bytes: int = MAX_HEADER_BYTES
          ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """Parses a payload, checking every field.

  Args:
    data: the payload's bytes.
    max_header_bytes: the longest header to accept (``bounds`` for a known layout).

  Returns:
    ``(entries, metadata)``: arrays by name (read-only views of ``data``) and the
    ``__metadata__`` strings.

  Raises:
    PayloadError: truncated data, a header too long, too deep or not a JSON object,
      unknown dtypes, shapes that disagree with byte ranges, or ranges that overlap,
      leave gaps or run past the end.
  """
  if not isinstance(data, (bytes, bytearray, memoryview)):
    raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
  data = bytes(data)
  if len(data) < 8:
    raise PayloadError(f"payload of {len(data)} bytes is too short for a header length")
  (length,) = struct.unpack("<Q", data[:8])
  limit = min(int(max_header_bytes), MAX_HEADER_BYTES)
  if length > limit:
    raise PayloadError(f"header length {length} exceeds max_header_bytes={limit}")
  if 8 + length > len(data):
    raise PayloadError(f"header length {length} exceeds the payload ({len(data)} bytes)")
  text = data[8 : 8 + length]
  depth = _depth(text)
  if depth > MAX_HEADER_DEPTH:
    raise PayloadError(f"header nests {depth} deep, more than {MAX_HEADER_DEPTH}")
  try:
    header = json.loads(text.decode("utf-8"), object_pairs_hook=_object)
  except _Repeated as error:
    raise PayloadError(f"header names {quote(error.args[0])} twice") from None
  except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, a 5000-digit int
    raise PayloadError(f"header is not JSON: {quote(str(error))}") from None
  if not isinstance(header, dict):
    raise PayloadError("header is not a JSON object")
  metadata = header.pop("__metadata__", None)
  metadata = {} if metadata is None else metadata  # null: none, as safetensors reads it
  if not isinstance(metadata, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
  ):
    raise PayloadError("__metadata__ must map strings to strings")
  body = memoryview(data)[8 + length :]
  entries, ranges = {}, []
  for name, info in header.items():
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
      raise PayloadError(f"entry {quote(name)} is not {{dtype, shape, data_offsets}}")
    dtype = NUMPY_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
      raise PayloadError(f"entry {quote(name)} has unknown dtype {quote(info['dtype'])}")
    shape, offsets = info["shape"], info["data_offsets"]
    # Within what numpy can hold: more dimensions, or one past ``MAX_DIMENSION`` (with
    # another of 0, any size is 0 bytes), would make numpy raise its own ValueError.
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK
            and all(type(d) is int and 0 <= d <= MAX_DIMENSION for d in shape)
            and math.prod(d for d in shape if d) <= MAX_DIMENSION):
      raise PayloadError(f"entry {quote(name)} has a bad shape {quote(shape)}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= len(body)
    ):
      raise PayloadError(f"entry {quote(name)} has bad data_offsets {quote(offsets)}")
    size = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != size:
      raise PayloadError(
          f"entry {quote(name)}: shape {quote(shape)} of {info['dtype']} needs"
          f" {quote(size)} bytes, its range holds {offsets[1] - offsets[0]}"
      )
    try:
      entries[name] = np.frombuffer(
          body[offsets[0] : offsets[1]], dtype=dtype
      ).reshape(tuple(shape))  # a tuple: reshape([]) would give (1,), not a scalar
    except (ValueError, OverflowError, MemoryError) as error:  # what numpy refuses to hold
      raise PayloadError(f"entry {quote(name)}: shape {quote(shape)}: {quote(str(error))}"
                         ) from None
    ranges.append(tuple(offsets))
  position = 0
  for start, end in sorted(ranges):
    if start != position:
      raise PayloadError("entry byte ranges overlap or leave gaps")
    position = end
  if position != len(body):
    raise PayloadError(f"payload has {len(body) - position} bytes past its last entry")
  return entries, dict(metadata)
