"""The codec against a numpy + ml_dtypes reference: exact bytes, error bounds, refusals."""

import math
import re

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gmjax
from gmjax.core import codec, wire

QMAX = {"F8_E4M3": 448.0, "F4": 6.0, "I4": 7.0, "I2": 1.0}
PER_BYTE = {"F4": 2, "I4": 2, "I2": 4}  # packed codes per byte
TINY = np.float32(2.0**-126)  # the smallest normal float: subnormals count as zero
F4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def reference_quantize(x, precision):
  """Codes and scales per SPEC section 4, in numpy: (code bytes as uint8, scales)."""
  qmax = np.float32(QMAX[precision])
  flat = np.ravel(np.asarray(x, np.float32))
  n = flat.size
  blocks = np.zeros(-(-n // 32) * 32, np.float32)
  blocks[:n] = flat
  blocks = np.where(np.abs(blocks) < TINY, np.float32(0), blocks).reshape(-1, 32)
  scales = (np.max(np.abs(blocks), axis=1) / qmax).astype(np.float32)
  scales = np.where(scales < TINY, np.float32(0), scales)
  with np.errstate(divide="ignore", invalid="ignore"):
    scaled = np.where(scales[:, None] > 0, blocks / scales[:, None], np.float32(0))
  scaled = np.clip(scaled.astype(np.float32), -qmax, qmax)
  if precision == "F8_E4M3":
    codes = scaled.astype(ml_dtypes.float8_e4m3fn).reshape(-1)[:n]
    return codes.view(np.uint8).reshape(np.shape(x)), scales
  if precision == "I2":
    # ml_dtypes stores one int2 per byte, its two's complement bits low.
    codes = np.clip(np.rint(scaled), -1, 1).astype(np.int8).astype(ml_dtypes.int2)
    fields = (codes.reshape(-1).view(np.uint8) & 0x03).reshape(-1, 4)
    packed = (fields[:, 0] | fields[:, 1] << 2 | fields[:, 2] << 4 | fields[:, 3] << 6)
    return packed.astype(np.uint8)[: -(-n // 4)], scales
  if precision == "F4":
    # ml_dtypes stores one float4 per byte; reading it as uint8 keeps the high nibble's
    # garbage for negative values, so mask it.
    nibbles = scaled.astype(ml_dtypes.float4_e2m1fn).reshape(-1).view(np.uint8) & 0x0F
  else:
    nibbles = np.rint(scaled).astype(np.int8).reshape(-1).view(np.uint8) & 0x0F
  packed = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
  return packed[: -(-n // 2)], scales


def reference_dequantize(code_bytes, scales, shape, precision):
  n = math.prod(shape)
  if precision == "F8_E4M3":
    values = code_bytes.reshape(-1).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  elif precision == "I2":
    fields = (code_bytes.reshape(-1, 1) >> np.array([0, 2, 4, 6], np.uint8)) & 0x03
    values = fields.reshape(-1).view(ml_dtypes.int2).astype(np.float32)
  else:
    nibbles = np.empty(code_bytes.size * 2, np.uint8)
    nibbles[0::2] = code_bytes & 0x0F
    nibbles[1::2] = code_bytes >> 4
    if precision == "F4":
      values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    else:
      values = ((nibbles.astype(np.int8) << 4) >> 4).astype(np.float32)
  values = values[:n]
  block_scales = np.repeat(scales, 32)[:n]
  values = (values * block_scales).astype(np.float32)
  return np.where(np.abs(values) < TINY, np.float32(0), values).reshape(shape)


def code_bytes(codes):
  codes = np.asarray(codes)
  return codes.view(np.uint8) if codes.dtype == ml_dtypes.float8_e4m3fn else codes


def check_against_reference(x, precision):
  x = np.asarray(x, np.float32)
  codes, scales = gmjax.quantize(jnp.asarray(x), precision)
  want_codes, want_scales = reference_quantize(x, precision)
  if precision == "F8_E4M3":
    assert codes.dtype == jnp.float8_e4m3fn and codes.shape == x.shape
  else:
    assert codes.dtype == jnp.uint8 and codes.shape == (-(-x.size // PER_BYTE[precision]),)
  assert scales.dtype == jnp.float32 and scales.shape == (-(-x.size // 32),)
  np.testing.assert_array_equal(code_bytes(codes), want_codes)
  np.testing.assert_array_equal(np.asarray(scales).view(np.uint32), want_scales.view(np.uint32))
  back = gmjax.dequantize(codes, scales, x.shape, precision)
  assert back.dtype == jnp.float32 and back.shape == x.shape
  want = reference_dequantize(want_codes, want_scales, x.shape, precision)
  np.testing.assert_array_equal(np.asarray(back), want)


PRECISIONS = ("F8_E4M3", "F4", "I4", "I2")
SHAPES = [(1,), (31,), (32,), (33,), (65,), (3, 5), (4, 8, 3), (2, 3, 5, 7), (),
          (0,), (0, 3)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_matches_reference(precision, shape):
  rng = np.random.default_rng(hash((precision, shape)) % 2**32)
  x = rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-3, 1.0, 50.0])
  check_against_reference(x, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_special_blocks(precision):
  x = np.zeros(32 * 8 + 5, np.float32)
  x[32:64] = -0.0  # a zero block of negative zeros: still scale 0 and zero codes
  x[64:96] = np.float32(3e38) * np.sign(np.arange(32) - 15.5)  # huge magnitudes
  x[96:128] = np.linspace(-1e-30, 1e-30, 32)  # tiny, scales stay normal floats
  x[128:160] = [0.5, -1.0] * 16  # exact grid points and halfway cases
  x[160:192] = np.arange(32) / 31.0 * 7.5 - 3.75
  x[192:224] = 448.0 * np.linspace(-1, 1, 32)
  x[224:256] = np.float32(1.0) / (np.arange(32) + 1)
  x[256:] = [1.0, -2.0, 0.0, 5.0, -0.0]
  check_against_reference(x, precision)
  codes, scales = gmjax.quantize(jnp.asarray(x), precision)
  assert float(scales[0]) == 0 and float(scales[1]) == 0
  if precision == "F8_E4M3":
    assert not np.any(code_bytes(codes)[:64])
  else:
    assert not np.any(np.asarray(codes)[: 64 // PER_BYTE[precision]])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_code_roundtrips(precision):
  """Each representable code times a scale encodes to itself."""
  if precision == "F8_E4M3":
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = grid[np.isfinite(grid)]
  elif precision == "F4":
    grid = np.concatenate([F4_GRID, -F4_GRID])
  else:
    grid = np.arange(-QMAX[precision], QMAX[precision] + 1, dtype=np.float32)
  qmax = QMAX[precision]
  for start in range(0, grid.size, 31):
    block = np.zeros(32, np.float32)
    block[0] = qmax  # fixes the scale at exactly 1
    chunk = grid[start : start + 31]
    block[1 : 1 + chunk.size] = chunk
    check_against_reference(block, precision)
    codes, scales = gmjax.quantize(jnp.asarray(block), precision)
    assert float(scales[0]) == 1.0
    np.testing.assert_array_equal(
        np.asarray(gmjax.dequantize(codes, scales, block.shape, precision)), block
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_subnormal_scales_clip(precision):
  """Subnormals count as zero: in inputs, in scales and in decoded values."""
  least = np.float32(2.0**-149)
  x = np.zeros(32 * 6, np.float32)
  x[:32] = least * np.arange(-16, 16)  # a block of subnormals
  x[32:64] = np.float32(2.0**-130) * np.linspace(-1, 1, 32)
  x[64:96] = TINY * np.linspace(-1, 1, 32)  # normal absmax, subnormal scale
  x[96:128] = QMAX[precision] * TINY * np.linspace(-1, 1, 32)  # the smallest normal scale
  x[128:160] = QMAX[precision] * TINY * 4 * np.linspace(-1, 1, 32)
  x[128] = least  # a subnormal value beside normal ones
  x[160:192] = 1e-36 * np.linspace(-1, 1, 32)
  check_against_reference(x, precision)
  codes, scales = gmjax.quantize(jnp.asarray(x), precision)
  # With Qmax = 1 (I2) a normal absmax is a normal scale: only I2's third block keeps one.
  third = TINY if QMAX[precision] == 1 else 0
  np.testing.assert_array_equal(np.asarray(scales)[:3], [0, 0, third])
  assert float(scales[3]) == TINY


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_subnormal_scale_decodes_as_zero(precision):
  """A payload may hold a subnormal scale that quantize never writes: it is zero, so the
  largest code times it (a normal product) is zero on every backend. (CPU flushes it
  anyway; the explicit flush is for backends that keep subnormals.)"""
  codes, _ = gmjax.quantize(jnp.full([32], 1.0, jnp.float32), precision)
  for scale in (1e-40, -1e-40, 2.0**-149):
    decoded = gmjax.dequantize(codes, np.array([scale], np.float32), (32,), precision)
    np.testing.assert_array_equal(np.asarray(decoded), np.zeros(32, np.float32))
  decoded = gmjax.dequantize(codes, np.array([TINY], np.float32), (32,), precision)
  assert np.all(np.asarray(decoded) == QMAX[precision] * TINY)


def test_f8_does_not_overflow_to_nan():
  # 465 / (465 / 448) can round above 448; the cast alone would make NaN.
  for top in (465.0, 449.0, 1000.0, 3.0e38):
    x = np.array([top, -top, top / 3], np.float32)
    codes, scales = gmjax.quantize(jnp.asarray(x), "F8_E4M3")
    assert np.all(np.isfinite(np.asarray(codes).astype(np.float32)))
    check_against_reference(x, "F8_E4M3")


def test_nibble_order():
  x = np.zeros(32, np.float32)
  x[0], x[1], x[2], x[3] = 7.0, -1.0, 2.0, 3.0
  codes, _ = gmjax.quantize(jnp.asarray(x), "I4")
  assert np.asarray(codes)[0] == 0x7 | (0xF << 4)  # -1 is 0xF in two's complement
  assert np.asarray(codes)[1] == 0x2 | (0x3 << 4)
  codes, _ = gmjax.quantize(jnp.asarray(x * 6 / 7), "F4")
  assert np.asarray(codes)[0] & 0x0F == 0x7  # 6.0 is e2m1 0b0111


def grid_step_bound(x, precision):
  """Per element: the spacing of the block's code grid around x (times the scale)."""
  flat = np.ravel(np.asarray(x, np.float32)).astype(np.float64)
  n = flat.size
  padded = np.zeros(-(-n // 32) * 32)
  padded[:n] = flat
  scale = np.repeat(np.max(np.abs(padded.reshape(-1, 32)), axis=1) / QMAX[precision], 32)[:n]
  scaled = np.abs(np.divide(flat, scale, out=np.zeros_like(flat), where=scale > 0))
  if precision in ("I4", "I2"):
    step = np.ones_like(scaled)
  elif precision == "F4":
    step = np.where(scaled < 2, 0.5, np.where(scaled < 4, 1.0, 2.0))
  else:
    # e4m3: 3 mantissa bits; subnormal spacing 2**-9 below 2**-6.
    exponent = np.floor(np.log2(np.maximum(scaled, 2.0**-6)))
    step = 2.0 ** (exponent - 3)
  # The codes round to nearest: at most half a step, plus float32 rounding of x/scale.
  return (0.5 * step * (1 + 1e-6) + 1e-6) * scale


finite_f32 = st.floats(
    -float(np.float32(1e30)), float(np.float32(1e30)), allow_nan=False, allow_infinity=False,
    allow_subnormal=False, width=32,
)


@pytest.mark.parametrize("precision", PRECISIONS)
@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(data=st.data())
def test_error_within_half_a_code_step(precision, data):
  n = data.draw(st.sampled_from([1, 7, 31, 33, 96]))  # few shapes: few compilations
  x = data.draw(hnp.arrays(np.float32, (n,), elements=finite_f32))
  x = np.where(np.abs(x) < 1e-30, 0, x).astype(np.float32)  # keep every scale normal
  codes, scales = gmjax.quantize(jnp.asarray(x), precision)
  back = np.asarray(gmjax.dequantize(codes, scales, x.shape, precision), np.float64)
  error = np.abs(back - x.astype(np.float64))
  bound = grid_step_bound(x, precision)
  assert np.all(error <= bound), (x[error > bound], error[error > bound], bound[error > bound])
  np.testing.assert_array_equal(code_bytes(codes), reference_quantize(x, precision)[0])


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_cast_matches_numpy(dtype):
  x = np.random.default_rng(0).standard_normal((7, 9)).astype(np.float32) * 100
  entries = gmjax.encode({"w": jnp.asarray(x)}, dtype)
  want = x.astype({"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[dtype])
  assert entries["w"].dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(entries["w"]), want)
  back = gmjax.decode(entries, gmjax.Schema.from_tree({"w": x}), dtype)["w"]
  np.testing.assert_array_equal(np.asarray(back), want.astype(np.float32))


def test_encode_decode_tree_roundtrip():
  tree = {"a": jnp.ones((3, 4)), "b": [jnp.arange(5.0).astype(jnp.bfloat16)]}
  schema = gmjax.Schema.from_tree(tree)
  for precision in (None, "F32", "F16", "BF16", *PRECISIONS):
    entries = gmjax.encode(tree, precision)
    layout = gmjax.layout(schema, precision)
    assert sorted(entries) == sorted(layout.names)
    for spec in layout:
      assert tuple(entries[spec.name].shape) == spec.shape, (precision, spec)
    back = gmjax.decode(entries, schema, precision)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    np.testing.assert_allclose(np.asarray(back["a"]), 1.0, rtol=0.2)
  assert gmjax.encode(tree, None)["b/0"].dtype == jnp.bfloat16


def test_layout_specs():
  schema = gmjax.Schema.from_tree({"w": jnp.zeros((5, 13)), "v": jnp.zeros((), jnp.float16)})
  assert gmjax.layout(schema, None) == schema
  got = {s.name: (s.dtype, s.shape) for s in gmjax.layout(schema, "F4")}
  assert got == {"v": ("U8", (1,)), "v.scale": ("F32", (1,)),
                 "w": ("U8", (33,)), "w.scale": ("F32", (3,))}
  got = {s.name: (s.dtype, s.shape) for s in gmjax.layout(schema, "F8_E4M3")}
  assert got["w"] == ("F8_E4M3", (5, 13)) and got["v"] == ("F8_E4M3", ())
  assert {s.dtype for s in gmjax.layout(schema, "BF16")} == {"BF16"}
  with pytest.raises(ValueError, match="precision"):
    gmjax.layout(schema, "F8")


@pytest.mark.parametrize("precision", [None, "F32", "F16", "BF16", *PRECISIONS])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_refused_naming_the_leaf(precision, bad):
  x = np.ones((40,), np.float32)
  x[35] = bad
  tree = {"good": jnp.ones(3), "layer": {"kernel": jnp.asarray(x)}}
  with pytest.raises(ValueError, match="layer/kernel"):
    gmjax.encode(tree, precision)


def test_cast_overflow_refused():
  for value, dtype in [(65520.0, "F16"), (1e5, "F16"), (3.3961776e38, "BF16")]:
    with pytest.raises(ValueError, match="'w'"):
      gmjax.encode({"w": jnp.array([value], jnp.float32)}, dtype)
  for value, dtype in [(65519.0, "F16"), (65504.0, "F16"), (3.38e38, "BF16")]:
    entries = gmjax.encode({"w": jnp.array([value], jnp.float32)}, dtype)
    assert np.isfinite(np.asarray(entries["w"]).astype(np.float32)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("precision", [None, "F32", "F16", "BF16"])
def test_cast_check_on_whole_blocks(precision, dtype):
  # Sizes that are multiples of 32 take the row-wise check; it must refuse exactly what
  # the cast makes non-finite (numpy's cast is the reference).
  target = {None: dtype, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
  values = [np.nan, np.inf, -np.inf, 1.0, -0.0, 65504.0, -65519.0, 65520.0, -65520.0,
            3.38e38, 3.3961776e38, -3.3961776e38]
  for value in values:
    x = np.full((2, 64), 0.5, np.float32)
    x[1, 37] = value
    with np.errstate(over="ignore", invalid="ignore"):
      x = x.astype(dtype)
      ok = np.isfinite(x.astype(np.float32).astype(target[precision])).all()
    tree = {"w": jnp.asarray(x)}
    if ok:
      entries = gmjax.encode(tree, precision)
      assert np.isfinite(np.asarray(entries["w"]).astype(np.float32)).all()
    else:
      with pytest.raises(ValueError, match="'w'"):
        gmjax.encode(tree, precision)


def test_unknown_precision():
  with pytest.raises(ValueError, match="precision"):
    gmjax.encode({"w": jnp.ones(3)}, "int8")
  with pytest.raises(ValueError, match="precision"):
    gmjax.quantize(jnp.ones(3), "F16")


def test_quantize_jits_and_vmaps():
  x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 64)), jnp.float32)
  for precision in PRECISIONS:
    codes, scales = jax.jit(gmjax.quantize, static_argnums=1)(x[0], precision)
    vcodes, vscales = jax.vmap(lambda r, p=precision: gmjax.quantize(r, p))(x)
    np.testing.assert_array_equal(code_bytes(vcodes[0]), code_bytes(codes))
    np.testing.assert_array_equal(np.asarray(vscales[0]), np.asarray(scales))


def test_no_recompile_on_second_call():
  tree = {"w": jnp.ones((8, 8)), "b": jnp.zeros(8)}
  schema = gmjax.Schema.from_tree(tree)
  for precision in ("BF16", "F4"):
    entries = gmjax.encode(tree, precision)
    gmjax.decode(entries, schema, precision)
    encodes, decodes = wire._encode_jit._cache_size(), wire._decode_jit._cache_size()
    other = jax.tree.map(lambda v: v + 1, tree)
    entries = gmjax.encode(other, precision)
    gmjax.decode(entries, schema, precision)
    assert wire._encode_jit._cache_size() == encodes
    assert wire._decode_jit._cache_size() == decodes


def _entries(precision):
  x = {"w": np.linspace(-1.0, 1.0, 64, dtype=np.float32)}
  return ({k: np.asarray(v) for k, v in gmjax.encode(x, precision).items()},
          gmjax.Schema.from_tree(x))


@pytest.mark.parametrize("precision,name,change", [
    ("I4", "w", lambda v: v[: v.size // 2]),  # short codes decoded as zeros before
    ("I2", "w.scale", lambda v: v[:1]),  # one scale broadcast to every block before
    ("F8_E4M3", "w", lambda v: v.view(np.uint8)),  # codes converted, not read, before
    ("F4", "w", lambda v: v.astype(np.float32)),
    ("F16", "w", lambda v: v.astype(np.float32)),
])
def test_decode_refuses_entries_unlike_the_layout(precision, name, change):
  entries, schema = _entries(precision)
  entries[name] = change(entries[name])
  with pytest.raises(ValueError, match=rf"decode: entry '{re.escape(name)}' has shape"
                     r".*lays it out as .* \(see gmjax.layout"):
    gmjax.decode(entries, schema, precision)


@pytest.mark.parametrize("index,reason", [([1, 9, 0, 1], "out of range"),
                                          ([1, 1, 0, 1], "repeats")])
def test_sparse_decode_refuses_bad_indices(index, reason):
  x = {"w": np.linspace(-1.0, 1.0, 16, dtype=np.float32)}
  schema, sparse_wire = gmjax.Schema.from_tree(x), wire.Wire("I4", 2, 8)
  entries = {k: np.asarray(v) for k, v in sparse_wire.encode(schema.flatten(x), schema).items()}
  entries["w.index"] = np.asarray(index, entries["w.index"].dtype)
  with pytest.raises(ValueError, match=rf"decode: entry 'w.index': index .* {reason}"):
    sparse_wire.decode(entries, schema)


@pytest.mark.parametrize("precision", ["F8_E4M3", "F4", "I4", "I2"])
def test_dequantize_refuses_codes_or_scales_of_another_size(precision):
  # A scale vector too short was broadcast over every block, and I4 codes too short
  # were padded with zero codes: both decoded silently to other values.
  x = jnp.linspace(-1.0, 1.0, 96)
  codes, scales = gmjax.quantize(x, precision)
  np.testing.assert_array_equal(gmjax.dequantize(codes, scales, (96,), precision),
                                gmjax.dequantize(np.asarray(codes), np.asarray(scales),
                                                 (96,), precision))
  for bad_codes, bad_scales in ((codes, scales[:1]), (codes[:-4], scales),
                                (jnp.concatenate([codes, codes[:4]]), scales),
                                (codes, jnp.concatenate([scales, scales]))):
    with pytest.raises(ValueError, match=rf"dequantize: {precision} codes of 96 values.*"
                                         r"pass quantize's codes and scales"):
      gmjax.dequantize(bad_codes, bad_scales, (96,), precision)
  # A shape of non-integers was truncated ((96.7,) read as (96,)); a bare int failed with
  # "'int' object is not iterable".
  for shape in ((96.7,), 96, (-96,), None):
    with pytest.raises(ValueError, match=r"dequantize: shape must be a tuple of"
                                         r" non-negative ints"):
      gmjax.dequantize(codes, scales, shape, precision)
  # quantize takes what jnp.asarray takes, a list too (it failed inside jnp.ravel).
  listed = gmjax.quantize(np.asarray(x).tolist(), precision)
  for got, want in zip(listed, (codes, scales)):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                  np.asarray(want).view(np.uint8))


def test_wire_encode_takes_the_schemas_leaves_only():
  # A leaf shorter than its spec was encoded with a short index, a missing one gave no
  # entry, an integer one was cast: decode refused them later, or never saw them.
  schema = gmjax.Schema.from_tree({"w": np.zeros(6, np.float32), "v": np.zeros(3, np.float32)})
  sparse_wire = wire.Wire("I4", 2, 4)
  good = {"w": np.ones(6, np.float32), "v": np.ones(3, np.float16)}
  assert sorted(sparse_wire.encode(good, schema)) == ["v", "v.index", "v.scale", "w",
                                                       "w.index", "w.scale"]
  for values, match in (({**good, "w": np.ones(5, np.float32)}, r"leaf 'w' is float32\[5\]"),
                        ({"w": good["w"]}, r"missing \['v'\]"),
                        ({**good, "u": good["v"]}, r"not in the schema \['u'\]"),
                        ({**good, "w": np.ones(6, np.int32)}, r"leaf 'w' is int32\[6\]")):
    with pytest.raises(ValueError, match="Wire.encode: " + ".*" + match):
      sparse_wire.encode(values, schema)
