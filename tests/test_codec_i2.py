"""I2 (symmetric 2-bit codes, four per byte) against a numpy + ml_dtypes reference written
from its definition: ``scale = absmax``, codes ``clip(round_half_even(x / scale), -1, 1)``
as two's-complement 2-bit fields, element ``4i + j`` in bits ``2j, 2j+1`` of byte ``i``."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gmjax

TINY = np.float32(2.0**-126)
SHIFTS = np.array([0, 2, 4, 6], np.uint8)


def reference_encode(x):
  """(packed code bytes, scales) of ``x`` at I2, from the definition."""
  flat = np.ravel(np.asarray(x, np.float32))
  n = flat.size
  blocks = np.zeros(-(-n // 32) * 32, np.float32)
  blocks[:n] = np.where(np.abs(flat) < TINY, np.float32(0), flat)
  blocks = blocks.reshape(-1, 32)
  scales = np.max(np.abs(blocks), axis=1).astype(np.float32)  # absmax / 1
  scales = np.where(scales < TINY, np.float32(0), scales)
  safe = np.where(scales > 0, scales, np.float32(1))[:, None]
  quotient = np.where(scales[:, None] > 0, blocks / safe, np.float32(0)).astype(np.float32)
  codes = np.clip(np.rint(quotient), -1, 1).astype(np.int8).astype(ml_dtypes.int2)
  fields = (codes.reshape(-1).view(np.uint8) & 0x03).reshape(-1, 4).astype(np.uint8)
  packed = np.bitwise_or.reduce(fields << SHIFTS, axis=1).astype(np.uint8)
  return packed[: -(-n // 4)], scales


def reference_decode(packed, scales, shape):
  n = math.prod(shape)
  fields = ((np.asarray(packed, np.uint8)[:, None] >> SHIFTS) & 0x03).reshape(-1)
  codes = fields.view(ml_dtypes.int2).astype(np.float32)[:n]
  values = (codes * np.repeat(np.asarray(scales, np.float32), 32)[:n]).astype(np.float32)
  return np.where(np.abs(values) < TINY, np.float32(0), values).reshape(shape)


def check(x):
  x = np.asarray(x, np.float32)
  codes, scales = jax.jit(gmjax.quantize, static_argnums=1)(jnp.asarray(x), "I2")
  want_codes, want_scales = reference_encode(x)
  assert codes.dtype == jnp.uint8 and codes.shape == (-(-x.size // 4),)
  assert scales.dtype == jnp.float32 and scales.shape == (-(-x.size // 32),)
  np.testing.assert_array_equal(np.asarray(codes), want_codes)
  np.testing.assert_array_equal(np.asarray(scales).view(np.uint32), want_scales.view(np.uint32))
  back = gmjax.dequantize(codes, scales, x.shape, "I2")
  assert back.dtype == jnp.float32 and back.shape == x.shape
  np.testing.assert_array_equal(np.asarray(back), reference_decode(want_codes, want_scales,
                                                                   x.shape))
  return np.asarray(codes), np.asarray(scales), np.asarray(back)


@pytest.mark.parametrize("shape", [(), (1,), (2,), (3,), (5,), (6,), (31,), (33,), (63,),
                                   (97,), (130,), (3, 7), (2, 3, 11)])
def test_matches_reference_for_sizes_off_the_block_and_byte(shape):
  rng = np.random.default_rng(math.prod(shape) + len(shape))
  check(rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-3, 1.0, 50.0]))


def test_bit_layout_and_rounding():
  x = np.zeros(32, np.float32)
  x[:8] = [1.0, -1.0, 0.0, 0.5, -0.5, 0.51, -0.51, 0.49]
  codes, scales, back = check(x)
  assert float(scales[0]) == 1.0
  # Element 4i + j in bits 2j..2j+1 of byte i; -1 is 0b11; halves round to even (0).
  assert codes[0] == 0b01 | 0b11 << 2 | 0b00 << 4 | 0b00 << 6
  assert codes[1] == 0b00 | 0b01 << 2 | 0b11 << 4 | 0b00 << 6
  assert not codes[2:].any()
  np.testing.assert_array_equal(back[:8], [1, -1, 0, 0, 0, 1, -1, 0])


def test_special_blocks():
  x = np.zeros(32 * 6 + 3, np.float32)
  x[32:64] = -0.0  # zero block of negative zeros: scale 0, zero codes
  x[64:96] = np.float32(3e38) * np.sign(np.arange(32) - 15.5)
  x[96:128] = np.linspace(-1e-30, 1e-30, 32)
  x[128:160] = TINY * np.linspace(-1, 1, 32)  # the smallest normal scale
  x[160:192] = np.float32(2.0**-140) * np.arange(32)  # subnormals count as zero
  x[160] = TINY * 3
  x[192:] = [2.0, -1.0, 1.5]
  codes, scales, back = check(x)
  assert float(scales[0]) == 0 and float(scales[1]) == 0 and not codes[:16].any()
  assert float(scales[4]) == TINY
  np.testing.assert_array_equal(back[161:192], 0)
  np.testing.assert_array_equal(back[192:], [2.0, 0.0, 2.0])


def test_no_minus_two_code_is_produced():
  rng = np.random.default_rng(7)
  x = rng.standard_normal(32 * 64).astype(np.float32) * np.repeat(
      10.0 ** rng.integers(-20, 20, 64), 32).astype(np.float32)
  codes, _, _ = check(x)
  fields = (codes[:, None] >> SHIFTS) & 0x03
  assert not (fields == 0b10).any()


def test_minus_two_code_decodes_to_minus_twice_the_scale():
  # Never encoded; a payload holding it decodes by two's complement, as I4's -8 does.
  packed = np.array([0b10_01_11_10, 0b10], np.uint8)
  scales = np.array([0.25], np.float32)
  back = np.asarray(gmjax.dequantize(jnp.asarray(packed), jnp.asarray(scales), (6,), "I2"))
  np.testing.assert_array_equal(back, [-0.5, -0.25, 0.25, -0.5, -0.5, 0.0])
  np.testing.assert_array_equal(back, reference_decode(packed, scales, (6,)))
  i4 = gmjax.dequantize(jnp.asarray([0x08], jnp.uint8), jnp.asarray(scales), (1,), "I4")
  assert float(i4[0]) == -8 * 0.25


def test_nonfinite_values_make_the_block_scale_nonfinite_as_in_i4():
  for bad in (np.nan, np.inf, -np.inf):
    x = np.ones(70, np.float32)
    x[40] = bad
    _, scales = gmjax.quantize(jnp.asarray(x), "I2")
    _, i4_scales = gmjax.quantize(jnp.asarray(x), "I4")
    np.testing.assert_array_equal(np.isfinite(scales), np.isfinite(i4_scales))
    assert np.isfinite(scales).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="'w'.*'I2'"):
      gmjax.encode({"w": jnp.asarray(x)}, "I2")


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_input_dtype_does_not_change_the_bytes(dtype):
  x = jnp.asarray(np.random.default_rng(3).standard_normal(77), dtype)
  codes, scales = gmjax.quantize(x, "I2")
  want_codes, want_scales = reference_encode(np.asarray(x.astype(jnp.float32)))
  assert codes.dtype == jnp.uint8 and scales.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(codes), want_codes)
  np.testing.assert_array_equal(np.asarray(scales), want_scales)
  assert gmjax.dequantize(codes, scales, x.shape, "I2").dtype == jnp.float32


def test_vmap_and_jit():
  x = np.random.default_rng(4).standard_normal((5, 45)).astype(np.float32)
  codes, scales = jax.vmap(lambda r: gmjax.quantize(r, "I2"))(jnp.asarray(x))
  back = jax.jit(jax.vmap(lambda c, s: gmjax.dequantize(c, s, (45,), "I2")))(codes, scales)
  for row in range(5):
    want_codes, want_scales = reference_encode(x[row])
    np.testing.assert_array_equal(np.asarray(codes[row]), want_codes)
    np.testing.assert_array_equal(np.asarray(back[row]),
                                  reference_decode(want_codes, want_scales, (45,)))


def test_layout_and_tree_roundtrip():
  tree = {"w": jnp.linspace(-1.0, 1.0, 65).reshape(5, 13), "v": jnp.ones((), jnp.bfloat16)}
  schema = gmjax.Schema.from_tree(tree)
  got = {s.name: (s.dtype, s.shape) for s in gmjax.layout(schema, "I2")}
  assert got == {"v": ("U8", (1,)), "v.scale": ("F32", (1,)),
                 "w": ("U8", (17,)), "w.scale": ("F32", (3,))}
  entries = gmjax.encode(tree, "I2")
  assert {n: tuple(e.shape) for n, e in entries.items()} == {n: s for n, (_, s) in got.items()}
  back = gmjax.decode(entries, schema, "I2")
  np.testing.assert_array_equal(np.asarray(back["w"]),
                                reference_decode(*reference_encode(tree["w"]), (5, 13)))
  assert float(back["v"]) == 1.0


def test_accepted_where_i4_is():
  config = gmjax.DiLoCo(sync_every=4, delta_precision="I2", commit_precision="I2")
  assert config.delta_dtype == "I2" and config.commit_dtype == "I2"
  assert config.to_json()["delta_precision"] == "I2"
  with pytest.raises(ValueError, match="delta_precision='I3'.*'I2'"):
    gmjax.DiLoCo(sync_every=4, delta_precision="I3")
