"""Adaptive steps: learners of different speeds train for the same wall time per round.

Learners run in threads over ``memory://`` runs; a learner's speed is a sleep per step.
The committed Θ is checked against plain numpy DiLoCo driven by the step counts and
tokens the round records report, and the step counts against the speeds.
"""

import dataclasses
import json
import threading
import time
import uuid

import numpy as np
import optax
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import heartbeats
from gmjax.mail import pace
from gmjax.mail import states

import mail_support as ms

POLL = 0.01


def _learn(url, name, index, sleep, last_round, joined, out, merges, *, tokens=1):
  """Trains with ``sleep`` seconds per step until it has published ``last_round``;
  ``merges[name][f]`` lists the local steps at which it merged fragment ``f`` (those
  in ``close`` at its last step)."""
  run = mail.open(url)
  learner = run.join(name, poll_interval=POLL, wait_timeout=60.0)
  params = learner.pull(ms.params0())
  joined.wait()  # every learner is live before anyone publishes round 0
  goal = ms.target(index)
  last = run.manifest.schedule.step_of(last_round)
  merged = merges[name] = {f: [] for f in learner.versions}

  def noted(before):
    for f, version in learner.versions.items():
      if version > before[f]:
        merged[f].append(learner.local_step)

  while learner.step_count < last:
    time.sleep(sleep)
    params = ms.inner(params, goal)
    before = learner.versions
    params = learner.step(params, tokens=tokens)
    noted(before)
  before = learner.versions
  params = learner.close(params)
  noted(before)
  out[name] = (params, learner, run.learners()[name])


def _train(config, sleeps, rounds, *, tokens=None):
  # Every round waits for every learner, however late a loaded machine makes one.
  config = dataclasses.replace(config, quorum_size=len(sleeps))
  url = f"memory://adaptive-{uuid.uuid4().hex}"
  run = mail.create(url, ms.params0(), config, keep_versions=None)
  joined = threading.Barrier(len(sleeps), timeout=40)
  out, merges = {}, {}
  threads = ms.Threads()
  for m, sleep in enumerate(sleeps):
    threads.start(_learn, url, f"m{m}", m, sleep, rounds - 1, joined, out, merges,
                  tokens=1 if tokens is None else tokens[m])
  threads.join(timeout=60)
  return run, out, merges


def _steps(record):
  return {p.learner: p.steps for p in record.participants}


@pytest.mark.timeout(90)
def test_unequal_steps_match_numpy_reference():
  config = gmjax.DiLoCo(sync_every=8, adaptive_steps=True)
  tokens = [1, 3, 2]
  run, out, _ = _train(config, [0.005, 0.02, 0.04], rounds=5, tokens=tokens)
  records = run.rounds()
  assert [r.round for r in records] == list(range(5))
  for record in records:
    steps = _steps(record)
    assert sorted(steps) == ["m0", "m1", "m2"] and record.rejected == ()
    total = sum(p.tokens for p in record.participants)
    for p in record.participants:
      assert p.tokens == p.steps * tokens[int(p.learner[1:])]
      assert p.weight == p.tokens / total  # token weights, exactly
      assert p.step_seconds > 0
  assert any(len(set(_steps(r).values())) > 1 for r in records), [_steps(r) for r in records]
  expected = ms.records_reference(config, run.plan, records,
                                  {name: ms.target(int(name[1:])) for name in out})
  for name, (params, learner, _) in out.items():
    assert learner.step_count == run.manifest.schedule.step_of(4)
    assert learner.local_step == sum(_steps(r)[name] for r in records)
    for leaf in expected:
      np.testing.assert_allclose(params[leaf], expected[leaf], rtol=2e-5, atol=2e-6,
                                 err_msg=f"learner {name}, leaf {leaf}")


