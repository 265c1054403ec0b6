"""Mail mode and in-mesh mode compute the same parameters on the same data.

SPEC: with all learners contributing, ``overlap_steps=0`` (or ``τ`` with ``in_flight`` at
least ``⌈τ / ⌊H/P⌋⌉``, the rounds a learner has published within ``τ`` steps: fewer make
it merge a round before its ``τ`` steps are up) and no faults, learners that
meet through storage end where ``gmjax.diloco`` learners on a mapped axis end (up to
float summation order), with the in-mesh outer step sharded over the learners (the
default) and any outer optimizer.
"""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax
from gmjax import mail

import mail_support as ms

LEARNERS, STEPS = 3, 12
TOKENS = (10, 30, 20)


def goals(poisoned=False):
  goals = [ms.target(m) for m in range(LEARNERS)]
  if poisoned:  # learner 1's delta is about a thousand times the others': rejected
    goals[1] = {k: 1e3 * v for k, v in goals[1].items()}
  return goals


def tokens_of(poisoned=False):
  # Learner 2 claims a thousand times its tokens: clamped to 10x learner 0's.
  return (TOKENS[0], TOKENS[1], 1000 * TOKENS[2]) if poisoned else TOKENS


def sgd_grads(params, goal):
  return {k: params[k] - goal[k] for k in params}


def in_mesh(config, poisoned=False, shard_outer=None):
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner",
                           shard_outer=shard_outer)
  goal = jax.tree.map(lambda *g: jnp.stack(g), *goals(poisoned))

  def step(params, state, goal, tokens):
    updates, state = optimizer.update(sgd_grads(params, goal), state, params, tokens=tokens)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(step, axis_name="learner"))
  params = jax.tree.map(lambda v: jnp.stack([v] * LEARNERS), ms.params0())
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  tokens = jnp.asarray(tokens_of(poisoned), jnp.float32)
  for _ in range(STEPS):
    params, state = jax.block_until_ready(step(params, state, goal, tokens))
  learners = [jax.tree.map(lambda v, m=m: np.asarray(v[m]), params) for m in range(LEARNERS)]
  return learners, jax.tree.map(lambda x: np.asarray(x)[0], state.stats)


