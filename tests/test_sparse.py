"""Sparse top-k deltas against a numpy + ml_dtypes reference written from the definition:
per chunk of ``chunk`` values of the flattened leaf, the ``min(k, length)`` largest
magnitudes (subnormals as zero, ties to the lower index), indices ascending within the
chunk in the smallest unsigned dtype holding ``chunk``, the kept values at the precision,
and decoding scatters them back with zeros elsewhere."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gmjax
from gmjax.core.wire import Wire
from gmjax.core import payload, sparse

from test_codec import reference_dequantize, reference_quantize

TINY = np.float32(2.0**-126)
CASTS = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
PRECISIONS = ("F32", "F16", "BF16", "F8_E4M3", "F4", "I4", "I2")


def reference_select(x, k, chunk):
  """(kept values, indices within their chunks) of ``x``, from the definition."""
  flat = np.ravel(np.asarray(x, np.float32))
  magnitude = np.abs(flat)
  magnitude = np.where(magnitude < TINY, np.float32(0), magnitude)
  values, indices = [], []
  for start in range(0, flat.size, chunk):
    piece = magnitude[start:start + chunk]
    # Stable sort on the negated magnitude: larger first, equal ones by lower index.
    order = np.argsort(-piece.astype(np.float64), kind="stable")[:k]
    order = np.sort(order)
    indices.append(order)
    values.append(flat[start + order])
  return np.concatenate(values), np.concatenate(indices)


def reference_encode(x, precision, k, chunk):
  """The payload entries of leaf ``w`` = ``x``, as numpy arrays (code bytes as uint8)."""
  values, indices = reference_select(x, k, chunk)
  dtype = np.uint8 if chunk <= 256 else np.uint16 if chunk <= 65536 else np.uint32
  entries = {"w.index": indices.astype(dtype)}
  if precision in CASTS:
    entries["w"] = values.astype(CASTS[precision])
  else:
    entries["w"], entries["w.scale"] = reference_quantize(values, precision)
  return entries


def reference_decode(entries, precision, k, chunk, shape):
  n = math.prod(shape)
  index = entries["w.index"].astype(np.int64)
  if precision in CASTS:
    values = entries["w"].astype(np.float32)
  else:
    values = reference_dequantize(entries["w"], entries["w.scale"], index.shape, precision)
  out = np.zeros(n, np.float32)
  position, start = 0, 0
  while start < n:
    count = min(k, n - start, chunk)
    out[start + index[position:position + count]] = values[position:position + count]
    position, start = position + count, start + chunk
  return out.reshape(shape)


def as_bytes(array):
  array = np.asarray(array)
  return array.view(np.uint8) if array.dtype.itemsize == 1 else array.view(
      np.dtype(f"u{array.dtype.itemsize}"))


_encode = jax.jit(lambda values, dtypes, wire: wire.encode_values(values, dict(dtypes)),
                  static_argnums=(1, 2))


def check(x, precision, k, chunk):
  x = np.asarray(x, np.float32)
  schema = gmjax.Schema.from_tree({"w": x})
  wire = Wire(precision, k, chunk)
  entries = wire.encode({"w": jnp.asarray(x)}, schema)
  want = reference_encode(x, precision, k, chunk)
  payload_layout = wire.layout(schema)
  assert set(entries) == set(want) == set(payload_layout.names)
  for spec in payload_layout.parameters:
    got = np.asarray(entries[spec.name])
    assert got.shape == spec.shape, spec
    assert got.dtype == gmjax.core.schema.NUMPY_DTYPES[spec.dtype], spec
    np.testing.assert_array_equal(as_bytes(got), as_bytes(want[spec.name]),
                                  err_msg=spec.name)
  back = wire.decode(entries, schema)["w"]
  assert back.dtype == jnp.float32 and back.shape == x.shape
  np.testing.assert_array_equal(np.asarray(back),
                                reference_decode(want, precision, k, chunk, x.shape))
  return entries, np.asarray(back)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape,k,chunk", [
    ((100,), 3, 16),     # last chunk of 4
    ((5, 7), 4, 32),     # 35 = 32 + 3: the last chunk, shorter than k, keeps all 3
    ((10,), 4, 4),       # k = chunk: dense in sparse form
    ((3,), 5, 8),        # the whole leaf shorter than k
    ((1000,), 10, 300),  # U16 indices, last chunk of 100
    ((257,), 2, 256),    # U8 at its largest chunk
])
def test_matches_reference(precision, shape, k, chunk):
  rng = np.random.default_rng(math.prod(shape) + k + chunk)
  check(rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-3, 1.0, 50.0]),
        precision, k, chunk)


def test_a_leaf_shorter_than_a_chunk_costs_its_own_size():
  # A 100-value leaf was padded to a whole chunk to select, and scattered into one: at
  # delta_chunk=2**24 its encode took 134 MB of scratch, its decode 67 MB, each round.
  x = jax.ShapeDtypeStruct((100,), jnp.float32)
  spec = [gmjax.ParameterSpec("b", "F32", (100,))]

  def scratch(chunk):
    wire = Wire("I4", 8, chunk)
    encode = lambda v: wire.encode_values({"b": v}, {"b": "F32"})[0]
    entries = jax.eval_shape(encode, x)
    decode = lambda e: wire.decode_values(e, spec)
    return [jax.jit(f).lower(a).compile().memory_analysis().temp_size_in_bytes
            for f, a in ((encode, x), (decode, entries))]

  assert scratch(2**24) == scratch(128)
  # The same values at a chunk of 2**31 too, whose chunk starts overflowed int32.
  values = np.random.default_rng(0).standard_normal(100).astype(np.float32)
  check(values, "F32", 8, 2**31)


def test_index_dtypes():
  assert [sparse.index_dtype(c) for c in (1, 256, 257, 65536, 65537)] == [
      "U8", "U8", "U16", "U16", "U32"]
  x = np.arange(70000, dtype=np.float32)
  entries, back = check(x, "F32", 1, 65537)
  assert entries["w.index"].dtype == jnp.uint32
  np.testing.assert_array_equal(entries["w.index"], [65536, 70000 - 65537 - 1])



@pytest.mark.parametrize("k,chunk,run", [(3, 16, 512), (32, 256, 256), (24, 256, 1024),
                                         (64, 16, 32), (1, 4096, 131072)])
def test_whole_run_is_the_fewest_chunks_whose_kept_values_fill_blocks(k, chunk, run):
  assert sparse.whole_run(k, chunk) == Wire("I4", k, chunk).whole_run == run
  kept = sparse.kept_size(run, k, chunk)
  assert kept % 32 == 0 and all(sparse.kept_size(r, k, chunk) % 32
                                for r in range(chunk, run, chunk))

def test_ties_go_to_the_lower_index():
  x = np.array([2, -2, 2, 1, 0, 0, 0, 0, -1, 1, 1, -1], np.float32)
  entries, back = check(x, "F32", 2, 4)
  np.testing.assert_array_equal(entries["w.index"], [0, 1, 0, 1, 0, 1])
  np.testing.assert_array_equal(back, [2, -2, 0, 0, 0, 0, 0, 0, -1, 1, 0, 0])


def test_zeros_subnormals_and_signed_zeros():
  x = np.zeros(20, np.float32)
  x[[3, 7]] = [1e-40, -0.0]  # a subnormal counts as zero: ties with the zeros before it
  x[15] = -3.0
  entries, back = check(x, "F32", 2, 10)
  np.testing.assert_array_equal(entries["w.index"], [0, 1, 0, 5])
  np.testing.assert_array_equal(back[15], -3.0)
  for precision in PRECISIONS:
    check(np.zeros(45, np.float32), precision, 3, 8)


def test_bytes_at_i4_are_the_kept_vectors():
  x = np.array([0.0, 7.0, -1.0, 0.5, 3.0, 0.0, -7.0, 0.25], np.float32)
  entries, back = check(x, "I4", 2, 4)
  np.testing.assert_array_equal(entries["w.index"], [1, 2, 0, 2])
  assert float(entries["w.scale"][0]) == 1.0
  # kept [7, -1, 3, -7] as I4 nibbles 7, -1 = 0xF, 3, -7 = 0x9: two per byte.
  np.testing.assert_array_equal(entries["w"], [0xF7, 0x93])
  np.testing.assert_array_equal(back, [0, 7, -1, 0, 3, 0, -7, 0])


def test_jitted_is_a_function_of_the_delta_only():
  x = jnp.asarray(np.random.default_rng(1).standard_normal(77), jnp.float32)
  first, _ = _encode({"w": x}, (("w", "F32"),), Wire("I2", 5, 16))
  second, _ = _encode({"w": x}, (("w", "F32"),), Wire("I2", 5, 16))
  for name in first:
    np.testing.assert_array_equal(first[name], second[name])
  vmapped, _ = jax.vmap(lambda v: Wire("I2", 5, 16).encode_values({"w": v}, {"w": "F32"})
                        )(jnp.stack([x, -x]))
  np.testing.assert_array_equal(vmapped["w.index"][0], first["w.index"])
  np.testing.assert_array_equal(vmapped["w.index"][1], first["w.index"])


def test_dense_when_topk_is_none():
  x = {"w": jnp.linspace(-1.0, 1.0, 50)}
  schema = gmjax.Schema.from_tree(x)
  assert Wire("I4").layout(schema) == gmjax.layout(schema, "I4")
  dense = gmjax.encode(x, "I4")
  same = Wire("I4").encode(x, schema)
  assert set(dense) == set(same)
  for name in dense:
    np.testing.assert_array_equal(np.asarray(dense[name]), np.asarray(same[name]))


def test_nonfinite_kept_value_refused():
  x = np.ones(20, np.float32)
  x[4] = np.nan
  schema = gmjax.Schema.from_tree({"w": x})
  with pytest.raises(ValueError, match="'w'.*delta_topk=2"):
    Wire("I4", 2, 8).encode({"w": x}, schema)


def test_payload_round_trip_with_index_entries():
  x = np.random.default_rng(2).standard_normal(600).astype(np.float32)
  schema = gmjax.Schema.from_tree({"w": x})
  wire = Wire("BF16", 7, 300)
  entries = wire.encode({"w": x}, schema)
  host = gmjax.core.codec.to_numpy(entries, wire.layout(schema))
  data = payload.dumps(host)
  read, _ = payload.loads(data)
  assert read["w.index"].dtype == np.uint16 and read["w.index"].shape == (14,)
  np.testing.assert_array_equal(
      np.asarray(wire.decode(read, schema)["w"]),
      np.asarray(wire.decode(host, schema)["w"]))


@pytest.mark.parametrize("index,reason", [
    ([0, 3, 1, 2], "out of range for chunk 0 of 3 values"),
    ([1, 1, 0, 1], "repeats"),
    ([2, 1, 0, 1], "is below"),
    ([0, 2, 1, 2], "out of range for chunk 1 of 2 values"),
])
def test_index_problems(index, reason):
  # A leaf of 5 values, chunks of 3: (3, 2) values, k = 2 keeps 2 of each.
  assert sparse.index_problem(np.array([0, 2, 0, 1]), 5, 2, 3) is None
  assert reason in sparse.index_problem(np.array(index), 5, 2, 3)


@pytest.mark.parametrize("topk,chunk,argument", [
    (0, 16, "topk"), (-1, 16, "topk"), (2.0, 16, "topk"), (True, 16, "topk"),
    (2, 0, "chunk"), (2, -3, "chunk"), (2, 2**33, "chunk"), (2, True, "chunk"),
])
def test_wire_refuses_a_topk_or_chunk_that_is_not_a_positive_int(topk, chunk, argument):
  # topk=0 kept nothing (every delta silently zero); chunk=0 divided by zero on encode.
  value = topk if argument == "topk" else chunk
  with pytest.raises(ValueError, match=rf"Wire\({argument}={value!r}\): {argument} must be"):
    Wire("I4", topk, chunk)