@pytest.mark.timeout(90)
def test_speeds_set_the_steps_of_each_round():
  config = gmjax.DiLoCo(sync_every=8, adaptive_steps=True)
  run, out, _ = _train(config, [0.03, 0.06, 0.12], rounds=6)
  records = run.rounds()
  assert [r.round for r in records] == list(range(6))
  nominal = {"m0": 8, "m1": 4, "m2": 2}  # 8 steps of the 30 ms learner's time
  on_nominal = 0
  for record in records:
    steps = _steps(record)
    assert sorted(steps) == ["m0", "m1", "m2"]
    assert all(1 <= s <= 8 for s in steps.values())
    if record.round < 2:
      continue  # timed by heartbeats while the paces become known
    # From round 2 on the deadline is 8 steps at the fastest pace round r − 2's record
    # lists; each learner stops at the step nearest it, at its own pace (what its
    # contribution reports): the sleeps' 8, 4 and 2, unless the machine slowed a learner.
    paces = {p.learner: p.step_seconds for p in records[record.round - 2].participants}
    period = 8 * pace.fastest(paces.values())
    own = {p.learner: p.step_seconds for p in record.participants}
    for name, count in steps.items():
      planned = min(8, max(1, round(period / own[name])))
      assert abs(count - nominal[name]) <= 1 or abs(count - planned) <= 1, (
          record.round, steps, planned)
    on_nominal += all(abs(steps[m] - nominal[m]) <= 1 for m in nominal)
  assert on_nominal >= 3, [_steps(r) for r in records]  # of the 4 rounds timed by records
  for name, (_, learner, beat) in out.items():
    assert beat.trained == learner.local_step > 0
    assert beat.step_seconds == pytest.approx(learner._step_seconds)
    assert beat.idle_seconds == pytest.approx(learner.idle_seconds)
    assert learner.idle_seconds >= 0
  # The slow learner trains a quarter of the fast one's steps, and waits about as much.
  assert out["m2"][1].local_step < out["m0"][1].local_step / 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [
    dict(fragments=2),
    dict(overlap_steps=2),
    dict(overlap_steps=3, fragments=2),
    dict(overlap_steps=None),
    dict(overlap_steps=None, in_flight=2, fragments=2),
    dict(outer_delay=1),
    dict(outer_delay=1, eager=True),
    dict(error_feedback=0.9, delta_precision="I4"),
], ids=["fragments", "overlap-2", "overlap-3-fragments", "overlap-none", "in-flight",
        "delayed", "eager", "feedback"])
def test_adaptive_with_other_options(options):
  config = gmjax.DiLoCo(sync_every=8, adaptive_steps=True, **options)
  run, out, merges = _train(config, [0.01, 0.03], rounds=4)
  schedule = run.manifest.schedule
  records = run.rounds()
  regular = [r for r in records if not r.final]
  assert [r.round for r in regular] == list(range(4))
  steps_since = {"m0": [0] * schedule.fragments, "m1": [0] * schedule.fragments}
  contributed = {"m0": 0, "m1": 0}
  for record in records:
    steps = _steps(record)
    assert record.rejected == () and record.outer_step
    assert sorted(steps) == ["m0", "m1"]
    total = sum(p.tokens for p in record.participants)
    for p in record.participants:
      assert p.steps <= schedule.sync_every  # a round holds at most its own steps
      assert p.tokens == p.steps
      contributed[p.learner] += p.steps
      assert p.weight == pytest.approx(p.tokens / total, rel=1e-6)
  # Same wall time a round: m0, at a third of m1's seconds a step, trains more of it.
  assert contributed["m0"] > contributed["m1"], contributed
  for name, (params, learner, beat) in out.items():
    assert learner.step_count == schedule.step_of(3)
    for leaf, value in params.items():
      assert np.all(np.isfinite(value)), leaf
    assert beat.status == "closed"
  if config.overlap_steps is not None:
    for name, (_, learner, _) in out.items():
      # Every step trained went into exactly one contribution per fragment.
      for f in range(schedule.fragments):
        covered = sum(_steps(r)[name] for r in records if r.fragment == f)
        assert covered == learner.local_step, (name, f)
    if config.overlap_steps == 0 and not config.outer_delay and not config.error_feedback:
      # Each contribution holds its steps trained from the Θ merged at its last publish.
      _assert_theta_matches_reference(config, run, records, out)
    # With overlap_steps > 0 a learner trains on past its publish before it merges, with
    # outer_delay its phases start from older versions, and error feedback adds the
    # residuals of quantized deltas: the reference models none of them.
    return
  # With overlap_steps=None and mixing 0 a merge replaces the fragment by Θ: each
  # contribution covers the steps since the learner's last merge of the fragment, or
  # its previous contribution to it (a merge at the publishing step comes after the
  # publish), and Θ is what numpy DiLoCo makes of those steps and tokens.
  previous = {(name, f): 0 for name in out for f in range(schedule.fragments)}
  for record in records:
    f = record.fragment
    for p in record.participants:
      name, published = p.learner, p.local_step
      start = max([previous[name, f], *(m for m in merges[name][f] if m < published)])
      assert p.steps == published - start, (record.round, p, merges[name])
      previous[name, f] = published
  _assert_theta_matches_reference(config, run, records, out)