def by_mail(config, tmp_path, poisoned=False):
  run = mail.create(str(tmp_path / "run"), ms.params0(), config)
  optimizer = optax.sgd(0.1)
  out = {}
  # Every learner is live before anyone trains, so every round waits for all of them.
  joined = threading.Barrier(LEARNERS, timeout=60)

  def learner_loop(name, index):
    learner = run.join(name, poll_interval=ms.POLL, wait_timeout=60.0)
    params = learner.pull(ms.params0())
    state = optimizer.init(params)
    joined.wait()
    for _ in range(STEPS):
      updates, state = optimizer.update(sgd_grads(params, goals(poisoned)[index]), state,
                                        params)
      params = {k: np.asarray(v) for k, v in optax.apply_updates(params, updates).items()}
      params = learner.step(params, tokens=tokens_of(poisoned)[index])
    out[name] = params
    learner.close(params)  # flush_on_close=False: no final round that in-mesh never runs

  threads = ms.Threads()
  for m in range(LEARNERS):
    threads.start(learner_loop, f"learner-{m}", m)
  threads.join(timeout=120)
  return [out[f"learner-{m}"] for m in range(LEARNERS)], run.rounds()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "config",
    [
        gmjax.DiLoCo(sync_every=4, fragments=1),
        gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="F8_E4M3", mixing=0.5),
        gmjax.DiLoCo(sync_every=6, fragments=3, delta_precision="I4", commit_precision="BF16",
                     nesterov=False),
        gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="BF16", outer="adam",
                     outer_options={"learning_rate": 0.05, "b2": 0.99}),
        gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="I2", commit_precision="I2",
                     error_feedback=1.0),
        gmjax.DiLoCo(sync_every=4, fragments=1, delta_precision="F8_E4M3", mixing=0.5,
                     error_feedback=0.5),
        gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="I2", delta_topk=2,
                     delta_chunk=5, error_feedback=1.0),
        gmjax.DiLoCo(sync_every=4, fragments=1, outer_delay=1),
        gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="I4", outer_delay=1,
                     commit_precision="BF16"),
        gmjax.DiLoCo(sync_every=4, fragments=1, outer_delay=1, eager=True),
        gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="F8_E4M3", outer_delay=1,
                     eager=True, error_feedback=1.0, nesterov=False),
        gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="I4", mixing=0.5,
                     commit_precision="BF16", layer_axis={"a": 0}),
        gmjax.DiLoCo(sync_every=4, fragments=2, overlap_steps=3, in_flight=2, mixing=0.5),
    ],
    ids=["diloco", "streaming-f8-mixing", "streaming-i4-bf16-commits", "outer-adam",
         "streaming-i2-i2-commits-error-feedback", "f8-mixing-error-feedback-0.5",
         "streaming-i2-top2-of-5-error-feedback", "delayed", "streaming-i4-delayed",
         "eager", "streaming-f8-eager-error-feedback", "layer-blocks-i4-bf16-commits",
         "streaming-overlap-past-the-next-round"],
)
def test_mail_learners_end_where_in_mesh_learners_end(config, tmp_path):
  config = dataclasses.replace(config, flush_on_close=False)
  mesh, _ = in_mesh(config)
  mailed, rounds = by_mail(config, tmp_path)
  schedule = config.schedule(len(config.plan(gmjax.Schema.from_tree(ms.params0()))))
  expected_rounds = [r for r in range(40) if schedule.step_of(r) <= STEPS]
  assert [r.round for r in rounds] == expected_rounds
  assert all(len(r.participants) == LEARNERS for r in rounds)
  weights = {p.learner: p.weight for p in rounds[0].participants}
  np.testing.assert_allclose([weights[f"learner-{m}"] for m in range(LEARNERS)],
                             np.asarray(TOKENS) / sum(TOKENS), rtol=1e-6)
  for m in range(LEARNERS):
    for name in ms.params0():
      np.testing.assert_allclose(mailed[m][name], mesh[m][name], rtol=2e-5, atol=2e-6,
                                 err_msg=f"learner {m}, leaf {name}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("outer", ["lamb", "sm3"])
def test_a_replicated_outer_that_is_not_elementwise_sees_the_leaves(outer, tmp_path):
  # LAMB scales each leaf's step by its own trust ratio, SM3 keeps a matrix's moments by
  # row and column: in-mesh, where the masters are held in buckets, they must still be
  # given the leaves, as the mail closer gives them. SM3 passed the elementwise probe
  # (a vector whole and halved) and stepped the buckets: 6e-3 off mail's Θ.
  config = gmjax.DiLoCo(sync_every=4, fragments=1, delta_precision="I4", outer=outer,
                        outer_options={"learning_rate": 0.3}, flush_on_close=False)
  mesh, _ = in_mesh(config, shard_outer=False)
  mailed, _ = by_mail(config, tmp_path)
  for m in range(LEARNERS):
    for name in ms.params0():
      np.testing.assert_allclose(mailed[m][name], mesh[m][name], rtol=2e-5, atol=2e-6,
                                 err_msg=f"learner {m}, leaf {name}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shard_outer,delay", [(True, {}), (False, {}),
                                               (True, {"outer_delay": 1, "eager": True})],
                         ids=["sharded", "replicated", "sharded-eager"])
def test_both_modes_reject_and_clamp_alike(shard_outer, delay, tmp_path):
  # Learner 1's delta is an outlier in every round and learner 2's tokens are clamped:
  # the mail closer and the in-mesh screening leave out and clamp the same, and end on
  # the same parameters (eager: the rejected learner's weight, 0, is its proxy's too).
  config = gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="F8_E4M3",
                        flush_on_close=False, **delay)
  mesh, stats = in_mesh(config, poisoned=True, shard_outer=shard_outer)
  mailed, rounds = by_mail(config, tmp_path, poisoned=True)
  assert int(stats.rejected) == 1 and int(stats.clamped) == 1
  assert int(stats.skipped) == 0
  for record in rounds:
    assert [p.learner for p in record.participants] == ["learner-0", "learner-2"]
    assert [r.learner for r in record.rejected] == ["learner-1"]
    tokens = {p.learner: p.tokens for p in record.participants}
    assert [(c["learner"], c["field"], c["used"]) for c in record.extra["clamped"]] == [
        ("learner-2", "tokens", 10 * tokens["learner-0"])]
    assert tokens["learner-2"] == 10 * tokens["learner-0"]
  for m in range(LEARNERS):
    for name in ms.params0():
      np.testing.assert_allclose(mailed[m][name], mesh[m][name], rtol=2e-5, atol=2e-6,
                                 err_msg=f"learner {m}, leaf {name}")



