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
