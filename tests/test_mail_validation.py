"""Bad contributions planted in a run are rejected, recorded, and never reach the aggregate."""

import os
import threading

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import contributions

import mail_support as ms


def _payload(run, round_, learner, values=None, *, key=None, base_version=None):
  names = run.plan[0]
  values = values or {n: np.zeros(ms.params0()[n].shape, np.float32) for n in names}
  return contributions.dumps(
      values, learner=learner, round_=round_, fragment=0,
      base_version=round_ if base_version is None else base_version, local_step=2, steps=2,
      tokens=2, step_seconds=0.01, final=False, precision=None, key=key)


def _train_pair(url, key=None, steps=6):
  out = {}
  threads = ms.Threads()
  together = threading.Barrier(2, timeout=60)
  for m in range(2):
    threads.start(ms.train, mail.open(url, key=key), f"a{m}", m, steps, out=out,
                  together=together)
  threads.join(timeout=100)
  return out


@pytest.mark.timeout(120)
def test_planted_payloads_are_rejected_and_the_run_goes_on(tmp_path):
  config = gmjax.DiLoCo(sync_every=2, quorum_size=2)
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), config)
  for name in ("mole", "stale"):  # learners that joined and left
    mole = run.join(name, poll_interval=0.02)
    mole.close(mole.pull(ms.params0()))
  names = run.plan[0]
  nan = {n: np.full(ms.params0()[n].shape, np.nan, np.float32) for n in names}
  good = _payload(run, 1, "mole")
  planted = {
      "rounds/0/garbage.safetensors": os.urandom(300),
      "rounds/0/mole.safetensors": _payload(run, 0, "mole", nan),
      "rounds/0/intruder.safetensors": _payload(run, 0, "intruder"),
      "rounds/0/notes.txt": b"hello",
      "rounds/1/mole.safetensors": good[: len(good) - 7],
      "rounds/2/mole.safetensors": _payload(run, 2, "mole", {"w": np.ones(3, np.float32)}),
      "rounds/2/stale.safetensors": _payload(run, 2, "stale", base_version=0),
  }
  for path, data in planted.items():
    run.store.put(path, data)
  out = _train_pair(url)

  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2]
  reasons = {r.round: {x.learner: x.reason for x in r.rejected} for r in rounds}
  assert "never joined" in reasons[0]["garbage"]  # unread: its name never joined
  assert "NaN or Inf" in reasons[0]["mole"]
  assert "unknown learner" in reasons[0]["intruder"]
  assert "not a .safetensors" in reasons[0]["notes.txt"]
  assert "unreadable payload" in reasons[1]["mole"]
  assert "layout mismatch" in reasons[2]["mole"]
  assert "base_version 0, expected 2" in reasons[2]["stale"]
  for record in rounds:
    assert sorted(p.learner for p in record.participants) == ["a0", "a1"]

  clean = str(tmp_path / "clean")
  mail.create(clean, ms.params0(), config)
  expected = _train_pair(clean)
  for learner in ("a0", "a1"):
    for name in names:
      np.testing.assert_array_equal(out[learner][name], expected[learner][name])
  assert "garbage(unknown learner" in mail.format_status(run)


@pytest.mark.timeout(120)
def test_signed_run_rejects_unsigned_and_forged(tmp_path):
  config = gmjax.DiLoCo(sync_every=2, quorum_size=2)
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), config, key="right")
  for name in ("mole", "forger"):
    learner = run.join(name, poll_interval=0.02)
    learner.close(learner.pull(ms.params0()))
  run.store.put("rounds/0/mole.safetensors", _payload(run, 0, "mole"))
  run.store.put("rounds/0/forger.safetensors", _payload(run, 0, "forger", key=b"wrong"))
  _train_pair(url, key="right", steps=4)
  rounds = run.rounds()
  reasons = {x.learner: x.reason for x in rounds[0].rejected}
  assert reasons == {"mole": "bad or missing HMAC-SHA256 signature",
                     "forger": "bad or missing HMAC-SHA256 signature"}
  assert all(len(r.participants) == 2 for r in rounds)
  assert all("signature" in r.extra for r in (run.commit(0, 1), run.commit(0, 2)))


def test_rejection_is_a_value_error():
  error = mail.ContributionRejected("x", "why")
  assert isinstance(error, ValueError) and error.reason == "why" and "'x'" in str(error)
