"""Learners in separate processes that die: the run goes on, and commits stay unique."""

import os

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import layout

import mail_support as ms


def _commits(run):
  return [e for e in run.store.list("fragments/0") if layout.commit_version(e) is not None]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_learner_killed_mid_run(tmp_path):
  url = str(tmp_path / "run")
  # quorum_size=3: a round waits for every live learner; the dead one drops out of the
  # live set once its heartbeat is older than the run's timeout.
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=3),
                    keep_versions=None)  # every round's record is checked
  victim = ms.spawn(url, "victim", 2, 10_000, step_sleep=0.03)
  try:
    ms.wait_for(lambda: run.store.exists(layout.heartbeat("victim")), 60, "victim to join")
    out = {}
    threads = ms.Threads()
    for m in range(2):
      threads.start(ms.train, mail.open(url), f"a{m}", m, 20, out=out)
    ms.wait_for(lambda: run.store.exists(layout.contribution(2, "victim")), 60,
                "victim's round 2 contribution")
    ms.kill(victim)
    threads.join(timeout=120)
  finally:
    ms.kill(victim)
  rounds = run.rounds()
  assert [r.round for r in rounds] == list(range(10))
  with_victim = [r.round for r in rounds
                 if "victim" in {p.learner for p in r.participants}]
  assert with_victim[:3] == [0, 1, 2] and with_victim[-1] < 9
  assert all({"a0", "a1"} <= {p.learner for p in r.participants} for r in rounds)
  for name in out["a0"]:
    np.testing.assert_array_equal(out["a0"][name], out["a1"][name])
  assert len(_commits(run)) == 11  # versions 0..10, one record each


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_designated_closer_killed_before_commit(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=3),
                    keep_versions=None)  # every version's commit is checked
  # "a-closer" sorts first among the live learners, so it is fragment 0's designated
  # closer; it kills itself after aggregating and saving the state, before the commit.
  victim = ms.spawn(url, "a-closer", 2, 10_000, mode="die_before_commit", step_sleep=0.01)
  try:
    ms.wait_for(lambda: run.store.exists(layout.heartbeat("a-closer")), 60, "closer to join")
    out = {}
    threads = ms.Threads()
    for m in range(2):
      threads.start(ms.train, mail.open(url), f"b{m}", m, 8, out=out)
    threads.join(timeout=150)
    victim.wait(timeout=30)
    log = victim.stdout.read()
  finally:
    ms.kill(victim)
  assert "dying before commit" in log
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2, 3]
  assert {p.learner for p in rounds[0].participants} == {"a-closer", "b0", "b1"}
  assert all(r.closer in ("b0", "b1") for r in rounds)
  assert len(_commits(run)) == 5  # versions 0..4, exactly one commit each
  # The dead closer's state directory is an orphan no commit names.
  named = {run.commit(0, v).state.rsplit("/", 1)[-1] for v in range(5)}
  saved = {e for e in run.store.list("fragments/0") if os.path.isdir(os.path.join(url, "fragments", "0", e))}
  assert named < saved
  for name in out["b0"]:
    np.testing.assert_array_equal(out["b0"][name], out["b1"][name])
