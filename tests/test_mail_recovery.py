"""Durability and recovery: synced states, damaged newest versions, orphaned states."""

import os
import threading

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.core.aggregator import DiLoCoAggregator
from gmjax.mail import commits
from gmjax.mail import layout
from gmjax.mail import states

import mail_support as ms


def _train(url, names, steps, key=None, first=0):
  # Every learner joins and pulls before any steps: one that joined late could find a
  # round re-closed without it (from the others' and the earlier contributions) and
  # train on past the rounds the test counts.
  out = {}
  threads = ms.Threads()
  together = threading.Barrier(len(names), timeout=60)
  for m, name in enumerate(names):
    threads.start(ms.train, mail.open(url, key=key), name, first + m, steps, out=out,
                  together=together)
  threads.join(timeout=100)
  return out


def _config():
  return gmjax.DiLoCo(sync_every=2, quorum_size=2, flush_on_close=False)


def _intact_versions(run):
  return [r.version for r in run.rounds()]


def test_state_files_and_directories_are_synced_before_the_commit(tmp_path, monkeypatch):
  run = mail.create(str(tmp_path / "run"), ms.params0(), _config())
  synced = []
  real_fsync = os.fsync

  def recording_fsync(fd):  # the real fsync, noting what it synced
    synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
    real_fsync(fd)

  monkeypatch.setattr(os, "fsync", recording_fsync)
  state = DiLoCoAggregator(run.config, run.schema.subset(run.plan[0])).initial_state(
      ms.params0())
  files = states.save_state(run.store, 0, state, "synced")
  target = os.path.join(run.store.local_root, *files.state.split("/"))
  directories = [root for root, _, _ in os.walk(target)] + [os.path.dirname(target)]
  written = [os.path.join(target, *f.split("/")) for f in files.state_files]
  assert len(directories) >= 2 and written
  for path in directories + written:
    assert os.path.realpath(path) in synced, path


def test_damaged_newest_commit_costs_one_round_and_commits_once(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), _config(), key="k")
  _train(url, ["a0", "a1"], 4, key="k")
  assert _intact_versions(run) == [1, 2]
  newest = layout.commit(0, 2)
  size = len(run.store.get(newest))
  run.store.put(newest, b"\0" * size)  # zeroed in place
  assert _intact_versions(run) == [1]  # rounds() skips it instead of raising
  assert run.newest_versions() == {0: 1}
  assert [p for p in mail.verify(url, key="k") if "2.commit.json" in p]
  # New learners pull version 1, redo round 1 (version 2) and go on.
  _train(url, ["b0", "b1"], 4, key="k")
  assert _intact_versions(run) == [1, 2, 3]
  record = run.commit(0, 2)
  assert record.extra["supersedes"] == [newest]
  # Re-closed from the round's contributions: the new learners' and the earlier ones'.
  assert {p.learner for p in record.participants} >= {"b0", "b1"}
  assert run.store.exists(layout.commit_slot(0, 2, 1))
  assert not run.store.exists(layout.commit_slot(0, 2, 2))  # exactly one new record


def test_planted_record_does_not_stop_a_keyed_run(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), _config(), key="k")
  run.store.put(layout.commit(0, 1), b'{"version": 1, "fragment": 0, "round": 0}')
  out = _train(url, ["a0", "a1"], 4, key="k")
  assert _intact_versions(run) == [1, 2]
  assert run.commit(0, 1).extra["supersedes"] == [layout.commit(0, 1)]
  for name in out["a0"]:
    np.testing.assert_array_equal(out["a0"][name], out["a1"][name])


def test_deleted_newest_commit_is_redone(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), _config())
  _train(url, ["a0", "a1"], 4)
  run.store.delete(layout.commit(0, 2))
  assert run.newest_versions() == {0: 1}
  _train(url, ["b0", "b1"], 2)
  assert _intact_versions(run) == [1, 2]
  assert {p.learner for p in run.commit(0, 2).participants} >= {"b0", "b1"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["zeroed", "deleted"])