@pytest.mark.timeout(180)
def test_without_outlier_screening_both_modes_keep_every_finite_delta(tmp_path):
  # outlier_factor=None: the far-off delta and the large token count are aggregated as
  # they are, by mail as in-mesh.
  config = gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="F8_E4M3",
                        flush_on_close=False, outlier_factor=None)
  mesh, stats = in_mesh(config, poisoned=True)
  mailed, rounds = by_mail(config, tmp_path, poisoned=True)
  assert int(stats.rejected) == 0 and int(stats.clamped) == 0
  for record in rounds:
    assert [p.learner for p in record.participants] == [f"learner-{m}" for m in range(3)]
    assert not record.rejected and not record.extra.get("clamped")
    tokens = {p.learner: p.tokens for p in record.participants}
    assert tokens["learner-2"] == 2000 * tokens["learner-0"]  # claimed, not clamped
  for m in range(LEARNERS):
    for name in ms.params0():
      np.testing.assert_allclose(mailed[m][name], mesh[m][name], rtol=2e-5, atol=2e-6,
                                 err_msg=f"learner {m}, leaf {name}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("aggregation,poisoned,shard_outer", [
    ("clipped_mean", True, True), ("trimmed_mean", False, False)],
    ids=["clipped-rejected-sharded", "trimmed-median-replicated"])
def test_robust_aggregation_is_the_same_by_mail_and_in_mesh(aggregation, poisoned,
                                                             shard_outer, tmp_path):
  # Poisoned, learner 1 is rejected and takes no part in the medians: of the two kept,
  # clipped_mean clips the longer delta and caps learner 2's clamped tokens at their
  # median. Clean, trimmed_mean with trim=1 of three learners is the coordinate-wise
  # median (replicated, the F8 deltas all-gathered and sorted on every learner).
  config = gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="F8_E4M3",
                        aggregation=aggregation, flush_on_close=False)
  mesh, stats = in_mesh(config, poisoned=poisoned, shard_outer=shard_outer)
  mailed, rounds = by_mail(config, tmp_path, poisoned=poisoned)
  assert int(stats.rejected) == int(poisoned) and int(stats.skipped) == 0
  clipped = 1 if aggregation == "clipped_mean" else 0
  trimmed = 1 if aggregation == "trimmed_mean" and not poisoned else 0
  assert (int(stats.clipped), int(stats.capped), int(stats.trimmed)) == (
      clipped, clipped, trimmed)
  for record in rounds:
    summary = record.extra["aggregation"]
    assert summary["rule"] == aggregation and summary["trimmed"] == trimmed
    assert (len(summary["clipped"]), summary["capped"]) == (clipped, clipped)
    kept = [p.learner for p in record.participants]
    assert "learner-1" not in kept if poisoned else len(kept) == LEARNERS
    assert sum(p.weight for p in record.participants) == pytest.approx(1.0)
  for m in range(LEARNERS):
    # The rejected learner steps toward a goal a thousand times away: its own steps
    # round at the ulp of hundreds, numpy's and XLA's alike.
    atol = 1e-4 if poisoned and m == 1 else 2e-6
    for name in ms.params0():
      np.testing.assert_allclose(mailed[m][name], mesh[m][name], rtol=2e-5, atol=atol,
                                 err_msg=f"learner {m}, leaf {name}")


@pytest.mark.timeout(180)
def test_a_skipped_round_resets_the_fragment_in_both_modes(tmp_path):
  # In-mesh a round whose outer step overflows resets each learner's fragment to Θ at
  # its merge; mail merged its unchanged Θ with mixing, keeping half of the steps of a
  # round judged bad, and the two runtimes parted (0.99 against 0.81 a step later).
  config = gmjax.DiLoCo(sync_every=4, overlap_steps=1, mixing=0.5, outer_momentum=0.0,
                        outer_learning_rate=3.3e38, flush_on_close=False)
  mesh, stats = in_mesh(config)
  mailed, rounds = by_mail(config, tmp_path)
  assert int(stats.skipped) == sum(not r.outer_step for r in rounds) > 0
  for m in range(LEARNERS):
    for name in ms.params0():
      np.testing.assert_allclose(mailed[m][name], mesh[m][name], rtol=2e-5, atol=2e-6,
                                 err_msg=f"learner {m}, leaf {name}")


@pytest.mark.timeout(180)
def test_an_eager_correction_that_overflows_is_dropped_alike(tmp_path):
  # With an outer step of 1e37 Θ overflows from the second round on (those rounds are
  # skipped), and so did each learner's own correction: its start, then its parameters, went to inf and NaN for
  # good in both runtimes. Now the correction is dropped and the learner starts at Θ.
  config = gmjax.DiLoCo(sync_every=4, fragments=1, outer_delay=1, eager=True,
                        outer_learning_rate=1e37, outer_momentum=0.0, flush_on_close=False)
  mesh, stats = in_mesh(config)
  mailed, rounds = by_mail(config, tmp_path)
  assert int(stats.skipped) > 0
  assert [r.outer_step for r in rounds][-int(stats.skipped):] == [False] * int(stats.skipped)
  for m in range(LEARNERS):
    for name in ms.params0():
      assert np.all(np.isfinite(mesh[m][name])), (m, name)
      np.testing.assert_array_equal(mailed[m][name], mesh[m][name],
                                    err_msg=f"learner {m}, leaf {name}")
