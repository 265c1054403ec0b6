"""Payload files: safetensors bytes, their round trip, and rejection of malformed input."""

import json
import os
import struct
import tempfile

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import gmjax
from gmjax.core import codec, payload


def sample_entries():
  tree = {"w": jnp.linspace(-1.0, 1.0, 70).reshape(7, 10), "b": jnp.ones(3)}
  return gmjax.encode(tree, "F4"), gmjax.Schema.from_tree(tree)


def test_roundtrip_all_dtypes():
  entries = {
      "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
      "f16": np.arange(4, dtype=np.float16),
      "bf16": np.arange(5).astype(ml_dtypes.bfloat16),
      "f8": np.linspace(-3, 3, 9).astype(ml_dtypes.float8_e4m3fn).reshape(3, 3),
      "u8": np.arange(7, dtype=np.uint8),
      "scalar": np.float32(2.5),
      "empty": np.zeros((0, 4), np.float32),
  }
  metadata = {"learner": "a", "round": 3, "final": False}
  data = payload.dumps(entries, metadata)
  back, meta = payload.loads(data)
  assert meta == {"learner": "a", "round": "3", "final": "False"}
  assert sorted(back) == sorted(entries)
  for name, value in entries.items():
    value = np.asarray(value)
    assert back[name].dtype == value.dtype and back[name].shape == value.shape
    assert back[name].tobytes() == value.tobytes()


def test_header_layout():
  data = payload.dumps({"a": np.ones(3, np.float32), "b": np.zeros(2, np.uint8)}, {"k": "v"})
  (length,) = struct.unpack("<Q", data[:8])
  assert (8 + length) % 8 == 0
  header = json.loads(data[8 : 8 + length])
  assert header["__metadata__"] == {"k": "v"}
  assert header["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
  assert header["b"] == {"dtype": "U8", "shape": [2], "data_offsets": [12, 14]}
  assert len(data) == 8 + length + 14


def test_safetensors_reads_a_payload():
  entries, schema = sample_entries()
  host = codec.to_numpy(entries, gmjax.layout(schema, "F4"))
  data = payload.dumps(host, {"precision": "F4", "block": 32})
  with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "p.safetensors")
    with open(path, "wb") as f:
      f.write(data)
    with safetensors.safe_open(path, framework="numpy") as f:
      assert sorted(f.keys()) == sorted(host)
      assert f.metadata() == {"precision": "F4", "block": "32"}
      for name in f.keys():
        np.testing.assert_array_equal(f.get_tensor(name), host[name])
  assert host["w"].dtype == np.uint8 and host["w"].shape == (35,)
  assert host["w.scale"].dtype == np.float32 and host["w.scale"].shape == (3,)
  safetensors_bytes = safetensors.numpy.save({"x": np.arange(4, dtype=np.float32)}, {"m": "1"})
  back, meta = payload.loads(safetensors_bytes)
  np.testing.assert_array_equal(back["x"], np.arange(4, dtype=np.float32))
  assert meta == {"m": "1"}


def test_decode_from_loaded_payload():
  entries, schema = sample_entries()
  host = codec.to_numpy(entries, gmjax.layout(schema, "F4"))
  back, _ = payload.loads(payload.dumps(host))
  np.testing.assert_array_equal(
      np.asarray(gmjax.decode(back, schema, "F4")["w"]),
      np.asarray(gmjax.decode(entries, schema, "F4")["w"]),
  )


