"""Committed states: Θ read alone and verified, followers that only list, retry budgets."""

import dataclasses

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import closer as closer_lib
from gmjax.mail import contributions
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import states

import mail_support as ms


def _run(tmp_path, **config):
  return mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2, **config))


def test_theta_file_matches_the_checkpoint(tmp_path):
  run = _run(tmp_path)
  record = run.commit(0, 0)
  assert record.theta == f"{record.state}/theta.safetensors"
  assert set(record.to_json()["sha256"]) == {"state", "update"}
  assert "theta.safetensors" not in record.state_files  # not one of Orbax's files
  theta = states.load_theta(run.store, record, 1 << 30)
  state = states.load_state(run.store, record, 1 << 30)
  assert sorted(theta) == sorted(state.theta)
  for name in theta:
    np.testing.assert_array_equal(theta[name], state.theta[name])
    assert theta[name].dtype == state.theta[name].dtype
  assert states.theta_digest(theta) == record.theta_sha256


def test_damaged_theta_file_sends_learners_to_the_checkpoint(tmp_path):
  run = _run(tmp_path)
  record = run.commit(0, 0)
  data = bytearray(run.store.get(record.theta))
  data[-1] ^= 1
  run.store.put(record.theta, bytes(data))
  for damaged in (record, dataclasses.replace(record, theta=None)):
    theta = states.load_theta(run.store, damaged, 1 << 30)
    for name, value in ms.params0().items():
      np.testing.assert_array_equal(theta[name], value)
  run.store.delete(record.theta)
  theta = states.load_theta(run.store, record, 1 << 30)
  np.testing.assert_array_equal(theta["a"], ms.params0()["a"])
  # The checkpoint is the state of record: damaged too, nothing is returned.
  state_file = sorted(record.state_files)[0]
  run.store.put(f"{record.state}/{state_file}", b"damaged")
  with pytest.raises(mail.CorruptRecord, match="sha256"):
    states.load_theta(run.store, record, 1 << 30)


def test_commit_precision_commits_carry_the_update_and_no_theta_file(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, commit_precision="F8_E4M3"))
  out = {}
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, mail.open(url), f"a{m}", m, 4, out=out)
  threads.join(timeout=100)
  run = mail.open(url)
  records = [run.commit(0, v) for v in (1, 2)]
  assert all(r.update and r.theta is None for r in records)
  for name in out["a0"]:
    np.testing.assert_array_equal(out["a0"][name], out["a1"][name])
  # A learner that joins now reads Θ from the checkpoint, checked against the record.
  newest = run.commit(0, max(run.newest_versions().values()))
  theta = states.load_theta(run.store, newest, 1 << 30)
  assert states.theta_digest(theta) == newest.theta_sha256


def test_follower_lists_and_validates_only_to_take_over(tmp_path):
  run = _run(tmp_path, quorum_size=2)
  names = run.plan[0]
  for index, learner in enumerate(("l0", "l1")):
    joined = run.join(learner, poll_interval=0.02)
    joined.close(joined.pull(ms.params0()))
    delta = {n: np.full(ms.params0()[n].shape, index + 1.0, np.float32) for n in names}
    run.store.put(layout.contribution(0, learner), contributions.dumps(
        delta, learner=learner, round_=0, fragment=0, base_version=0, local_step=2,
        steps=2, tokens=2, step_seconds=0.01, final=False, precision=None, key=None))
  run.store.put(layout.contribution(0, "l2"), b"not a payload")
  closer = closer_lib.Closer(run.store, run.manifest, None, "follower", 0.02)
  roster = heartbeats.Roster(run.store)
  roster.refresh()
  watch = closer.watch(0)
  closer.scan(watch, roster.known, validate=False)
  assert watch.found == {} and watch.contributors == {"l0", "l1", "l2"}
  closer.scan(watch, roster.known)
  assert watch.listed == set() and watch.contributors == {"l0", "l1"}  # l2's is rejected
  assert sorted(c.learner for c in watch.valid) == ["l0", "l1"]
  assert [r.learner for r in watch.rejected] == ["l2"]
  record = closer.close(watch, roster)
  assert [p.learner for p in record.participants] == ["l0", "l1"]
  assert record.rejected[0].learner == "l2"


def test_learner_retries_are_bounded_by_the_run_timeout(tmp_path):
  run = _run(tmp_path)
  learner = run.join("l0", poll_interval=0.02, startup_timeout=5.0)
  try:
    # Until its first round commits, the learner retries for startup_timeout ...
    assert learner.store.retry_budget() == pytest.approx(5.0)
    params = learner.pull(ms.params0())
    for _ in range(run.config.sync_every):
      params = learner.step(params)
    assert learner.versions == {0: 1}
    # ... and then for the run's timeout, which follows the rounds' estimates.
    estimates = run.rounds()[-1].estimates
    assert learner.store.retry_budget() == pytest.approx(estimates.timeout(0.02))
    assert run.store.retry_budget() == run.store.retry_seconds  # no learner: the default
  finally:
    learner.close(None)


def test_a_damaged_version_is_logged_once_not_at_every_poll(tmp_path, caplog):
  import logging  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  from gmjax.mail import commits  # pylint: disable=g-import-not-at-top

  run = _run(tmp_path)
  os.makedirs(os.path.join(str(tmp_path / "run"), layout.commit(0, 1)))  # a planted folder
  with caplog.at_level(logging.DEBUG, logger="gmjax.mail.commits"):
    for _ in range(5):  # a reader waiting for version 1 polls it
      with pytest.raises(commits.DamagedCommit, match="not a regular file"):
        commits.read_commit(run.store, 0, 1, None)
  levels = [r.levelno for r in caplog.records if "is damaged" in r.getMessage()]
  assert levels == [logging.WARNING] + [logging.DEBUG] * 4


def test_a_state_changed_after_its_check_is_not_what_is_restored(tmp_path, monkeypatch):
  # Whoever can write the run's folder swaps a checked checkpoint for another (and adds
  # files the record does not list) between the sha256 check and Orbax's restore: what
  # is restored must be the checked bytes, not the folder.
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2), key="k")
  record = states.read_commit(run.store, 0, 0, run.signing_key)
  good = states.load_state(run.store, record, 1 << 30)
  elsewhere = mail.store.LocalStore(str(tmp_path / "elsewhere"))
  evil = dataclasses.replace(good, theta={k: np.full_like(v, 1000.0) for k, v in good.theta.items()})
  stored = states.save_state(elsewhere, 0, evil, "evil")
  source = tmp_path / "elsewhere" / stored.state
  target = tmp_path / "run" / record.state
  checked = states._verified_file
  remaining = [len(record.state_files)]

  def swap_after_the_last_check(*args, **kwargs):
    data = checked(*args, **kwargs)
    remaining[0] -= 1
    if remaining[0] == 0:
      for path in source.rglob("*"):
        if path.is_file():
          (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
          (target / path.relative_to(source)).write_bytes(path.read_bytes())
    return data

  monkeypatch.setattr(states, "_verified_file", swap_after_the_last_check)
  restored = states.load_state(run.store, record, 1 << 30)
  assert remaining[0] == 0
  for name, value in good.theta.items():
    np.testing.assert_array_equal(restored.theta[name], value)
