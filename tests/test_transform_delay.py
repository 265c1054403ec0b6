"""``gmjax.diloco`` with ``outer_delay=1`` and ``eager``: the numpy loop's histories.

The loop (``transform_reference``) is written from Kale et al.'s algorithms: eager
learners each run their own outer optimizer on the paper's mixture of their fresh delta
and the others' stale ones; the transformation splits that into the shared Θ and a
learner-local correction (``gmjax.core.eager``), which must give the same parameters.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax
import transform_harness as harness
import transform_reference as reference

STEPS = 14

# (learners, fragments, eager, shard_outer, delta_precision, error_feedback, tokens)
CASES = [
    (3, 1, False, True, None, None, False),
    (3, 2, False, False, "I4", None, True),
    (1, 1, False, False, None, None, False),
    (1, 2, False, True, "F8_E4M3", None, False),
    (3, 1, True, False, None, None, True),
    (3, 2, True, True, None, None, False),
    (3, 2, True, False, "I4", 1.0, False),
    (3, 1, True, True, "I2", 1.0, True),
    (1, 1, True, True, None, None, False),
    (1, 2, True, False, "F8_E4M3", None, False),
]


def _setup(learners, fragments, eager, precision=None, beta=None, tokens=False, **more):
  return harness.make_setup(learners=learners, fragments=fragments, outer_delay=1,
                            eager=eager, delta_precision=precision, error_feedback=beta,
                            tokens=tokens, steps=STEPS, **more)


def _history(setup, shard_outer):
  """θ of every learner after each step, in-mesh under vmap."""
  optimizer = gmjax.diloco(optax.sgd(setup.lr), harness.config_of(setup),
                           axis_name="learner", shard_outer=shard_outer)
  params = harness.stacked(setup)
  targets = harness.stacked(setup, "targets")
  curvature = jnp.asarray(setup.curvature, jnp.float32)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(harness.learner_step(optimizer, setup.tokens is not None),
                          axis_name="learner"))
  history = []
  for t in range(STEPS):
    params, state = jax.block_until_ready(
        step(params, state, targets, curvature, harness.tokens_at(setup, t)))
    history.append({n: np.asarray(v) for n, v in params.items()})
  return history, state, step


@pytest.mark.parametrize("learners,fragments,eager,shard,precision,beta,tokens", CASES)
def test_parameter_histories_match_numpy(learners, fragments, eager, shard, precision,
                                          beta, tokens):
  setup = _setup(learners, fragments, eager, precision, beta, tokens)
  assert harness.config_of(setup).plan(gmjax.Schema.from_tree(setup.theta0[0])) == tuple(
      tuple(f) for f in setup.plan)
  history, state, step = _history(setup, shard)
  for t in range(1, STEPS + 1):
    expected = reference.run(setup, t)
    for m in range(learners):
      harness.assert_tree_close({n: v[m] for n, v in history[t - 1].items()},
                                expected["theta"][m], what=f"step {t} learner {m} θ")
  final = reference.run(setup, STEPS)
  harness.assert_tree_close({n: np.asarray(v)[0] for n, v in state.anchor.items()},
                            final["anchor"], what="anchor")
  for m in range(learners):
    harness.assert_tree_close({n: np.asarray(v)[m] for n, v in state.delay.start.items()},
                              final["begin"][m], what=f"learner {m} start")
  assert step._cache_size() == 1
  assert int(np.asarray(state.stats.rounds)[0]) == len(final["log"])
  # The delay changes the run: neither DiLoCo nor the other variant ends here; except
  # that one eager learner is DiLoCo itself (its fresh delta is the whole aggregate:
  # g̃ = g_{k−1} − Δ_{k−1} + Δ_k = Δ_k).
  for other in (dict(outer_delay=0, eager=False), dict(eager=not eager)):
    plain = reference.run(dataclasses.replace(setup, **other), STEPS)
    same = all(np.allclose(final["theta"][0][n], plain["theta"][0][n], rtol=1e-4,
                           atol=1e-5) for n in harness.SHAPES)
    assert same == (eager and learners == 1 and other.get("outer_delay") == 0), other


@pytest.mark.parametrize("commit_precision", ["I4", "F16"])
def test_eager_learners_start_from_the_committed_theta(commit_precision):
  # With lossy commits an eager learner's start is the committed Θ plus its correction,
  # not an F32 copy of its own: the commit's rounding is in it (0.14 apart at I4, 2e-3 at
  # F16, from learners that each kept an F32 copy).
  setup = _setup(3, 2, True, "F8_E4M3", commit_precision=commit_precision)
  history, _, _ = _history(setup, True)
  expected = reference.run(setup, STEPS)
  for m in range(3):
    harness.assert_tree_close({n: v[m] for n, v in history[-1].items()},
                              expected["theta"][m], what=f"learner {m} θ")


@pytest.mark.parametrize("eager", [False, True])
def test_one_learner_without_axis_matches_numpy(eager):
  setup = _setup(1, 2, eager)
  params, state, step = harness.run_single(setup, STEPS)
  expected = reference.run(setup, STEPS)
  harness.assert_tree_close({n: np.asarray(v) for n, v in params.items()},
                            expected["theta"][0], what="θ")
  assert step._cache_size() == 1


def test_state_holds_what_the_delay_needs():
  setup = _setup(3, 2, True)
  _, state, _ = _history(setup, True)
  delay = state.delay
  for tree in (delay.start, delay.correction, delay.previous):
    for name, leaf in tree.items():
      assert leaf.dtype == jnp.float32 and leaf.shape == (3, *harness.SHAPES[name])
  assert delay.weight.shape == (3, 2)
  # Every learner had weight 1/3 in the last rounds (equal tokens, nothing rejected).
  np.testing.assert_allclose(np.asarray(delay.weight), 1 / 3, rtol=1e-6)
  plain = _history(_setup(3, 2, False), True)[1]
  assert isinstance(plain.delay.correction, optax.MaskedNode)
  off = _history(dataclasses.replace(_setup(3, 2, False), outer_delay=0), True)[1]
  assert isinstance(off.delay, optax.MaskedNode)


@pytest.mark.parametrize("settings,message", [
    (dict(eager=True), "eager=True needs outer_delay=1"),
    (dict(outer_delay=2), "outer_delay must be 0"),
    (dict(outer_delay=True), "outer_delay must be 0"),
    (dict(outer_delay=1, overlap_steps=1), "needs overlap_steps=0"),
    (dict(outer_delay=1, overlap_steps=None), "needs overlap_steps=0"),
    (dict(outer_delay=1, mixing=0.5),
     "needs mixing=0, got mixing=0.5; set mixing=0 or outer_delay=0"),
    (dict(outer_delay=1, eager=True, outer="adam"), "outer='sgd' at a constant"),
    (dict(outer_delay=1, eager=True,
          outer_options={"learning_rate": {"schedule": "constant_schedule", "value": 0.7}}),
     "outer='sgd' at a constant"),
    (dict(outer_delay=1, eager=1), "eager must be a bool"),
])
def test_bad_settings_are_refused(settings, message):
  with pytest.raises(ValueError, match=message):
    gmjax.DiLoCo(sync_every=4, **settings)


def test_eager_with_a_given_outer_is_refused():
  config = gmjax.DiLoCo(sync_every=4, outer_delay=1, eager=True)
  with pytest.raises(ValueError, match="leave outer=None"):
    gmjax.diloco(optax.sgd(0.1), config, outer=optax.sgd(0.7), axis_name="learner")


def test_configuration_round_trips_and_defaults_read_as_before():
  config = gmjax.DiLoCo(sync_every=4, outer_delay=1, eager=True)
  assert gmjax.DiLoCo.from_json(config.to_json()) == config
  plain = gmjax.DiLoCo(sync_every=4).to_json()
  assert "outer_delay" not in plain and "eager" not in plain