def with_header(header, body=b""):
  text = json.dumps(header).encode()
  return struct.pack("<Q", len(text)) + text + body


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x01\x02",
        struct.pack("<Q", 100) + b"{}",  # header runs past the end
        struct.pack("<Q", 4) + b"{nope",  # not JSON
        struct.pack("<Q", 2) + b"\xff\xfe",  # not UTF-8
        with_header([1, 2]),  # not an object
        with_header(GOOD, b"\x00" * 4),  # truncated data
        with_header(GOOD, b"\x00" * 12),  # bytes past the last entry
        with_header({"a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
        with_header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        with_header({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
        with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8),
        with_header({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
        with_header(
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"\0" * 12,
        ),  # overlapping ranges
        with_header(
            {"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 4
        ),  # a gap
        with_header({"__metadata__": {"k": 1}}),
        # Shapes numpy cannot hold, of 1 or 0 bytes.
        with_header({"a": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [0, 1]}},
                    b"\0"),
        with_header({"a": {"dtype": "U8", "shape": [1] * 33, "data_offsets": [0, 1]}},
                    b"\0"),
        with_header({"a": {"dtype": "U8", "shape": [0, 2**70], "data_offsets": [0, 0]}}),
        with_header({"a": {"dtype": "U8", "shape": [2**62, 0], "data_offsets": [0, 0]}}),
        with_header({"a": {"dtype": "F32", "shape": [0, 2**48, 2**48],
                           "data_offsets": [0, 0]}}),
    ],
)
def test_malformed_payloads_rejected(data):
  with pytest.raises(payload.PayloadError):
    payload.loads(data)
  assert issubclass(payload.PayloadError, ValueError)


def test_unsupported_dtype_not_written():
  with pytest.raises(ValueError, match="'x'"):
    payload.dumps({"x": np.zeros(2, np.float64)})


def test_deeply_nested_header_is_a_rejection_not_a_crash():
  deep = b"[" * 200_000 + b"]" * 200_000
  data = struct.pack("<Q", len(deep)) + deep
  with pytest.raises(payload.PayloadError, match="nest"):
    payload.loads(data)
  inside = {"__metadata__": {"learner": "a"}, "a": {"dtype": "F32", "shape": [[[[[[2]]]]]],
                                                    "data_offsets": [0, 8]}}
  with pytest.raises(payload.PayloadError, match="nest"):
    payload.loads(with_header(inside, b"\0" * 8))


@pytest.mark.parametrize("text", [
    b'{"a": 1e999999}', b'{"a": ' + b"9" * 5000 + b"}", b'"just a string"', b"null",
    b"\xc3\x28{}", b'{"a": "\\ud800"}',
])
def test_any_parse_failure_is_a_rejection(text):
  with pytest.raises(payload.PayloadError):
    payload.loads(struct.pack("<Q", len(text)) + text)


def test_a_string_left_open_is_rejected_in_linear_time():
  # Escaped quotes and no closing one: a string pattern that fails at the end is
  # retried from every later quote (a 1 MB header would scan for hours).
  text = b'"' + b'\\"' * 500_000
  assert payload._STRING.sub(b'""', text) == b'""'  # one token, to the end
  with pytest.raises(payload.PayloadError, match="not JSON"):
    payload.loads(struct.pack("<Q", len(text)) + text)
  braces = b'{"a": "' + b"[" * 10 + b"\\"  # an open string hides its brackets
  assert payload._depth(braces) == 1


@pytest.mark.parametrize("entries", [
    # A first definition no check would read, under the second's signature.
    b'{"a": {"dtype": "F64", "shape": [-1], "data_offsets": [0, 9]},'
    b' "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
    b'{"a": {"dtype": "F32", "dtype": "U8", "shape": [2], "data_offsets": [0, 8]}}',
    b'{"__metadata__": {"learner": "x", "learner": "y"},'
    b' "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
])
def test_a_repeated_name_is_rejected(entries):
  entries += b" " * (-len(entries) % 8)
  with pytest.raises(payload.PayloadError, match="twice"):
    payload.loads(struct.pack("<Q", len(entries)) + entries + b"\0" * 8)
  if b"__metadata__" not in entries:
    with pytest.raises(Exception):  # safetensors refuses a repeated entry or field too
      safetensors.numpy.load(struct.pack("<Q", len(entries)) + entries + b"\0" * 8)


@pytest.mark.parametrize("metadata", [False, 0, "", []])
def test_metadata_must_be_an_object_or_null(metadata):
  header = {"__metadata__": metadata, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
  with pytest.raises(payload.PayloadError, match="__metadata__"):
    payload.loads(with_header(header, b"\0" * 8))
  entries, found = payload.loads(with_header(dict(header, __metadata__=None), b"\0" * 8))
  assert found == {} and list(entries) == ["a"]


def test_header_size_is_bounded_by_the_reader():
  data = payload.dumps({"a": np.ones(2, np.float32)}, {"learner": "x" * 5000})
  assert payload.loads(data)[1]["learner"] == "x" * 5000
  with pytest.raises(payload.PayloadError, match="max_header_bytes=1024"):
    payload.loads(data, max_header_bytes=1024)


def test_errors_quote_a_short_escaped_prefix_of_hostile_text():
  name = "\u00e9\n" * 100_000
  data = with_header({name: {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8)
  with pytest.raises(payload.PayloadError) as caught:
    payload.loads(data)
  message = str(caught.value)
  assert len(message) < 300 and message.isascii() and "\n" not in message


def test_bound_of_a_layout_covers_every_honest_payload():
  entries, schema = sample_entries()
  layout = gmjax.layout(schema, "F4")
  host = codec.to_numpy(entries, layout)
  metadata = {"learner": "w" * 64, "round": 2**62, "signature": "f" * 64, "tokens": 2**62}
  data = payload.dumps(host, metadata)
  header_bound, total_bound = payload.bounds(layout)
  assert len(data) <= total_bound and total_bound - header_bound - 8 == sum(
      s.nbytes for s in layout.parameters)
  payload.loads(data, max_header_bytes=header_bound)
