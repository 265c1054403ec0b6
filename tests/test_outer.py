"""close_round against a plain numpy outer step; the commit update rebuilds Θ exactly."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gmjax
from gmjax.core import outer
from gmjax.core import round as round_ops
from gmjax.core.aggregator import DiLoCoAggregator
from gmjax.core.codec import to_numpy
from gmjax.core.schema import NUMPY_DTYPES, master_name, momentum_name
from gmjax.core.wire import Wire

LR, MU = 0.7, 0.9


def make(dtype="F32", **config):
  rng = np.random.default_rng(0)
  tree = {"w": rng.standard_normal((4, 9)).astype(np.float32),
          "b": rng.standard_normal(5).astype(np.float32)}
  tree = {k: v.astype(NUMPY_DTYPES[dtype]) for k, v in tree.items()}
  schema = gmjax.Schema.from_tree(tree)
  algorithm = gmjax.DiLoCo(sync_every=4, **config)
  aggregator = DiLoCoAggregator(algorithm, schema)
  return algorithm, schema, aggregator, aggregator.initial_state(tree)


def contribution(schema, name, delta, tokens, precision):
  entries = to_numpy(Wire(precision).encode(delta, schema),
                     gmjax.layout(schema, precision))
  return gmjax.Contribution(name, 4, 4, tokens, 0.1, False, entries)


def numpy_step(master, momentum, gradient, nesterov):
  momentum = MU * momentum + gradient
  step = gradient + MU * momentum if nesterov else momentum
  return master - LR * step, momentum


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("tokens", [(30, 10, 60), (0, 0, 0)])
def test_close_round_matches_numpy(nesterov, tokens):
  algorithm, schema, aggregator, state = make(nesterov=nesterov)
  rng = np.random.default_rng(1)
  master = {k: np.asarray(v, np.float32) for k, v in state.theta.items()}
  momentum = {k: np.zeros_like(v) for k, v in master.items()}
  for round_ in range(3):
    deltas = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in master.items()}
              for _ in tokens]
    names = ["c", "a", "b"]  # summed in sorted learner order
    contributions = [contribution(schema, n, d, t, None)
                     for n, d, t in zip(names, deltas, tokens)]
    result = aggregator.close_round(state, contributions)
    total = sum(tokens)
    weights = {n: (t / total if total else 1 / len(tokens)) for n, t in zip(names, tokens)}
    assert [p.learner for p in result.participants] == ["a", "b", "c"]
    for p in result.participants:
      assert p.weight == pytest.approx(weights[p.learner])
    order = sorted(range(3), key=lambda i: names[i])
    for k in master:
      gradient = np.zeros_like(master[k])
      for i in order:
        gradient = gradient + np.float32(weights[names[i]]) * deltas[i][k]
      master[k], momentum[k] = numpy_step(master[k], momentum[k], gradient, nesterov)
      np.testing.assert_allclose(result.state.theta[k], master[k], rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(result.state.outer[momentum_name(k)], momentum[k],
                                 rtol=1e-6, atol=1e-6)
      assert master_name(k) not in result.state.outer  # F32 Θ is the master
    assert result.state.version == round_ + 1 and result.update is None
    assert -1 <= result.cosine <= 1
    state = result.state


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_low_precision_keeps_exact_master(dtype):
  algorithm, schema, aggregator, state = make(dtype)
  master = {k: np.asarray(state.outer[master_name(k)]) for k in schema.names}
  for k in schema.names:
    np.testing.assert_array_equal(master[k], state.theta[k].astype(np.float32))
  momentum = {k: np.zeros_like(v) for k, v in master.items()}
  rng = np.random.default_rng(2)
  for _ in range(3):
    delta = {k: (rng.standard_normal(v.shape) * 1e-3).astype(np.float32)
             for k, v in master.items()}
    result = aggregator.close_round(state, [contribution(schema, "a", delta, 1, "F32")])
    for k in schema.names:
      master[k], momentum[k] = numpy_step(master[k], momentum[k], delta[k], True)
      np.testing.assert_allclose(result.state.outer[master_name(k)], master[k], rtol=1e-6)
      assert result.state.theta[k].dtype == NUMPY_DTYPES[dtype]
      np.testing.assert_array_equal(
          result.state.theta[k], result.state.outer[master_name(k)].astype(NUMPY_DTYPES[dtype])
      )
    state = result.state


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
@pytest.mark.parametrize("commit", ["BF16", "F8_E4M3", "I4"])
def test_commit_update_rebuilds_theta_bit_identically(dtype, commit):
  algorithm, schema, aggregator, state = make(dtype, commit_precision=commit,
                                              delta_precision="F8_E4M3")
  learner_theta = dict(state.theta)
  rng = np.random.default_rng(3)
  master = {k: np.asarray(state.outer[master_name(k)]) for k in schema.names}
  momentum = {k: np.zeros_like(v) for k, v in master.items()}
  for _ in range(12):
    deltas = [{k: (rng.standard_normal(v.shape) * 1e-2).astype(np.float32)
               for k, v in master.items()} for _ in range(2)]
    contributions = [contribution(schema, n, d, 5, "F8_E4M3") for n, d in zip("ab", deltas)]
    result = aggregator.close_round(state, contributions)
    assert sorted(result.update) == sorted(gmjax.layout(schema, commit).names)
    rebuilt = outer.rebuild_jit(
        {k: jnp.asarray(v) for k, v in learner_theta.items()},
        {k: jnp.asarray(v) for k, v in result.update.items()},
        schema.parameters, Wire(commit))
    for k in schema.names:
      got = np.asarray(rebuilt[k])
      assert got.dtype == result.state.theta[k].dtype
      assert got.tobytes() == result.state.theta[k].tobytes()
    learner_theta = {k: np.asarray(v) for k, v in rebuilt.items()}
    # The master follows the decoded deltas exactly, whatever the update's error.
    for k in schema.names:
      decoded = [np.asarray(gmjax.decode(c.tensors, schema, "F8_E4M3")[k]) for c in contributions]
      gradient = np.float32(0.5) * decoded[0] + np.float32(0.5) * decoded[1]
      master[k], momentum[k] = numpy_step(master[k], momentum[k], gradient, True)
      np.testing.assert_allclose(result.state.outer[master_name(k)], master[k],
                                 rtol=1e-5, atol=1e-6)
    state = result.state
  # Error of Θ stays within one update's quantization of the master; it does not grow.
  for k in schema.names:
    gap = np.abs(state.theta[k].astype(np.float32) - master[k])
    scale = np.abs(master[k] - 0).max()
    assert gap.max() <= 0.2 * scale + 1e-2, (k, gap.max())


def test_no_contributions_keeps_state():
  algorithm, schema, aggregator, state = make(commit_precision="F4")
  result = aggregator.close_round(state, [])
  assert result.state.version == 1 and result.participants == () and result.cosine is None
  for k in schema.names:
    np.testing.assert_array_equal(result.state.theta[k], state.theta[k])
    assert not np.any(result.update[k]) and not np.any(result.update[k + ".scale"])


def test_duplicate_learner_rejected():
  algorithm, schema, aggregator, state = make()
  delta = {k: np.zeros(s.shape, np.float32) for k, s in zip(schema.names, schema)}
  c = contribution(schema, "a", delta, 1, None)
  with pytest.raises(ValueError):
    aggregator.close_round(state, [c, c])


def test_align():
  theta = {"w": jnp.array([1.0, 2.0], jnp.bfloat16)}
  anchor = {"w": jnp.array([3.0, 4.0], jnp.float32)}
  assert outer.align(theta, anchor, 0.0)["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(outer.align(theta, anchor, 0.0)["w"], np.float32),
                                [3.0, 4.0])
  np.testing.assert_allclose(np.asarray(outer.align(theta, anchor, 0.5)["w"], np.float32),
                             [2.0, 3.0])


def numpy_adam(master, mu, nu, count, gradient, lr, b1=0.9, b2=0.999, eps=1e-8):
  """Adam (Kingma & Ba) in float64, as a gradient step: bias-corrected moments."""
  g = gradient.astype(np.float64)
  mu = b1 * mu + (1 - b1) * g
  nu = b2 * nu + (1 - b2) * g * g
  count += 1
  step = (mu / (1 - b1**count)) / (np.sqrt(nu / (1 - b2**count)) + eps)
  return master - lr * step, mu, nu, count


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_close_round_adam_matches_numpy(dtype):
  lr, b1 = 0.05, 0.8
  algorithm, schema, aggregator, state = make(
      dtype, outer="adam", outer_options={"learning_rate": lr, "b1": b1})
  assert sorted(state.outer) == sorted(
      ["outer.0.count"] + [f"outer.0.{m}.{k}" for m in ("mu", "nu") for k in schema.names]
      + ([master_name(k) for k in schema.names] if dtype != "F32" else []))
  assert state.outer["outer.0.count"] == 0 and state.outer["outer.0.count"].dtype == np.int32
  master = {k: state.theta[k].astype(np.float64) for k in schema.names}
  mu = {k: np.zeros(v.shape) for k, v in master.items()}
  nu = {k: np.zeros(v.shape) for k, v in master.items()}
  count = 0
  rng = np.random.default_rng(4)
  for round_ in range(5):
    deltas = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in master.items()}
              for _ in range(2)]
    tokens = (3, 1)
    result = aggregator.close_round(
        state, [contribution(schema, n, d, t, "F32") for n, d, t in zip("ab", deltas, tokens)])
    step_count = count
    for k in schema.names:
      gradient = np.float32(0.75) * deltas[0][k] + np.float32(0.25) * deltas[1][k]
      master[k], mu[k], nu[k], count = numpy_adam(master[k], mu[k], nu[k], step_count,
                                                  gradient, lr, b1=b1)
      got = result.state.outer.get(master_name(k), result.state.theta[k])
      np.testing.assert_allclose(got, master[k], rtol=1e-5, atol=1e-5, err_msg=k)
      np.testing.assert_allclose(result.state.outer[f"outer.0.mu.{k}"], mu[k], rtol=1e-5,
                                 atol=1e-7)
      np.testing.assert_allclose(result.state.outer[f"outer.0.nu.{k}"], nu[k], rtol=1e-5,
                                 atol=1e-9)
      assert momentum_name(k) not in result.state.outer
    assert int(result.state.outer["outer.0.count"]) == round_ + 1
    state = result.state


def test_close_round_schedule_counts_outer_steps():
  # Plain momentum with a learning rate that halves every outer step of the fragment.
  options = {"learning_rate": {"schedule": "exponential_decay", "init_value": 0.8,
                               "transition_steps": 1, "decay_rate": 0.5},
             "nesterov": False}
  algorithm, schema, aggregator, state = make(outer_options=options)
  assert sorted(state.outer) == sorted(
      ["outer.1.count"] + [momentum_name(k) for k in schema.names])
  master = {k: np.asarray(v, np.float64) for k, v in state.theta.items()}
  momentum = {k: np.zeros(v.shape) for k, v in master.items()}
  rng = np.random.default_rng(5)
  for round_ in range(4):
    delta = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in master.items()}
    result = aggregator.close_round(state, [contribution(schema, "a", delta, 1, None)])
    lr = 0.8 * 0.5**round_
    for k in schema.names:
      momentum[k] = MU * momentum[k] + delta[k]
      master[k] = master[k] - lr * momentum[k]
      np.testing.assert_allclose(result.state.theta[k], master[k], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(result.state.outer[momentum_name(k)], momentum[k],
                                 rtol=1e-5, atol=1e-6)
    assert int(result.state.outer["outer.1.count"]) == round_ + 1
    state = result.state


def test_close_round_default_is_bit_identical_to_the_formula():
  algorithm, schema, aggregator, state = make()
  momentum = {k: jnp.zeros(v.shape, jnp.float32) for k, v in state.theta.items()}
  master = {k: jnp.asarray(v) for k, v in state.theta.items()}
  formula = jax.jit(functools.partial(outer.outer_step, learning_rate=LR, momentum_coef=MU,
                                      nesterov=True))
  rng = np.random.default_rng(6)
  for _ in range(3):
    deltas = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in master.items()}
              for _ in range(3)]
    result = aggregator.close_round(
        state, [contribution(schema, n, d, t, None) for n, d, t in zip("abc", deltas, (5, 2, 9))])
    weights = [np.float32(t / 16) for t in (5, 2, 9)]
    gradient = jax.jit(round_ops.tree_weighted_sum)(deltas, weights)
    master, momentum = formula(gradient, momentum, master)
    for k in schema.names:
      assert result.state.theta[k].tobytes() == np.asarray(master[k]).tobytes()
      assert result.state.outer[momentum_name(k)].tobytes() == np.asarray(momentum[k]).tobytes()
    state = result.state


def test_token_counts_exact_past_two_to_the_24():
  algorithm, schema, aggregator, state = make()
  big = 2**24
  delta = {k: np.ones(s.shape, np.float32) for k, s in zip(schema.names, schema)}
  result = aggregator.close_round(state, [contribution(schema, "a", delta, big + 1, None),
                                          contribution(schema, "b", delta, big, None)])
  a, b = result.participants
  assert (a.tokens, b.tokens) == (big + 1, big)  # not rounded to F32 (both 2**24 there)
  assert a.weight == (big + 1) / (2 * big + 1) and b.weight == big / (2 * big + 1)
  assert a.weight > b.weight


def test_close_round_compiles_once_per_shape():
  from gmjax.core import aggregator as aggregator_lib
  algorithm, schema, aggregator, state = make(outer="adam")
  rng = np.random.default_rng(7)

  def close(aggregator, state):
    deltas = [{k: rng.standard_normal(v.shape).astype(np.float32)
               for k, v in state.theta.items()} for _ in range(2)]
    return aggregator.close_round(
        state, [contribution(schema, n, d, 1, None) for n, d in zip("ab", deltas)]).state

  state = close(aggregator, state)
  compiled = aggregator_lib._close._cache_size()
  state = close(aggregator, state)
  # An equal configuration (another closer) builds the same transformation.
  close(DiLoCoAggregator(gmjax.DiLoCo(sync_every=4, outer="adam"), schema), state)
  assert aggregator_lib._close._cache_size() == compiled
