"""Mail learners with ``outer_delay=1``: no wait at the round they just published.

A delayed learner's next phase needs only the round before, which had a whole phase to
land: with a peer that has not trained at all (and a quorum that needs it), it trains
two phases, where a DiLoCo learner is stuck at the end of its first.
"""

import time

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.core import payload
from gmjax.core.wire import Wire
from gmjax.mail import contributions, states
from gmjax.mail.errors import RoundTimeout

import mail_support as ms

H = 4


def _pair(tmp_path, **settings):
  config = gmjax.DiLoCo(sync_every=H, quorum_size=2, flush_on_close=False, **settings)
  run = mail.create(str(tmp_path / "run"), ms.params0(), config)
  learners = [run.join(name, poll_interval=ms.POLL, wait_timeout=1.5) for name in "ab"]
  params = [learner.pull(ms.params0()) for learner in learners]
  return run, learners, params


def _steps(learner, params, index, count):
  for _ in range(count):
    params = learner.step(ms.inner(params, ms.target(index)))
  return params


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eager", [False, True])
def test_a_delayed_learner_trains_on_while_its_round_is_open(tmp_path, eager):
  run, (a, b), (pa, pb) = _pair(tmp_path, outer_delay=1, eager=eager)
  try:
    # Two whole phases of a with b idle: round 0 cannot close (quorum 2) and a never
    # needed it.
    pa = _steps(a, pa, 0, 2 * H - 1)
    assert run.rounds() == [] and a.versions == {0: 0}
    pb = _steps(b, pb, 1, H)  # b's round 0 closes it
    pa = _steps(a, pa, 0, 1)  # a publishes round 1 and starts at Θ_1
    assert a.versions == {0: 1}
    pb = _steps(b, pb, 1, H)
    rounds = run.rounds()
    assert [r.round for r in rounds[:1]] == [0]
    assert sorted(p.learner for p in rounds[0].participants) == ["a", "b"]
    # Round 1's deltas were taken from the phases' start, Θ_0: base version 0.
    assert [base_version(run, 1, name) for name in "ab"] == [0, 0]
    theta = states.load_theta(run.store, run.commit(0, 1), 1 << 30)
    same = all(np.array_equal(np.asarray(pa[n]), v) for n, v in theta.items())
    # a's phase 3 starts at Θ_1 itself; eager, at Θ_1 plus its own correction.
    assert same != eager
  finally:
    for learner, params in ((a, pa), (b, pb)):
      learner.close(params)


def _close_quietly(*pairs):
  """Closes each (learner, params), ignoring a learner that fails to (the test is over)."""
  for learner, params in pairs:
    try:
      learner.close(params)
    except Exception:  # pylint: disable=broad-except
      pass


def base_version(run, round_, learner):
  path = f"rounds/{round_}/{learner}.safetensors"
  deadline = time.monotonic() + 30.0
  while not run.store.exists(path) and time.monotonic() < deadline:
    time.sleep(ms.POLL)  # the learner's worker uploads it in the background
  data = run.store.read(path, 1 << 20)
  return int(payload.loads(data)[1]["base_version"])


@pytest.mark.timeout(120)
def test_a_diloco_learner_waits_for_its_round(tmp_path):
  run, (a, b), (pa, pb) = _pair(tmp_path)
  try:
    pa = _steps(a, pa, 0, H - 1)
    with pytest.raises(RoundTimeout):
      _steps(a, pa, 0, 1)  # round 0 needs b, which has not trained
    # A step after it went on: round 0 was never waited for again, and the delta a
    # published next held more steps than a round allows (its own closer rejected it).
    with pytest.raises(mail.LearnerClosed, match=r"earlier step\(\) raised RoundTimeout"):
      _steps(a, pa, 0, 1)
    assert a.step_count == H
  finally:
    _close_quietly((a, pa), (b, pb))


def test_a_base_version_older_than_the_delay_allows_is_rejected():
  schema = gmjax.Schema.from_tree({"w": np.zeros(3, np.float32)})
  values = {"w": np.zeros(3, np.float32)}
  for base, lag, accepted in ((1, 1, True), (2, 1, True), (0, 1, False), (3, 1, False),
                              (1, 0, False)):
    data = contributions.dumps(values, learner="a", round_=2, fragment=0,
                               base_version=base, local_step=2, steps=2, tokens=2,
                               step_seconds=0.01, final=False, precision=None, key=None)
    check = lambda: contributions.check(
        data, file_name="a.safetensors", round_=2, fragment=0, base_version=2,
        schema=schema, wire=Wire(), known={"a"}, key=None, max_steps=4, base_lag=lag)
    if accepted:
      check()
    else:
      with pytest.raises(contributions.ContributionRejected, match="base_version"):
        check()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eager", [False, True])
