"""The codec's integer-arithmetic conversions against ml_dtypes, value by value."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gmjax.core import kernels


def neighbourhood(values):
  """``values``, the midpoints between neighbours, and the floats either side of each."""
  values = np.unique(values.astype(np.float32))
  mids = ((values[1:].astype(np.float64) + values[:-1]) / 2).astype(np.float32)
  points = np.concatenate([values, mids])
  return np.unique(np.concatenate([
      points, np.nextafter(points, np.float32(-np.inf)), np.nextafter(points, np.float32(np.inf))
  ]))


def test_f8_e4m3_matches_ml_dtypes():
  grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  x = neighbourhood(grid[np.isfinite(grid)])
  x = np.concatenate([x[np.abs(x) <= 448], [0.0, -0.0, 1e-30, -1e-30, 2.0**-10, 2.0**-9]])
  x = x.astype(np.float32)
  got = np.asarray(kernels.f8_e4m3_codes(jnp.asarray(x))).view(np.uint8)
  want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  np.testing.assert_array_equal(got, want)
  nan = np.asarray(kernels.f8_e4m3_codes(jnp.asarray([np.nan], jnp.float32))).astype(np.float32)
  assert np.isnan(nan).all()


def test_f8_e4m3_values_match_ml_dtypes():
  codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
  got = np.asarray(kernels.f8_e4m3_values(jnp.asarray(codes)))
  want = codes.astype(np.float32)
  finite = np.isfinite(want)
  np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
  assert np.array_equal(np.isnan(got), ~finite)


def test_nibbles_pack_and_unpack():
  nibbles = np.random.default_rng(0).integers(0, 16, 4096).astype(np.int32)
  packed = np.asarray(kernels.pack_nibbles(jnp.asarray(nibbles)))
  np.testing.assert_array_equal(packed, (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8))
  np.testing.assert_array_equal(np.asarray(kernels.unpack_nibbles(jnp.asarray(packed))), nibbles)


def test_f4_nibbles_match_ml_dtypes():
  grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
  x = neighbourhood(np.concatenate([grid, -grid]))
  x = np.concatenate([x[np.abs(x) <= 6], [0.0, -0.0, 1e-30, -1e-30, 2.0**-126, 2.0**-149]])
  x = x.astype(np.float32)
  got = np.asarray(kernels.f4_codes(jnp.asarray(x)))
  want = (x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F).astype(np.int32)
  np.testing.assert_array_equal(got, want)
