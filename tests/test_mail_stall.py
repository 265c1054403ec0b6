"""Survivors do not stall on a dead peer, and round 0 waits for a learner slow to start."""

import threading
import time

import pytest

import gmjax
from gmjax import mail
from gmjax.mail import closer as closer_lib
from gmjax.mail import layout
from gmjax.mail.heartbeats import Roster

import mail_support as ms


def test_follower_does_not_wait_on_a_designated_closer_that_sent_nothing():
  run = mail.create("memory://stall-follower", ms.params0(), gmjax.DiLoCo(sync_every=2))
  # Two live learners; "a" sorts first, so it is the designated closer of fragment 0.
  learners = [mail.open("memory://stall-follower").join(n, poll_interval=ms.POLL)
              for n in ("a", "b")]
  threads = ms.Threads()
  try:
    for learner in learners:
      learner.pull(ms.params0())
    # b publishes round 0 and waits for its commit; a sends nothing.
    threads.start(lambda: [learners[1].step(ms.params0()) for _ in range(2)])
    ms.wait_for(lambda: run.store.exists(layout.contribution(0, "b")), 30, "b's round 0")
    # A closer outside the learners, as b would decide (without a start-up timeout:
    # its grace period is the run's timeout, 30 polls).
    closer = closer_lib.Closer(run.store, run.manifest, None, "b", ms.POLL)
    roster = Roster(run.store)
    roster.refresh()
    watch = closer.watch(0)
    closer.scan(watch, roster.known)
    assert not closer.designated(watch, roster)
    assert not closer.decide(watch, roster)  # the quorum of one, in its grace period
    time.sleep(closer.grace() + 2 * ms.POLL)
    roster.refresh()  # a is still live: its heartbeat beats
    assert "a" in roster.live_for(0, closer.liveness_timeout())
    # Closable now; a, designated, has no contribution and does not watch the round:
    # b takes over at once instead of waiting another timeout for a.
    assert closer.decide(watch, roster)
  finally:
    learners[0].close(None)  # a leaves: b's own closer closes round 0 alone
    threads.join(timeout=60)
    learners[1].close(None)
  assert [p.learner for p in run.rounds()[0].participants] == ["b"]


POLL_S = 0.1  # the survivor's poll interval
MARGIN_POLLS = 20  # a loaded machine's closer may see a deadline a few polls late


def _train_timing_steps(run, name, steps, poll, blocked):
  """Trains ``steps`` steps and closes; ``blocked[step_count]``: the seconds of the
  ``step`` call that reached that global step."""
  learner = run.join(name, poll_interval=poll)
  params = learner.pull(ms.params0())
  goal = ms.target(0)
  for _ in range(steps):
    params = ms.inner(params, goal)
    started = time.monotonic()
    params = learner.step(params)
    blocked[learner.step_count] = time.monotonic() - started
  learner.close(params)


@pytest.mark.timeout(120)
def test_survivor_of_a_killed_peer_closes_alone_and_records_its_wait(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=None)
  # "a" sorts before "s": the designated closer of every round while it is live. It
  # steps slowly, so it is killed between its rounds: after round 1 commits, before it
  # contributes to round 2.
  victim = ms.spawn(url, "a", 1, 10_000, step_sleep=0.4)
  try:
    ms.wait_for(lambda: run.store.exists(layout.heartbeat("a")), 60, "a to join")
    blocked, threads = {}, ms.Threads()
    # s polls every 0.1 s: its grace is 30 polls (3 s) and a dead learner stays live
    # for it 50 polls (5 s) after its last heartbeat, so the round after the kill
    # reaches the end of its grace while "a" still counts as live.
    threads.start(_train_timing_steps, mail.open(url), "s", 16, POLL_S, blocked)
    ms.wait_for(lambda: run.store.exists(layout.commit(0, 2)), 60, "round 1's commit")
    ms.kill(victim)
    threads.join(timeout=90)
  finally:
    ms.kill(victim)
  rounds = run.rounds()
  assert [r.round for r in rounds] == list(range(8))
  after = [r for r in rounds if r.round >= 2]
  assert all([p.learner for p in r.participants] == ["s"] for r in after)
  assert all(r.closer == "s" for r in after)
  schedule = run.manifest.schedule
  for r in after:
    assert None not in (r.wait_seconds, r.grace_seconds, r.takeover_seconds)
    assert r.wait_seconds >= r.quorum_seconds
    # The record shows no more than the real wait: s's closer opened the round after s
    # published it, inside the step that then waited for its commit (overlap_steps=0).
    assert r.wait_seconds <= blocked[schedule.step_of(r.round)], (r.round, blocked)
  # Rounds closed while the dead "a" still counted as live: s waited out the grace
  # period (the stall shows in the record), then closed at once, though "a" was the
  # designated closer: it had sent nothing, so it was not watching the round.
  stalled = [r for r in after if "a" in r.live]
  assert stalled, [(r.round, r.live) for r in after]
  for r in stalled:
    assert r.grace_seconds > 0 and r.wait_seconds >= r.grace_seconds
    assert r.takeover_seconds < r.grace_seconds, (r.round, r.grace_seconds,
                                                  r.takeover_seconds)
    # s stalled no longer than the run's timeout (the grace period: the timeout of the
    # newest record's estimates before the round) and the polls the closer takes to see
    # it run out: no second timeout (a takeover, the dead peer's liveness) stacked on it.
    timeout = max(q.estimates.timeout(POLL_S) for q in rounds if q.round < r.round)
    bound = timeout + MARGIN_POLLS * POLL_S
    assert r.grace_seconds <= bound and r.wait_seconds <= bound, (
        r.round, r.wait_seconds, r.grace_seconds, timeout)


@pytest.mark.timeout(120)
def test_round_0_waits_for_a_learner_slow_to_start(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=None)
  joined = threading.Event()
  out, threads = {}, ms.Threads()

  def slow():
    learner = mail.open(url).join("slow", poll_interval=ms.POLL)
    params = learner.pull(ms.params0())
    joined.set()
    # Its first step takes ten times the run's first timeout (30 polls): a compile
    # under load. Its heartbeat keeps beating meanwhile.
    time.sleep(10 * 30 * ms.POLL)
    goal = ms.target(1)
    for _ in range(4):
      params = learner.step(ms.inner(params, goal))
    out["slow"] = learner.close(params)

  threads.start(slow)
  assert joined.wait(60)
  threads.start(ms.train, mail.open(url), "fast", 0, 4, out=out)
  threads.join(timeout=90)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1]
  assert [p.learner for p in rounds[0].participants] == ["fast", "slow"]
  assert rounds[0].live == ("fast", "slow")
  # Whoever closed it saw the quorum of one long before the round was complete.
  assert rounds[0].wait_seconds >= rounds[0].quorum_seconds > 0
