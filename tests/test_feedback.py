"""``gmjax.core.feedback``: the residual a mail learner keeps, against a numpy codec."""

import jax.numpy as jnp
import numpy as np
import pytest

import gmjax
from gmjax.core import feedback
from gmjax.core.wire import Wire

import transform_reference as reference

SHAPES = {"a": (8,), "b": (4, 3), "c": (70,)}
SCHEMA = gmjax.Schema.from_tree({n: np.zeros(s, np.float32) for n, s in SHAPES.items()})


def _deltas(rounds, seed=0):
  rng = np.random.default_rng(seed)
  return [{n: (rng.standard_normal(s) * rng.choice([0.01, 1.0], s)).astype(np.float32)
           for n, s in SHAPES.items()} for _ in range(rounds)]


@pytest.mark.parametrize("precision", ["I4", "F4", "F8_E4M3", "BF16"])
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_residual_follows_the_formula(precision, beta):
  residual = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
  expected = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
  for delta in _deltas(5):
    entries, sent_back, residual = feedback.encode(
        residual, {n: jnp.asarray(v) for n, v in delta.items()}, beta, SCHEMA, Wire(precision))
    sent = {n: (np.float32(beta) * expected[n] + delta[n]).astype(np.float32)
            for n in SHAPES}
    decoded = gmjax.decode(entries, SCHEMA, precision)
    for n in SHAPES:
      # The entries are encode(β·e + Δ) (as the numpy codec reads it) ...
      np.testing.assert_allclose(decoded[n], reference.wire(sent[n], precision),
                                 rtol=1e-6, atol=1e-7, err_msg=n)
      expected[n] = (sent[n] - reference.wire(sent[n], precision)).astype(np.float32)
      # ... and the residual is what their decode left out.
      np.testing.assert_array_equal(residual[n], sent[n] - np.asarray(decoded[n]))
      # The decoded values it returns are the entries' own.
      np.testing.assert_array_equal(np.asarray(sent_back[n]), np.asarray(decoded[n]))
      np.testing.assert_allclose(residual[n], expected[n], rtol=1e-5, atol=1e-7, err_msg=n)
      assert residual[n].dtype == np.float32
  assert any(np.abs(residual[n]).max() > 0 for n in SHAPES)


def test_mean_decoded_delta_tracks_the_true_mean():
  # β = 1: Σ_t decode(q_t) = Σ_t Δ_t − e_T, so the mean decoded delta's error is ‖e_T‖/T,
  # while without feedback each round's quantization error stays in the mean.
  rounds = 64
  deltas = _deltas(rounds, seed=3)
  true = {n: np.mean([d[n] for d in deltas], axis=0) for n in SHAPES}
  residual = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
  fed = {n: np.zeros(s, np.float64) for n, s in SHAPES.items()}
  plain = {n: np.zeros(s, np.float64) for n, s in SHAPES.items()}
  for delta in deltas:
    entries, _, residual = feedback.encode(residual, delta, 1.0, SCHEMA, Wire("I4"))
    once = gmjax.decode(gmjax.encode(delta, "I4"), SCHEMA, "I4")
    for n, v in gmjax.decode(entries, SCHEMA, "I4").items():
      fed[n] += np.asarray(v) / rounds
      plain[n] += np.asarray(once[n]) / rounds
  error = lambda mean: np.sqrt(sum(np.sum((mean[n] - true[n]) ** 2) for n in SHAPES))
  for n in SHAPES:
    np.testing.assert_allclose(fed[n], true[n] - residual[n] / rounds, rtol=1e-4, atol=1e-6)
  assert error(fed) < 0.2 * error(plain)


def test_non_finite_values_are_not_sent():
  residual = {n: np.full(s, 0.5, np.float32) for n, s in SHAPES.items()}
  delta = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
  delta["b"][1, 2] = np.nan
  with pytest.raises(ValueError, match="cannot encode leaf 'b'"):
    feedback.encode(residual, delta, 1.0, SCHEMA, Wire("I4"))