def test_delayed_learners_flush_and_leave_on_the_newest_commit(tmp_path, eager):
  # Two learners train 1.5 phases past their last round and leave with flush_on_close:
  # the final deltas (taken from the phases' starts) commit, and both leave on that Θ.
  config = gmjax.DiLoCo(sync_every=H, quorum_size=2, outer_delay=1, eager=eager)
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), config)
  out = {}
  threads = ms.Threads()
  for m, name in enumerate("ab"):
    threads.start(ms.train, mail.open(url), name, m, 3 * H + H // 2, out=out)
  threads.join(timeout=100)
  run = mail.open(url)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2, 3]
  assert [sorted(p.learner for p in r.participants) for r in rounds] == [["a", "b"]] * 4
  assert all(p.steps == H // 2 for p in rounds[-1].participants)
  theta = states.load_theta(run.store, run.commit(0, 4), 1 << 30)
  for name in "ab":
    for leaf, value in theta.items():
      np.testing.assert_array_equal(np.asarray(out[name][leaf]), value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("settings", [
    dict(delta_precision="I4", error_feedback=1.0),
    dict(outer_delay=1, eager=True),
    dict(outer_delay=1, eager=True, delta_precision="I4", error_feedback=0.9),
], ids=["feedback", "eager", "eager-feedback"])
def test_a_delta_that_is_not_finite_raises_and_is_not_sent(tmp_path, settings):
  # The learner encodes these deltas itself (its residual or correction must follow the
  # bytes): a NaN delta raises ValueError at the step that publishes it, naming the leaf.
  run, (a, b), (pa, pb) = _pair(tmp_path, **settings)
  try:
    pa = _steps(a, pa, 0, H - 1)
    bad = ms.inner(pa, ms.target(0))
    bad["b"] = np.full_like(bad["b"], np.nan)
    with pytest.raises(ValueError, match="'b'"):
      a.step(bad)
    assert not run.store.exists("rounds/0/a.safetensors")
    # The step had counted and its round was never sent: the learner took further steps
    # and then waited for a commit that could not come (alone, until wait_timeout). It
    # fails as a learner whose publish fails: heartbeat failed, no more steps.
    with pytest.raises(mail.LearnerClosed, match=r"an earlier step\(\)'s delta was not finite"):
      a.step(pa)
    ms.wait_for(lambda: run.learners()["a"].status == "failed", 10, "a's failed heartbeat")
    a.close(pa)  # its final contributions are left out, with a warning
  finally:
    _close_quietly((a, pa), (b, pb))


@pytest.mark.timeout(120)
def test_an_eager_learner_whose_joined_version_was_pruned_publishes(tmp_path):
  # Its first round read its weight in the commit it joined at, pruned by then: step()
  # raised FileNotFoundError.
  config = gmjax.DiLoCo(sync_every=2, outer_delay=1, eager=True)
  run = mail.create(str(tmp_path / "run"), ms.params0(), config, keep_versions=2)
  a = run.join("a", poll_interval=ms.POLL, startup_timeout=2)
  pa = a.pull(ms.params0())
  for _ in range(6):
    pa = a.step(ms.inner(pa, ms.target(0)))
  b = run.join("b", poll_interval=ms.POLL, startup_timeout=2)
  pb = b.pull(ms.params0())
  joined = b.versions[0]
  for _ in range(40):  # b is slow to its first step; each of a's rounds waits for it
    pa = a.step(ms.inner(pa, ms.target(0)))
    if min(states.committed_versions(run.store, 0)) > joined:
      break
  assert min(states.committed_versions(run.store, 0)) > joined  # pruned
  for _ in range(4):
    pb = b.step(ms.inner(pb, ms.target(1)))
  assert b.versions[0] > joined
  for name, value in pb.items():
    assert np.all(np.isfinite(value)), name
  a.close(pa)
  b.close(pb)