def _assert_theta_matches_reference(config, run, records, out):
  """The newest committed Θ of every fragment is numpy DiLoCo's of the records' steps and
  tokens (``mail_support.records_reference``)."""
  expected = ms.records_reference(config, run.plan, records,
                                  {name: ms.target(int(name[1:])) for name in out})
  for f, version in run.newest_versions().items():
    theta = states.load_theta(run.store, run.commit(f, version), 1 << 30)
    for leaf in run.plan[f]:
      np.testing.assert_allclose(theta[leaf], expected[leaf], rtol=2e-5, atol=2e-6,
                                 err_msg=f"fragment {f}, leaf {leaf}")


def test_in_mesh_refuses_adaptive_steps():
  config = gmjax.DiLoCo(sync_every=4, adaptive_steps=True)
  with pytest.raises(ValueError, match="adaptive_steps=True.*lockstep.*adaptive_steps=False"):
    gmjax.diloco(optax.sgd(0.1), config)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_adaptive_steps_must_be_a_bool(value):
  with pytest.raises(ValueError, match=f"adaptive_steps must be a bool, got {value!r}"):
    gmjax.DiLoCo(sync_every=4, adaptive_steps=value)


def test_config_json_round_trips_adaptive_steps():
  config = gmjax.DiLoCo(sync_every=4, adaptive_steps=True)
  assert config.to_json()["adaptive_steps"] is True
  assert gmjax.DiLoCo.from_json(config.to_json()) == config
  plain = dataclasses.replace(config, adaptive_steps=False)
  assert "adaptive_steps" not in plain.to_json()  # as manifests written before it read
  assert gmjax.DiLoCo.from_json(plain.to_json()).adaptive_steps is False


def test_manifest_keeps_adaptive_steps():
  url = f"memory://adaptive-{uuid.uuid4().hex}"
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=4, adaptive_steps=True))
  assert mail.open(url).manifest.config.adaptive_steps is True


def test_fastest_ignores_missing_and_incredible_paces():
  assert pace.fastest([]) is None
  assert pace.fastest([None, 0.0, float("nan"), float("inf"), -1.0]) is None
  assert pace.fastest([0.08, 0.02, 0.04]) == 0.02
  assert pace.fastest([1e-6, 0.04, 0.05, 0.06]) == 0.04  # >10x faster than the median
  # Of two learners, one reporting a pace 1000x too fast set every round to one step:
  # the lower median of all reports was its own. The fastest needs another within 10x.
  assert pace.fastest([2e-5, 0.02]) == 0.02 and pace.fastest([2e-5, 0.02, 0.5]) == 0.02
  assert pace.fastest([0.02, 0.03]) == 0.02 and pace.fastest([0.3]) == 0.3
  assert pace.fastest([1e-6, 1e-6, 0.04]) == 1e-6  # two agree: a majority
  assert pace.fastest([1e-6, 1e-6] + [0.05] * 10) == 0.05  # two of twelve do not
  # Fast learners that are half the pool set the pace.
  assert pace.fastest([0.01, 0.01, 0.5, 0.5]) == 0.01
  assert pace.fastest([0.01] * 3 + [0.5] * 3) == 0.01


