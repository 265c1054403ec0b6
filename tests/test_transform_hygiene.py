"""In-mesh, a step never makes a learner's parameters non-finite, and token counts are
checked as the mail runtime checks them.

A step whose gradients, or ``params + updates``, would hold a NaN or Inf is dropped
(zero update; the inner optimizer runs on the gradients with their NaN and Inf zeroed)
and counted in ``stats.dropped``; the learner's next delta is withheld (rejected by the
round) and it rejoins Θ at the merge. A static token count
that is not a non-negative whole number is refused; a traced one is clamped and counted
in ``stats.bad_tokens``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
import transform_harness as harness
import transform_reference as reference

SYNC = 4
# A step with neither sync nor merge: with one fragment rounds run at steps 4, 8, 12;
# with two, at every even step (fragment 0 at 2, 6, 10; fragment 1 at 4, 8, 12).
FAULT_STEP = 5
STEPS = 12
# The fault each kind injects into one learner's gradient at FAULT_STEP, the parameters'
# dtype, the gradients' and the inner optimizer, and the loss's curvature. "bf16-update":
# 2·3e38 overflows the bf16 update; "bf16-result": the F32 update 3.4e38 is finite, but
# not at the bf16 parameters' dtype.
FAULTS = {
    "nan": (jnp.nan, jnp.float32, jnp.float32, optax.adam(0.05), 1.0),
    "inf": (jnp.inf, jnp.float32, jnp.float32, optax.adam(0.05), 1.0),
    "bf16-update": (3e38, jnp.bfloat16, jnp.bfloat16, optax.sgd(2.0), 0.05),
    "bf16-result": (-3.4e38, jnp.bfloat16, jnp.float32, optax.sgd(1.0), 0.1),
}


def _start(learners, dtype):
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.standard_normal((learners, 40)), dtype),
          "b": jnp.asarray(rng.standard_normal((learners, 3)), dtype)}


def _learner_step(optimizer, grad_dtype, curvature=1.0):
  """One learner's step on ``c·|θ − 1|²/2``; where ``fault`` is not 0, its gradient is
  ``fault`` everywhere."""

  def step(params, state, fault):
    grads = jax.tree.map(
        lambda p: jnp.where(fault != 0, fault, curvature * (p.astype(jnp.float32) - 1)
                            ).astype(grad_dtype), params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _finite(tree):
  return all(bool(np.all(np.isfinite(np.asarray(x, np.float32))))
             for x in jax.tree.leaves(tree)
             if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact))


def _close_to_anchor(params, anchor, m, dtype, names=None):
  params, anchor = jax.device_get((params, anchor))
  tolerance = 1e-2 if dtype == jnp.bfloat16 else 1e-6
  for name in names or params:
    np.testing.assert_allclose(np.asarray(params[name][m], np.float32),
                               np.asarray(anchor[name][m], np.float32),
                               rtol=tolerance, atol=tolerance, err_msg=f"learner {m} {name}")


@pytest.mark.parametrize("kind,learners,shard_outer", [
    ("nan", 3, True), ("inf", 2, False), ("bf16-update", 4, True),
    ("bf16-result", 3, False)])
def test_a_faulty_step_is_dropped_and_the_learner_rejoins_theta(kind, learners,
                                                                 shard_outer):
  fault, dtype, grad_dtype, inner, curvature = FAULTS[kind]
  config = gmjax.DiLoCo(sync_every=SYNC, fragments=2, overlap_steps=0)
  optimizer = gmjax.diloco(inner, config, axis_name="learner", shard_outer=shard_outer)
  params = _start(learners, dtype)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(_learner_step(optimizer, grad_dtype, curvature),
                          axis_name="learner"))
  bad = learners - 1
  for t in range(1, STEPS + 1):
    faults = jnp.zeros(learners).at[bad].set(fault if t == FAULT_STEP else 0.0)
    before = params
    params, state = step(params, state, faults)
    assert _finite(params), f"step {t}"
    assert _finite(state.inner_state), f"step {t}"
    dropped = np.asarray(state.stats.dropped)
    assert dropped.tolist() == [0] * bad + [int(t >= FAULT_STEP)], f"step {t}"
    if t == FAULT_STEP:  # the dropped step left the learner where it was
      for name in params:
        np.testing.assert_array_equal(params[name][bad], before[name][bad])
    if t in (6, 8):  # each fragment's round leaves the learner's delta out; the merge
      # (mixing 0) puts every learner on the fragment's Θ
      assert np.asarray(state.stats.rejected).tolist() == [1] * learners
      assert np.asarray(state.stats.skipped).tolist() == [0] * learners
      for m in range(learners):
        _close_to_anchor(params, state.anchor, m, dtype, ["b" if t == 6 else "w"])
    if t in (10, 12):
      assert np.asarray(state.stats.rejected).tolist() == [0] * learners, f"step {t}"
  assert np.asarray(state.stats.rounds).tolist() == [STEPS // 2] * learners
  assert np.asarray(state.stats.skipped).tolist() == [0] * learners
  assert step._cache_size() == 1


def test_every_learner_faulty_skips_one_round_not_every_later_one():
  learners = 3
  config = gmjax.DiLoCo(sync_every=SYNC, overlap_steps=1, mixing=0.5)
  optimizer = gmjax.diloco(optax.adam(0.05), config, axis_name="learner")
  params = _start(learners, jnp.float32)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(_learner_step(optimizer, jnp.float32), axis_name="learner"))
  skipped = []
  for t in range(1, 4 * SYNC + 1):
    faults = jnp.full(learners, jnp.nan if t == FAULT_STEP else 0.0)
    params, state = step(params, state, faults)
    assert _finite(params) and _finite(state.inner_state), f"step {t}"
    if t == 2 * SYNC + 1:  # the skipped round's reset (one step of overlap): on Θ
      for m in range(learners):
        _close_to_anchor(params, state.anchor, m, jnp.float32)
    skipped.append(int(state.stats.skipped[0]))
  assert np.asarray(state.stats.dropped).tolist() == [1] * learners
  # Round 2 (step 8) is skipped; rounds 3 and 4 are not.
  assert skipped[2 * SYNC - 1:] == [1] * (2 * SYNC + 1)
  assert int(state.stats.rounds[0]) == 4 and int(state.stats.rejected[0]) == 0


def test_one_learner_drops_the_step_and_is_reset_after_the_skipped_round():
  config = gmjax.DiLoCo(sync_every=SYNC, overlap_steps=0)
  optimizer = gmjax.diloco(optax.adam(0.05), config)
  params = jax.tree.map(lambda x: x[0], _start(1, jnp.float32))
  state = optimizer.init(params)
  step = jax.jit(_learner_step(optimizer, jnp.float32))
  for t in range(1, STEPS + 1):
    params, state = step(params, state, jnp.float32(jnp.inf if t == FAULT_STEP else 0.0))
    assert _finite(params) and _finite(state.inner_state), f"step {t}"
    if t == 2 * SYNC:  # its only delta withheld: the round is skipped, θ reset to Θ
      assert int(state.stats.skipped) == 1 and int(state.stats.rejected) == 1
      for name in params:
        np.testing.assert_allclose(params[name], state.anchor[name], rtol=1e-6, atol=1e-6)
  assert int(state.stats.dropped) == 1
  assert int(state.stats.skipped) == 1 and int(state.stats.rounds) == STEPS // SYNC
  assert step._cache_size() == 1


def test_shard_map_drops_a_faulty_step_without_a_collective_for_it():
  learners = 4
  config = gmjax.DiLoCo(sync_every=SYNC, overlap_steps=0)
  optimizer = gmjax.diloco(optax.adam(0.05), config, axis_name="learner")
  mesh = jax.make_mesh((learners,), ("learner",))
  sharding = NamedSharding(mesh, P("learner"))
  params = _start(learners, jnp.float32)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  params, state = jax.device_put((params, state), sharding)
  one = _learner_step(optimizer, jnp.float32)

  def body(params, state, fault):
    params, state = jax.tree.map(lambda x: x[0], (params, state))
    return jax.tree.map(lambda x: x[None], one(params, state, fault[0]))

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("learner"),
                               out_specs=P("learner")))
  for t in range(1, STEPS + 1):
    faults = jnp.zeros(learners).at[1].set(jnp.nan if t == FAULT_STEP else 0.0)
    params, state = step(params, state, jax.device_put(faults, sharding))
    assert _finite(params) and _finite(state.inner_state), f"step {t}"
    if t == 2 * SYNC:
      assert np.asarray(state.stats.rejected).tolist() == [1] * learners
      for m in range(learners):
        _close_to_anchor(params, state.anchor, m, jnp.float32)
  assert np.asarray(state.stats.dropped).tolist() == [0, 1, 0, 0]
  assert np.asarray(state.stats.skipped).tolist() == [0] * learners
  # Each learner decides for itself (a manual axis): the step outside the rare
  # branches has no collective.
  faults = jax.device_put(jnp.zeros(learners), sharding)
  hlo = step.lower(params, state, faults).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  assert "while(" in entry
  for collective in ("all-reduce", "all-gather", "all-to-all", "collective-permute"):
    assert collective not in entry


def test_a_faulty_micro_batch_never_reaches_the_multisteps_accumulator():
  # The inner optimizer runs on the gradients with their NaNs zeroed: optax.MultiSteps'
  # accumulator stays finite, and the macro steps after the faulty one train again.
  config = gmjax.DiLoCo(sync_every=SYNC, overlap_steps=0)
  optimizer = gmjax.diloco(optax.MultiSteps(optax.adam(0.05), 2), config)
  params = jax.tree.map(lambda x: x[0], _start(1, jnp.float32))
  state = optimizer.init(params)
  step = jax.jit(_learner_step(optimizer, jnp.float32))
  for t in range(1, 3 * SYNC + 1):  # micro-step 5 of 12, in the second round (5..8)
    before = params
    params, state = step(params, state, jnp.float32(jnp.nan if t == FAULT_STEP else 0.0))
    assert _finite(params) and _finite(state.inner_state), f"micro-step {t}"
    if t == 3 * SYNC - 1:  # a micro-step that is no macro step: nothing moves
      np.testing.assert_array_equal(params["w"], before["w"])
  assert int(state.stats.dropped) == 1
  # Its round (one learner, its delta withheld) is skipped; the next one is not.
  assert int(state.stats.rounds) == 3 and int(state.stats.skipped) == 1


@pytest.mark.parametrize("shard_outer", [True, False], ids=["sharded", "replicated"])
def test_a_run_without_faults_matches_the_reference(shard_outer):
  setup = harness.make_setup(fragments=3, overlap=1, mixing=0.5, tokens=True, steps=13,
                             delta_precision="I4")
  expected = reference.run(setup, 13)
  params, state, step = harness.run_vmap(setup, 13, shard_outer=shard_outer)
  for m in range(len(setup.curvature)):
    harness.assert_tree_close({n: v[m] for n, v in params.items()}, expected["theta"][m],
                              what=f"learner {m} θ")
  assert not np.any(np.asarray(state.stats.dropped))
  assert not np.any(np.asarray(state.stats.bad_tokens))
  assert step._cache_size() == 1


# Token counts.


@pytest.mark.parametrize("tokens", [-1, 0.5, -2.0, float("nan"), float("inf"), True,
                                    2**31, np.float32(2.5), np.int64(-3),
                                    jnp.asarray(-29), jnp.asarray(7.25), 1 + 2j])
def test_a_static_token_count_that_is_not_a_whole_number_is_refused(tokens):
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4))
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  with pytest.raises(ValueError, match=r"tokens must be a non-negative whole number.*got"):
    optimizer.update(params, state, params, tokens=tokens)
  with pytest.raises(ValueError, match=r"tokens must be a non-negative whole number"):
    jax.jit(lambda s, p: optimizer.update(p, s, p, tokens=tokens))(state, params)


@pytest.mark.parametrize("tokens", [0, 3, 3.0, np.int64(5), np.float32(6), jnp.asarray(7)])
def test_a_static_whole_token_count_is_counted(tokens):
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4))
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  _, state = optimizer.update(params, state, params, tokens=tokens)
  assert np.asarray(state.tokens).tolist() == [[0, int(tokens)]]
  assert int(state.stats.bad_tokens) == 0


def test_traced_token_counts_are_clamped_and_counted():
  config = gmjax.DiLoCo(sync_every=8)
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")
  params = {"w": jnp.ones((6, 3))}
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(lambda p, s, k: optimizer.update(p, s, p, tokens=k),
                          axis_name="learner"))
  per_step = jnp.asarray([10, 10.5, -29, jnp.nan, jnp.inf, 3e9], jnp.float32)
  _, state = step(params, state, per_step)
  _, state = step(params, state, per_step)
  counted = np.asarray(state.tokens, np.int64)
  counted = counted[..., 0] * 2**24 + counted[..., 1]
  assert counted[:, 0].tolist() == [20, 20, 0, 0, 0, 2 * (2**31 - 128)]
  assert np.asarray(state.stats.bad_tokens).tolist() == [0, 2, 2, 2, 2, 2]
  ints = jax.jit(jax.vmap(lambda p, s, k: optimizer.update(p, s, p, tokens=k),
                          axis_name="learner"))
  _, state = ints(params, jax.vmap(optimizer.init, axis_name="learner")(params),
                  jnp.asarray([10, 10, 10, -29, 0, 1], jnp.int32))
  counted = np.asarray(state.tokens)[..., 1]
  assert counted[:, 0].tolist() == [10, 10, 10, 0, 0, 1]
  assert np.asarray(state.stats.bad_tokens).tolist() == [0, 0, 0, 1, 0, 0]
  assert step._cache_size() == 1


def test_traced_token_counts_of_the_wrong_kind_are_refused():
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4))
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  with pytest.raises(ValueError, match="tokens must be a non-negative whole number"):
    jax.jit(lambda k: optimizer.update(params, state, params, tokens=k))(jnp.bool_(True))
  with pytest.raises(ValueError, match="tokens must be one number"):
    jax.jit(lambda k: optimizer.update(params, state, params, tokens=k))(jnp.ones(2))


@pytest.mark.parametrize("settings", [
    {"error_feedback": 1.0, "delta_precision": "I4"},
    {"outer_delay": 1, "eager": True},
    {"overlap_steps": 1, "mixing": 0.5},
], ids=["error-feedback", "eager", "overlap-mixing"])
def test_a_withheld_delta_counts_as_non_finite_with_every_setting(settings):
  learners = 3
  config = gmjax.DiLoCo(sync_every=SYNC, **{"overlap_steps": 0, **settings})
  optimizer = gmjax.diloco(optax.adam(0.05), config, axis_name="learner")
  params = _start(learners, jnp.float32)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(_learner_step(optimizer, jnp.float32), axis_name="learner"))
  for t in range(1, STEPS + 1):
    faults = jnp.zeros(learners).at[0].set(jnp.nan if t == FAULT_STEP else 0.0)
    params, state = step(params, state, faults)
    assert _finite(params) and _finite(state._replace(stats=None)), f"step {t}"
    if t == 2 * SYNC:
      assert np.asarray(state.stats.rejected).tolist() == [1] * learners
      if "error_feedback" in settings:  # the withheld delta's residual restarts
        for value in state.residual.values():
          np.testing.assert_array_equal(np.asarray(value)[0], 0.0)
          assert np.abs(np.asarray(value)[1:]).max() > 0
  assert np.asarray(state.stats.rejected).tolist() == [0] * learners
  assert np.asarray(state.stats.skipped).tolist() == [0] * learners
  assert np.asarray(state.stats.dropped).tolist() == [1, 0, 0]


def test_parameters_already_non_finite_are_dropped_until_given_the_anchor():
  # NaN + u is NaN for every update: such a learner's steps are all dropped (and its
  # deltas rejected) until it takes state.anchor; the others go on undisturbed.
  learners = 3
  config = gmjax.DiLoCo(sync_every=SYNC, overlap_steps=0)
  optimizer = gmjax.diloco(optax.adam(0.05), config, axis_name="learner")
  params = _start(learners, jnp.float32)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(_learner_step(optimizer, jnp.float32), axis_name="learner"))
  none = jnp.zeros(learners)
  for _ in range(SYNC):
    params, state = step(params, state, none)
  params = {n: v.at[2, 0].set(jnp.nan) for n, v in params.items()}
  for _ in range(SYNC):
    params, state = step(params, state, none)
  assert np.asarray(state.stats.dropped).tolist() == [0, 0, SYNC]
  assert np.asarray(state.stats.rejected).tolist() == [1] * learners
  assert np.asarray(state.stats.skipped).tolist() == [0] * learners
  assert _finite({n: v[:2] for n, v in params.items()}) and not _finite(params)
  params = {n: v.at[2].set(state.anchor[n][2]) for n, v in params.items()}
  for _ in range(SYNC):
    params, state = step(params, state, none)
  assert _finite(params)
  assert np.asarray(state.stats.dropped).tolist() == [0, 0, SYNC]
  assert np.asarray(state.stats.rejected).tolist() == [0] * learners


def _bytes_accessed(optimizer, **options):
  params = {"w": jnp.ones((256, 256)), "b": jnp.ones((256,))}

  def step(params, state):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(p["w"] @ p["b"])))(params)
    updates, state = optimizer.update(grads, state, params, **options)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, optimizer.init(params)).compile()
  analysis = compiled.cost_analysis()
  return (analysis[0] if isinstance(analysis, list) else analysis)["bytes accessed"]


def test_without_the_check_a_step_between_rounds_moves_plain_optaxs_bytes():
  # The check reads params + updates before apply_updates writes them, so XLA writes
  # the updates out and reads the gradients again: about four parameter-sized passes
  # more than plain optax a step. drop_non_finite=False leaves it out.
  inner, config = optax.adamw(1e-3), gmjax.DiLoCo(sync_every=100)
  plain = _bytes_accessed(inner)
  checked = _bytes_accessed(gmjax.diloco(inner, config), between_rounds=True)
  unchecked = _bytes_accessed(gmjax.diloco(inner, config, drop_non_finite=False),
                              between_rounds=True)
  parameter_bytes = (256 * 256 + 256) * 4
  # Plain optax's passes, and a few scalars of bookkeeping (counts, tokens, statistics).
  assert 0 <= unchecked - plain < 1024, (plain, unchecked, checked)
  assert checked - plain > 2 * parameter_bytes, (plain, unchecked, checked)


def test_without_the_check_a_faulty_learner_stays_faulty_and_is_rejected():
  optimizer = gmjax.diloco(optax.adam(0.05), gmjax.DiLoCo(sync_every=SYNC),
                           axis_name="learner", drop_non_finite=False)
  step = jax.jit(jax.vmap(_learner_step(optimizer, jnp.float32), axis_name="learner"))
  params = _start(3, jnp.float32)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  for t in range(1, STEPS + 1):
    fault = jnp.asarray([0.0, jnp.nan if t == FAULT_STEP else 0.0, 0.0])
    params, state = jax.block_until_ready(step(params, state, fault))
  assert not _finite({n: v[1] for n, v in params.items()})  # no guard: it stays NaN
  assert _finite({n: v[0] for n, v in params.items()}) and _finite(state.anchor)
  # The last round (step 12) left it out, as the one at step 8 did; nothing was dropped.
  assert int(state.stats.rejected[0]) == 1 and int(state.stats.dropped[0]) == 0
  with pytest.raises(TypeError, match=r"drop_non_finite='yes' must be a bool"):
    gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=SYNC), drop_non_finite="yes")


def test_without_the_check_finite_steps_are_the_same_bit_for_bit():
  runs = []
  for drop in (True, False):
    tx = gmjax.diloco(optax.adam(0.05), gmjax.DiLoCo(sync_every=SYNC, fragments=2),
                      axis_name="learner", drop_non_finite=drop)
    step = jax.jit(jax.vmap(_learner_step(tx, jnp.float32), axis_name="learner"))
    params = _start(2, jnp.float32)
    state = jax.vmap(tx.init, axis_name="learner")(params)
    for _ in range(STEPS):
      params, state = jax.block_until_ready(step(params, state, jnp.zeros(2)))
    runs.append((params, state.anchor))
  for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_python_float_gradient_is_checked_as_an_array():
  # The gradient of a scalar parameter given as a Python float: a raw AttributeError
  # ('float' object has no attribute 'astype') from the check, not from optax.
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2))
  params = {"s": jnp.float32(1.0)}
  updates, _ = optimizer.update({"s": 0.5}, optimizer.init(params), params)
  np.testing.assert_allclose(updates["s"], -0.05, rtol=1e-6)