def test_a_damaged_commit_older_than_another_fragments_newest_is_redone(tmp_path, damage):
  # Fragment 0's newest record (round 2) damaged or deleted after fragment 1's newer one
  # (round 3) committed: learners that joined started after round 3, so none
  # contributed to round 2 again, and each waited for its version until it timed out
  # (RoundTimeout), however often it joined again.
  url = str(tmp_path / "run")
  config = gmjax.DiLoCo(sync_every=2, fragments=2, quorum_size=2, flush_on_close=False)
  run = mail.create(url, ms.params0(), config, key="k")
  _train(url, ["a0", "a1"], 4, key="k")
  assert [(r.round, r.fragment, r.version) for r in run.rounds()] == [
      (0, 0, 1), (1, 1, 1), (2, 0, 2), (3, 1, 2)]
  newest = layout.commit(0, 2)
  if damage == "zeroed":
    run.store.put(newest, b"\0" * len(run.store.get(newest)))
  else:
    run.store.delete(newest)
  assert run.newest_versions() == {0: 1, 1: 2}
  out = {}
  threads = ms.Threads()
  together = threading.Barrier(2, timeout=60)
  for m, name in enumerate(["b0", "b1"]):
    threads.start(ms.train, mail.open(url, key="k"), name, m, 4, out=out,
                  together=together, wait_timeout=15.0)
  threads.join(timeout=100)
  assert sorted(out) == ["b0", "b1"]
  assert {p.learner for p in run.commit(0, 2).participants} >= {"b0", "b1"}
  assert run.newest_versions()[0] >= 3 and mail.verify(url, key="k") == []


@pytest.mark.timeout(40)
def test_version_zeros_record_deleted_before_its_first_round_stops_the_learner_at_once(
    tmp_path):
  # Its learners waited out their wait_timeout (a minute here) for a version no round
  # could commit, then blamed the other learners' liveness.
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("w", poll_interval=ms.POLL, wait_timeout=60.0)
  params = learner.pull(ms.params0())
  run.store.delete(layout.commit(0, 0))
  with pytest.raises(mail.LearnerClosed, match="0.commit.json is gone from the run's"
                     " storage.*restore that file or create the run again"):
    for _ in range(2):
      params = learner.step(ms.inner(params, ms.target(0)))
    learner.close(params)  # waits for the round's commit
  with pytest.raises(mail.LearnerClosed):
    learner.close(params)  # leaves now: nothing is left to close at exit
  assert run.learners()["w"].status == "failed"


def test_zeroed_newest_state_is_repaired_from_the_version_before(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), _config())
  _train(url, ["a0", "a1"], 4)
  before = states.load_theta(run.store, run.commit(0, 1), 1 << 30)
  damaged = run.commit(0, 2)
  for relfile in damaged.state_files:
    path = f"{damaged.state}/{relfile}"
    run.store.put(path, b"\0" * len(run.store.get(path)))
  run.store.put(damaged.theta, b"\0" * 64)
  learner = mail.open(url).join("late")
  params = learner.pull(ms.params0())  # no CorruptRecord: version 2 is superseded
  learner.close(params)
  for name, value in before.items():
    np.testing.assert_array_equal(params[name], value)
  repaired = run.commit(0, 2)
  assert repaired.extra["repair"]["from_version"] == 1 and repaired.extra["supersedes"] == [
      layout.commit(0, 2)]
  np.testing.assert_array_equal(states.load_state(run.store, repaired, 1 << 30).theta["a"],
                                before["a"])
  _train(url, ["b0", "b1"], 2)  # the next closer builds on the repaired version
  assert _intact_versions(run) == [1, 2, 3]
  assert mail.verify(url) == []  # the damaged record is superseded, not in force


def test_orphaned_states_are_removed(tmp_path, monkeypatch):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), _config())
  state = DiLoCoAggregator(run.config, run.schema.subset(run.plan[0])).initial_state(
      ms.params0())
  orphan = states.save_state(run.store, 0, states.FragmentState(1, state.theta, state.outer),
                             "0rphan000000").state
  monkeypatch.setattr(commits, "ORPHAN_SWEEP_EVERY", 2)
  _train(url, ["a0", "a1"], 6)  # versions 1..3; the commit of version 2 sweeps version 0
  assert run.store.list(orphan)  # version 1 is not swept yet
  _train(url, ["b0", "b1"], 2)  # the commit of version 4 sweeps versions 0..2
  assert _intact_versions(run) == [1, 2, 3, 4]
  assert run.store.list(orphan) == []
  for version in (1, 2, 3, 4):
    record = run.commit(0, version)
    assert run.store.list(record.state)  # committed states stay
