"""Pure guards against hostile input: short quotes and the outlier rule of a round."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gmjax.core import guards


def test_quote_is_short_escaped_and_ascii():
  assert guards.quote("w0") == "'w0'"
  long = "é\x00\n" * 1_000_000
  quoted = guards.quote(long)
  assert quoted.isascii() and "\n" not in quoted and len(quoted) <= guards.QUOTE_CHARS * 12
  assert quoted.endswith(f"...(3000000 chars)")
  assert guards.quote(["x"] * 10**6).startswith("['x', 'x'")
  assert len(guards.quote(["x"] * 10**6)) < 1000


@pytest.mark.parametrize("values, expected", [
    ([5.0], [np.nan]),                          # M=1: nobody to compare with
    ([1.0, 100.0], [1.0, 1.0]),                  # M=2: the larger judged by the smaller
    ([1.0, 2.0, 1e6], [2.0, 2.0, 2.0]),          # the lower median, its own included
    ([1.0, 1e6, 1e6], [1e6, 1e6, 1e6]),          # a majority is the median
    ([1.0, 1.1, 0.05], [1.0, 1.0, 1.0]),         # a small minority cannot lower it
    ([1.0, 1.1, 1.2, 0.05, 0.05], [1.0] * 5),
    ([0.0, 3.0], [3.0, np.nan]),                 # a zero is no reference
    ([np.nan, 2.0, 3.0], [2.0, 2.0, 2.0]),
    ([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0]),
])
def test_reference_is_the_lower_median(values, expected):
  np.testing.assert_array_equal(guards.reference(np.asarray(values)), np.asarray(expected))
  on_device = jax.jit(lambda v: guards.reference(v, xp=jnp))(jnp.asarray(values, jnp.float32))
  np.testing.assert_allclose(np.asarray(on_device), np.asarray(expected, np.float32))


def test_a_minority_of_small_values_makes_no_one_an_outlier():
  # Of three, one tiny delta (an attacker's, or a learner near its optimum) made both
  # others outliers when each was judged by the lower median of the *others*.
  np.testing.assert_array_equal(guards.outliers(np.asarray([1.0, 1.1, 0.05])),
                                [False, False, False])
  np.testing.assert_array_equal(
      guards.outliers(np.asarray([1.0, 1.1, 1.2, 0.05, 0.05])), [False] * 5)
  np.testing.assert_array_equal(  # and a minority of large ones is still caught
      guards.outliers(np.asarray([1.0, 1.1, 1.2, 50.0, 60.0])), [False] * 3 + [True] * 2)


def test_outliers_at_the_documented_factor():
  factor = guards.OUTLIER_FACTOR
  assert factor == 10.0
  np.testing.assert_array_equal(guards.outliers(np.asarray([1.0, factor])), [False, False])
  np.testing.assert_array_equal(guards.outliers(np.asarray([1.0, factor * 1.01])), [False, True])
  np.testing.assert_array_equal(guards.outliers(np.asarray([1e38, 1.0, 2.0])), [True, False, False])
  np.testing.assert_array_equal(guards.outliers(np.asarray([np.inf, 1.0])), [True, False])
  np.testing.assert_array_equal(guards.outliers(np.asarray([3e38])), [False])