def test_round_clock_keeps_its_deadlines_without_drift():
  schedule = gmjax.DiLoCo(sync_every=8, fragments=2).schedule(2)
  clock = pace.RoundClock(schedule, 0, start=100.0)
  assert not clock.due(1e9, 0.01)  # no pace known: the schedule's step decides
  clock.plan(0.05, from_record=False)
  assert clock.deadline == pytest.approx(100.2)  # gap(0) = 4 steps
  clock.plan(0.02, from_record=False)  # a faster pace seen: earlier
  clock.plan(0.05, from_record=False)  # never later, from heartbeats
  assert clock.deadline == pytest.approx(100.08)
  assert not clock.due(100.05, 0.02) and clock.due(100.07, 0.02)
  clock.advance(100.1, resumed=None)  # published late, without waiting: no re-anchoring
  assert (clock.round, clock.start, clock.deadline) == (1, pytest.approx(100.08), None)
  clock.plan(0.03, from_record=True)
  clock.plan(0.01, from_record=False)  # a record's pace is final for its round
  assert clock.deadline == pytest.approx(100.2)
  clock.advance(100.2, resumed=100.5)  # waited for a commit until 100.5: from there
  assert clock.start == pytest.approx(100.5)
  clock.plan(0.5, from_record=True)  # a pace measured too slow: the deadline is at 102.5
  clock.advance(100.9, resumed=None)  # published at its scheduled step, before it
  assert clock.start == pytest.approx(100.9)  # from then, not from 102.5
  clock.pause(0.3)  # a save of the learner's state: no training, no period
  clock.plan(0.05, from_record=True)
  assert (clock.start, clock.deadline) == (pytest.approx(101.2), pytest.approx(101.4))
  clock.pause(0.1)
  assert (clock.start, clock.deadline) == (pytest.approx(101.3), pytest.approx(101.5))


@pytest.mark.timeout(120)
def test_saving_the_state_does_not_shorten_the_rounds(tmp_path):
  # The synchronous save at each merge ran inside the next round's period: one learner
  # of 10 ms steps with a 1 MB state trained 1-2 steps a round instead of 8.
  run = mail.create(str(tmp_path / "run"), ms.params0(),
                    gmjax.DiLoCo(sync_every=8, adaptive_steps=True))
  learner = run.join("a", poll_interval=POLL, state_dir=tmp_path / "state")
  params = learner.pull(ms.params0())
  state = {"mu": np.ones((512, 512), np.float32)}
  for step in range(40):
    time.sleep(0.01)
    params = learner.step(ms.inner(params, ms.target(0)), state=state, position=step)
  learner.close(params)
  steps = [p.steps for r in run.rounds() for p in r.participants]
  assert sum(steps) / len(steps) >= 5, steps


@pytest.mark.parametrize("field, value", [
    ("step_seconds", "fast"), ("step_seconds", -0.5), ("step_seconds", float("inf")),
    ("idle_seconds", True), ("idle_seconds", float("nan")), ("trained", 1.5),
    ("trained", -1),
])
def test_heartbeat_pace_fields_are_checked(field, value):
  record = {"name": "m0", "status": "live", "seq": 1, "step_seconds": 0.02, "trained": 3,
            "idle_seconds": 0.5}
  assert heartbeats.parse("m0", json.dumps(record).encode(), None)["trained"] == 3
  record[field] = value
  with pytest.raises(heartbeats.BadHeartbeat, match=field):
    heartbeats.parse("m0", json.dumps(record).encode(), None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_process_learner_agrees_on_its_deadlines(tmp_path):
  """Process 0 decides when a round is due: both processes publish the same rounds at
  the same steps (or the job's collectives would hang) and end on the committed Θ."""
  config = gmjax.DiLoCo(sync_every=4, adaptive_steps=True)
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), config, keep_versions=None)
  outs = [str(tmp_path / f"p{i}.json") for i in range(2)]
  seen = ms.two_process_job(url, 9, outs)
  assert seen[0]["final"] == seen[1]["final"]
  records = run.rounds()
  assert all([p.learner for p in r.participants] == ["job"] for r in records)
  assert sum(_steps(r)["job"] for r in records) == 9  # every step in one contribution
  last = records[-1]
  theta = states.load_state(run.store, run.commit(0, last.version), 1 << 30).theta
  for name, value in seen[0]["final"].items():
    np.testing.assert_array_equal(np.asarray(value, np.float32), theta[name])


