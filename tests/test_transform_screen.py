"""In-mesh, a round's deltas are screened by the mail closer's rules before they are summed.

A delta with a NaN or Inf value, or whose norm is more than ``OUTLIER_FACTOR`` times the
lower median of the learners' finite norms (its own included), is left out of the sum (the others' token weights
renormalized) and counted in ``stats.rejected``; outlying token counts are clamped and
counted in ``stats.clamped``. The numpy reference loop applies the same rules, written
from their definition.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax

import transform_harness as harness
import transform_reference as reference

STEPS = 13


def _poisoned(kind, learners, precision, fragments=3):
  setup = harness.make_setup(learners=learners, fragments=fragments, steps=STEPS,
                             tokens=kind == "tokens", delta_precision=precision)
  bad = 1
  if kind == "overflow":  # F16 deltas of ~4e5 overflow on the wire: Inf
    setup.targets[bad] = {n: v * np.float32(1e6) for n, v in setup.targets[bad].items()}
  elif kind == "nan":
    setup.targets[bad] = {n: np.full_like(v, np.nan) for n, v in setup.targets[bad].items()}
  elif kind == "outlier":  # finite, about a thousand times the others' norm
    setup.targets[bad] = {n: v * np.float32(1e3) for n, v in setup.targets[bad].items()}
  elif kind == "tokens":
    setup.tokens[:, bad] *= 1000
  return setup, bad


CASES = [  # kind, learners, delta_precision, shard_outer
    ("overflow", 3, "F16", True),
    ("overflow", 3, "F16", False),
    ("nan", 3, "I4", True),
    ("nan", 4, "F8_E4M3", False),
    ("outlier", 4, None, True),
    ("outlier", 3, None, False),
    ("outlier", 2, "BF16", True),
    ("tokens", 3, None, True),
    ("tokens", 4, "I4", False),
]


@pytest.mark.parametrize("kind,learners,precision,shard_outer", CASES)
def test_screened_round_matches_the_reference(kind, learners, precision, shard_outer):
  setup, bad = _poisoned(kind, learners, precision)
  expected = reference.run(setup, STEPS)
  params, state, step = harness.run_vmap(setup, STEPS, shard_outer=shard_outer)
  log = expected["log"]
  assert {entry["finite"] for entry in log} == {True}
  if kind == "tokens":
    assert [entry["clamped"] for entry in log] == [1] * len(log)
    assert [entry["rejected"] for entry in log] == [0] * len(log)
  else:  # of two, the larger is judged by the smaller, which is no outlier
    assert [entry["rejected"] for entry in log] == [1] * len(log)
  honest = [m for m in range(learners) if kind == "tokens" or m != bad]
  for m in honest:
    harness.assert_tree_close({n: v[m] for n, v in params.items()}, expected["theta"][m],
                              what=f"learner {m} θ")
  harness.assert_tree_close({n: v[0] for n, v in state.anchor.items()}, expected["anchor"],
                            what="anchor")
  stats = jax.tree.map(lambda x: np.asarray(x)[0], state.stats)
  assert int(stats.rounds) == len(log)
  assert int(stats.rejected) == log[-1]["rejected"]
  assert int(stats.clamped) == log[-1]["clamped"]
  assert int(stats.skipped) == 0
  np.testing.assert_allclose(stats.delta_norm, log[-1]["delta_norm"], rtol=1e-5)
  np.testing.assert_allclose(stats.cosine, log[-1]["cosine"], atol=1e-5, equal_nan=True)
  assert step._cache_size() == 1


@pytest.mark.parametrize("shard_outer", [True, False])
@pytest.mark.parametrize("tokens", [(0, 0, 0, 7), (0, 0, 0, 0)])
def test_kept_deltas_without_tokens_weigh_equally_among_themselves(shard_outer, tokens):
  # Learner 3's delta is rejected (a NaN); the other three counted no tokens, so each
  # weighs 1/3, as by mail. In-mesh each weighed 1/4 (every learner on the axis): g was
  # 3/4 of the mean.
  config = gmjax.DiLoCo(sync_every=1, outer_learning_rate=1.0, outer_momentum=0.0)
  optimizer = gmjax.diloco(optax.sgd(1.0), config, axis_name="learner",
                           shard_outer=shard_outer)

  def step(params, state, grads, count):
    updates, state = optimizer.update(grads, state, params, tokens=count)
    return optax.apply_updates(params, updates), state

  params = {"w": jnp.ones((4, 4))}
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  grads = {"w": jnp.asarray([[1.0] * 4] * 3 + [[jnp.nan] * 4])}
  params, state = jax.jit(jax.vmap(step, axis_name="learner"))(
      params, state, grads, jnp.asarray(tokens, jnp.float32))
  # Every kept delta is 1 (θ = 1 − 1·1 = 0 against the anchor 1): g = 1, Θ = 1 − 1 = 0.
  np.testing.assert_array_equal(np.asarray(state.anchor["w"]), 0.0)
  assert state.stats.rejected.tolist() == [1] * 4
  np.testing.assert_allclose(np.asarray(state.stats.delta_norm), 2.0)


@pytest.mark.parametrize("kind,learners,precision,shard_outer", [
    ("outlier", 4, None, True), ("outlier", 3, "BF16", False), ("tokens", 3, None, True)])
def test_without_outlier_screening_every_finite_delta_counts(kind, learners, precision,
                                                              shard_outer):
  # outlier_factor=None: DiLoCo exactly, only non-finite deltas rejected.
  setup, _ = _poisoned(kind, learners, precision)
  setup.outlier_factor = None
  expected = reference.run(setup, STEPS)
  assert {(e["rejected"], e["clamped"]) for e in expected["log"]} == {(0, 0)}
  params, state, _ = harness.run_vmap(setup, STEPS, shard_outer=shard_outer)
  for m in range(learners):
    harness.assert_tree_close({n: v[m] for n, v in params.items()}, expected["theta"][m],
                              what=f"learner {m} θ")
  harness.assert_tree_close({n: v[0] for n, v in state.anchor.items()}, expected["anchor"],
                            what="anchor")
  assert state.stats.rejected.tolist() == [0] * learners
  assert state.stats.clamped.tolist() == [0] * learners


@pytest.mark.parametrize("outlier_factor,rejected", [(10.0, 1), (None, 0)])
def test_two_honest_learners_ten_times_apart(outlier_factor, rejected):
  # Of two learners, the larger of two honest deltas 10x apart was always rejected: Θ
  # followed the other learner alone. outlier_factor=None keeps both, as DiLoCo does.
  config = gmjax.DiLoCo(sync_every=4, outlier_factor=outlier_factor)
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="l")

  def step(params, state, target):
    grads = jax.grad(lambda p: jnp.sum((p["w"] - target) ** 2))(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(step, axis_name="l"))
  params = {"w": jnp.zeros(2)}
  state = jax.vmap(optimizer.init, axis_name="l")(params)
  for _ in range(40):
    params, state = step(params, state, jnp.array([0.05, 1.0]))
  theta = float(gmjax.finish(state, params, learner_axis=0)["w"])
  assert state.stats.rejected.tolist() == [rejected] * 2
  assert (0.04 < theta < 0.06) if rejected else (0.45 < theta < 0.55), theta


@pytest.mark.parametrize("aggregation,moved", [("mean", True), ("clipped_mean", False),
                                               ("trimmed_mean", False)])
def test_a_large_delta_beside_zero_deltas_is_bounded_by_the_robust_rules(aggregation, moved):
  # Three learners' deltas exactly zero (a frozen part, or learners that sent nothing):
  # zeros are no reference, so the screening does not judge the fourth's 1e6 a value;
  # the mean takes it (as the README says), the robust rules do not.
  config = gmjax.DiLoCo(sync_every=2, overlap_steps=0, aggregation=aggregation)
  optimizer = gmjax.diloco(optax.sgd(1.0), config, axis_name="l")

  def step(params, state, grads):
    updates, state = optimizer.update({"w": grads}, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(step, axis_name="l"))
  params = {"w": jnp.zeros((4, 3))}
  state = jax.vmap(optimizer.init, axis_name="l")(params)
  grads = jnp.zeros((4, 3)).at[3].set(-1e6)
  for _ in range(2):
    params, state = step(params, state, grads)
  assert state.stats.rejected.tolist() == [0] * 4
  assert (np.abs(np.asarray(state.anchor["w"])).max() > 1e5) == moved


def test_token_caps_are_the_same_in_mesh_and_by_mail_for_any_factor():
  # With a factor F32 cannot hold (1.3, 4.1) the mail closer's float64 cap and the
  # in-mesh F32 one differed by one token at the boundary: learner 2 below was clamped
  # to 114295 in-mesh and kept at 114296 by mail.
  from gmjax.mail import watch  # pylint: disable=g-import-not-at-top
  from gmjax.transform import screen, tokens as token_counts  # pylint: disable=g-import-not-at-top

  low = token_counts.LOW_BITS
  judge = jax.jit(screen.judge, static_argnums=3)
  rng = np.random.default_rng(0)
  # A cap past F32's range clamps nothing in-mesh; by mail it raised OverflowError and
  # stopped the round's close (outlier_factor=1e30, 10**9 tokens a step).
  cases = [(1.3, 40, [87920, 88000, 114296]), (1e30, 2, [2 * 10**9] * 3),
           (1e35, 2, [2 * 10**4, 2 * 10**4, 4 * 10**4])]
  for factor in (1.3, 2.9, 4.1, 10.0):
    for _ in range(40):
      steps = int(rng.integers(1, 50))
      base = int(rng.integers(1, 3000)) * steps
      cases.append((factor, steps, [base, base + int(rng.integers(0, 3)) * steps,
                                    int(round(base * factor)) + int(rng.integers(-3, 4))]))
  for factor, steps, tokens in cases:
    counts = jnp.asarray([[t >> low, t & ((1 << low) - 1)] for t in tokens], jnp.int32)
    verdict = judge(jnp.ones(3), jnp.zeros(3, jnp.int32), counts, factor)
    caps = watch.token_caps(tokens, [steps] * 3, factor)
    used = [t if c is None else min(t, c) for t, c in zip(tokens, caps)]
    clamped = sum(c is not None and t > c for t, c in zip(tokens, caps))
    assert int(verdict.clamped) == clamped, (factor, steps, tokens)
    np.testing.assert_allclose(np.asarray(verdict.weights), np.asarray(used) / sum(used),
                               rtol=1e-6, err_msg=str((factor, steps, tokens)))
