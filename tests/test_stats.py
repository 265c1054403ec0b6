"""The cosine statistic against numpy."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import gmjax


def numpy_cosine(deltas):
  flat = [np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in d.values()])
          for d in deltas]
  values = [a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
            for a, b in itertools.combinations(flat, 2)
            if np.linalg.norm(a) > 0 and np.linalg.norm(b) > 0]
  return float(np.mean(values)) if values else None


@pytest.mark.parametrize("count", [2, 3, 5])
def test_cosine_matches_numpy(count):
  rng = np.random.default_rng(count)
  shared = rng.standard_normal(40)
  deltas = [{"a": jnp.asarray(shared[:30] + rng.standard_normal(30), jnp.float32),
             "b": jnp.asarray(shared[30:] + rng.standard_normal(10), jnp.bfloat16)}
            for _ in range(count)]
  assert gmjax.cosine(deltas) == pytest.approx(numpy_cosine(deltas), abs=1e-5)


def test_cosine_edge_cases():
  one = {"a": jnp.ones(3)}
  assert gmjax.cosine([]) is None and gmjax.cosine([one]) is None
  assert gmjax.cosine([one, one]) == pytest.approx(1.0)
  assert gmjax.cosine([one, {"a": -jnp.ones(3)}]) == pytest.approx(-1.0)
  zero = {"a": jnp.zeros(3)}
  assert gmjax.cosine([one, zero]) is None
  assert gmjax.cosine([one, zero, one]) == pytest.approx(1.0)


@pytest.mark.parametrize("axis, batch", [(0, None), (1, None), (2, 0), (0, 2), (1, 2)])
def test_gram_matches_numpy_with_the_learners_and_the_batch_anywhere(axis, batch):
  # gmjax.core.round.gram reduces the pairwise products (no dot_general); the batch
  # dimension, contracted last, may come before or after the learners'.
  from gmjax.core import round as round_ops
  x = np.random.default_rng(axis).standard_normal((3, 4, 5)).astype(np.float32)
  rows = np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1).astype(np.float64)
  got = np.asarray(round_ops.gram([jnp.asarray(x), jnp.asarray(2 * x)], axis, batch))
  np.testing.assert_allclose(got, 5 * rows @ rows.T, rtol=1e-5, atol=1e-5)