def test_one_slow_step_does_not_set_the_pace():
  """A step that compiles again (seconds, once) must not stretch the rounds after it: the
  pace is the lower median of the last steps, not an average a one-off seeds."""
  url = f"memory://adaptive-{uuid.uuid4().hex}"
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=64, adaptive_steps=True))
  learner = mail.open(url).join("m0", poll_interval=POLL)
  params = learner.pull(ms.params0())
  for step in range(8):
    time.sleep(0.5 if step == 1 else 0.005)
    params = learner.step(ms.inner(params, ms.target(0)))
  learner.close(params)
  seconds = learner.run.learners()["m0"].step_seconds  # as the last heartbeat says
  assert seconds < 0.1, seconds  # a moving average seeded at 0.5 s was still ~0.27 s


def _train_until_the_slow_one_stops(run, poll, learners):
  """Trains ``(name, seconds a step, steps or None)`` learners in threads from one start;
  those without a step count train until one with a count has trained its steps."""
  done, together = threading.Event(), threading.Barrier(len(learners))

  def learn(name, sleep, steps):
    learner = run.join(name, poll_interval=poll, wait_timeout=60.0)
    params = learner.pull(ms.params0())
    together.wait()
    count = 0
    while (count < steps) if steps else not done.is_set():
      time.sleep(sleep)
      params = learner.step(ms.inner(params, ms.target(0)))
      count += 1
    done.set()
    learner.close(params)

  threads = ms.Threads()
  for learner in learners:
    threads.start(learn, *learner)
  threads.join(100)


@pytest.mark.timeout(120)
def test_a_learner_too_slow_for_fixed_steps_is_told_to_adapt(tmp_path, caplog):
  # Five times slower with fixed steps, a learner missed every round after its first,
  # silently (an info line each), while its heartbeat said it trained.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=16))
  _train_until_the_slow_one_stops(run, POLL, [("fast", 0.005, None), ("slow", 0.05, 96)])
  warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
            and "rounds in a row closed before it got to them" in r.getMessage()]
  assert warned and all(m.startswith("learner 'slow'") for m in warned), warned
  assert "adaptive_steps=True" in warned[0]
  slow_rounds = [r.round for r in run.rounds() if "slow" in _steps(r)]
  assert len(slow_rounds) <= 3, slow_rounds  # what it was late for counted nothing


@pytest.mark.timeout(120)
def test_a_learner_too_slow_for_adaptive_steps_is_told_why(tmp_path, caplog):
  # With adaptive steps the warning was off: a learner one of whose steps outlasts a
  # round's period was late for every round, with only an info line each.
  # Two versions kept: a round whose version was pruned while the slow learner trained
  # (a newer one stood in for it) was not counted late, and the warning never came.
  run = mail.create(str(tmp_path / "run"), ms.params0(),
                    gmjax.DiLoCo(sync_every=8, adaptive_steps=True), keep_versions=2)
  # A grace of 30 polls (0.3 s), longer under load, that the slow one's 1.5 s steps
  # outlast; a quorum of two closes the rounds without it.
  _train_until_the_slow_one_stops(
      run, 0.01, [("fast", 0.01, None), ("fast-2", 0.01, None), ("slow", 1.5, 6)])
  warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
            and "rounds in a row closed before it got to them" in r.getMessage()]
  assert warned and all(m.startswith("learner 'slow'") for m in warned), warned
  assert "with adaptive steps" in warned[0] and "raise sync_every" in warned[0]
