"""``gmjax.diloco`` with ``error_feedback``: the numpy loop's residuals and parameters."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import gmjax
import transform_harness as harness
import transform_reference as reference

STEPS = 13

# (learners, fragments, delta_precision, shard_outer, beta, mixing, overlap, tokens): a
# covering set of fragments {1, 3}, M {1, 3}, I4 / F8_E4M3 / BF16, both layouts and
# β {1, 0.5}. Leaves hold 8, 12 and 40 values: with M = 3 the shards are filled unequally.
CASES = [
    (3, 1, "I4", True, 1.0, 0.0, 0, False),
    (3, 3, "I4", False, 0.5, 0.5, 1, True),
    (1, 3, "I4", True, 0.5, 0.0, 2, False),
    (3, 3, "F8_E4M3", True, 1.0, 0.5, 2, True),
    (1, 1, "F8_E4M3", False, 1.0, 0.0, 0, True),
    (3, 1, "F8_E4M3", False, 0.5, 0.0, 1, False),
    (3, 3, "BF16", True, 0.5, 0.0, 0, True),
    (3, 1, "BF16", False, 1.0, 0.5, 1, False),
    (1, 1, "BF16", True, 0.5, 0.5, 0, False),
]


@pytest.mark.parametrize("precision,shard", [("I2", True), ("F32", False), ("I4", True)])
def test_top_k_deltas_with_error_feedback_match_numpy(precision, shard):
  # Sparse deltas drop most values at any precision (F32 included): the residual keeps
  # them for the next rounds.
  setup = harness.make_setup(learners=3, fragments=3, delta_precision=precision,
                             delta_topk=3, delta_chunk=8, error_feedback=1.0, steps=STEPS)
  params, state, step = harness.run_vmap(setup, STEPS, shard_outer=shard)
  _check(setup, params, state, 3, sharded=shard)
  assert step._cache_size() == 1


def _learner(tree, m, batched=True):
  return {n: np.asarray(v)[m] if batched else np.asarray(v) for n, v in tree.items()}


def _check(setup, params, state, learners, sharded, batched=True):
  expected = reference.run(setup, STEPS)
  for m in range(learners):
    harness.assert_tree_close(_learner(params, m, batched), expected["theta"][m],
                              what=f"learner {m} θ")
    harness.assert_tree_close(_learner(state.residual, m, batched), expected["residual"][m],
                              what=f"learner {m} residual")
  harness.assert_tree_close(_learner(state.anchor, 0, batched), expected["anchor"],
                            what="anchor")
  momentum = harness.outer_field(setup, state, "trace", sharded)
  harness.assert_tree_close(momentum, expected["momentum"], what="momentum")
  # The residuals are not trivially zero: the test would not see them otherwise.
  assert any(np.abs(e[n]).max() > 0 for e in expected["residual"] for n in e)
  assert int(np.asarray(state.stats.rounds).reshape(-1)[0]) == len(expected["log"])
  # Without the residual the run ends elsewhere: comparing against the loop tells them apart.
  plain = reference.run(dataclasses.replace(setup, error_feedback=None), STEPS)
  assert any(not np.allclose(expected["theta"][0][n], plain["theta"][0][n], rtol=1e-5,
                             atol=1e-6) for n in harness.SHAPES)


@pytest.mark.parametrize(
    "learners,fragments,precision,shard,beta,mixing,overlap,tokens", CASES)
def test_residuals_and_parameters_match_numpy(learners, fragments, precision, shard, beta,
                                               mixing, overlap, tokens):
  setup = harness.make_setup(learners=learners, fragments=fragments, mixing=mixing,
                             overlap=overlap, tokens=tokens, delta_precision=precision,
                             error_feedback=beta, steps=STEPS)
  params, state, step = harness.run_vmap(setup, STEPS, shard_outer=shard)
  _check(setup, params, state, learners, sharded=shard)
  assert step._cache_size() == 1  # one trace for all steps
  for name, leaf in state.residual.items():
    assert leaf.dtype == jnp.float32
    assert leaf.shape == (learners, *harness.SHAPES[name])  # whole leaves, per learner


@pytest.mark.parametrize("fragments", [1, 3])
def test_one_learner_without_axis_matches_numpy(fragments):
  setup = harness.make_setup(learners=1, fragments=fragments, delta_precision="I4",
                             error_feedback=1.0, overlap=1, steps=STEPS)
  params, state, step = harness.run_single(setup, STEPS)
  _check(setup, params, state, 1, sharded=False, batched=False)
  assert step._cache_size() == 1


def test_bf16_parameters_with_their_own_precision():
  # delta_precision=None sends bf16 deltas of bf16 parameters: lossy, so allowed.
  setup = harness.make_setup(fragments=3, overlap=1, steps=STEPS, error_feedback=1.0,
                             dtype=ml_dtypes.bfloat16)
  params, state, step = harness.run_vmap(setup, STEPS, dtype=jnp.bfloat16)
  assert step._cache_size() == 1
  for leaf in jax.tree.leaves(params):
    assert leaf.dtype == jnp.bfloat16
  for leaf in jax.tree.leaves(state.residual):
    assert leaf.dtype == jnp.float32
  expected = reference.run(setup, STEPS)
  largest = []
  for m in range(3):
    harness.assert_tree_close(_learner(params, m), expected["theta"][m], rtol=3e-2,
                              atol=3e-2, what=f"learner {m}")
    # bf16 training follows the loop only roughly, and a residual is a rounding error
    # of its deltas: at most half a bf16 ulp of what was encoded, which is below twice
    # the largest parameter (a delta of bf16 parameters, taken from the bf16 values the
    # learner holds, is often exact in bf16: a residual may be 0).
    for name, value in _learner(state.residual, m).items():
      scale = 2 * max(np.abs(np.asarray(expected["theta"][m][name], np.float32)).max(), 1.0)
      assert np.abs(value).max() <= 2.0**-8 * scale, (m, name, np.abs(value).max())
      largest.append(np.abs(value).max())
  assert max(largest) > 0  # the deltas were lossy, and their rounding kept


def test_off_adds_nothing_to_the_state():
  setup = harness.make_setup(fragments=3, delta_precision="I4", steps=STEPS)
  params, state, _ = harness.run_vmap(setup, 5)
  assert state.residual == optax.MaskedNode()
  on = harness.make_setup(fragments=3, delta_precision="I4", steps=STEPS, error_feedback=1.0)
  _, state_on, _ = harness.run_vmap(on, 5)
  # Everything else is the same pytree; the residuals are one F32 leaf per parameter.
  assert (jax.tree.structure(state_on._replace(residual=optax.MaskedNode()))
          == jax.tree.structure(state))
  assert len(jax.tree.leaves(state_on.residual)) == len(harness.SHAPES)
  del params


def test_lossless_deltas_are_refused():
  config = gmjax.DiLoCo(sync_every=4, error_feedback=1.0)  # precision known per leaf
  with pytest.raises(ValueError, match="error_feedback=1.0 with delta_precision=None"):
    gmjax.diloco(optax.sgd(0.1), config).init({"w": jnp.zeros(4)})
  mixed = {"w": jnp.zeros(4), "h": jnp.zeros(3, jnp.bfloat16)}  # the bf16 leaf is lossy
  gmjax.diloco(optax.sgd(0.1), config).init(mixed)


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "replicated"])
def test_error_feedback_makes_the_mean_decoded_delta_track_the_true_one(shard):
  # One learner with a constant gradient, plain outer SGD with η = 1 and mixing 0: every
  # round's true delta is the same Δ = H·lr·g, and the anchor moves by exactly the
  # decoded one. In each block of 32 one value is large and the rest fall below half an
  # I4 step (absmax/14): without error feedback they never travel, with it
  # (β = 1) the decoded deltas sum to the true ones up to the last residual.
  rounds, sync_every, lr = 24, 4, 0.25
  g = np.full(64, 0.03, np.float32)
  g[::32] = 1.0
  g[5::32] = -0.06
  true = sync_every * lr * g

  def travelled(beta):
    config = gmjax.DiLoCo(sync_every=sync_every, delta_precision="I4", outer_momentum=0.0,
                          outer_learning_rate=1.0, error_feedback=beta)
    optimizer = gmjax.diloco(optax.sgd(lr), config, axis_name="learner", shard_outer=shard)
    params = {"w": jnp.zeros((1, 64), jnp.float32)}
    state = jax.vmap(optimizer.init, axis_name="learner")(params)

    def one(params, state):
      updates, state = optimizer.update({"w": jnp.asarray(g)}, state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(jax.vmap(one, axis_name="learner"))
    for _ in range(rounds * sync_every):
      params, state = jax.block_until_ready(step(params, state))
    assert step._cache_size() == 1
    # Θ_T = Θ_0 − Σ_t decode(q_t): the mean decoded delta over the rounds.
    return -np.asarray(state.anchor["w"][0]) / rounds, state

  plain, _ = travelled(None)
  fed, state = travelled(1.0)
  error_plain = np.linalg.norm(plain - true)
  error_fed = np.linalg.norm(fed - true)
  # Without feedback the small values are lost in every round: a constant bias.
  np.testing.assert_allclose(plain[1:5], 0.0)
  assert error_plain > 0.5 * np.linalg.norm(true[true != true[0]])
  # With it the error is the last residual spread over the rounds: ‖e_T‖ / T.
  residual = np.asarray(state.residual["w"][0])
  np.testing.assert_allclose(fed, true - residual / rounds, rtol=1e-4, atol=1e-6)
  assert error_fed < 0.1 * error_plain


@pytest.mark.parametrize("kind,precision,shard", [("overflow", "F16", True),
                                                  ("nan", "I4", False)])
def test_a_value_that_cannot_travel_restarts_its_residual(kind, precision, shard):
  # Learner 1's deltas overflow F16 on the wire (or are NaN) in every round: screening
  # rejects them, and its residual is zeros again; the others' rounds go on.
  setup = harness.make_setup(learners=3, fragments=3, steps=STEPS, error_feedback=1.0,
                             delta_precision=precision)
  scale = np.float32(1e6) if kind == "overflow" else np.float32(np.nan)
  setup.targets[1] = {n: v * scale for n, v in setup.targets[1].items()}
  params, state, _ = harness.run_vmap(setup, STEPS, shard_outer=shard)
  expected = reference.run(setup, STEPS)
  assert [entry["rejected"] for entry in expected["log"]] == [1] * len(expected["log"])
  assert int(np.asarray(state.stats.rejected)[0]) == 1
  for name, value in state.residual.items():
    np.testing.assert_array_equal(np.asarray(value)[1], 0.0)
  for m in (0, 2):
    harness.assert_tree_close(_learner(params, m), expected["theta"][m], what=f"learner {m}")
    harness.assert_tree_close(_learner(state.residual, m), expected["residual"][m],
                              what=f"learner {m} residual")
  assert any(np.abs(np.asarray(v)[0]).max() > 0 for v in state.residual.values())
