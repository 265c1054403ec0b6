"""Learner names are unique among live learners; a closed, failed or dead one is free."""

import json

import pytest

import gmjax
from gmjax import mail
from gmjax.mail import layout

import mail_support as ms


def _run(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  return url


@pytest.mark.timeout(120)
def test_a_live_name_is_refused_and_a_closed_one_is_free(tmp_path):
  url = _run(tmp_path)
  first = mail.open(url).join("w0", poll_interval=ms.POLL)
  params = first.pull(ms.params0())
  with pytest.raises(mail.NameTaken, match="w0"):
    mail.open(url).join("w0", poll_interval=ms.POLL)
  assert isinstance(mail.NameTaken("x"), FileExistsError)
  first.close(params)
  again = mail.open(url).join("w0", poll_interval=ms.POLL)
  again.close(again.pull(ms.params0()))
  assert mail.open(url).learners()["w0"].status == "closed"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("status", ["failed", "live"])
def test_a_failed_or_dead_name_is_free(tmp_path, status):
  url = _run(tmp_path)
  run = mail.open(url)
  # A heartbeat left by a learner on another machine that stopped: failed, or live
  # but never rewritten again (dead once the liveness timeout passes unchanged).
  run.store.put(layout.heartbeat("w0"), json.dumps({
      "name": "w0", "status": status, "seq": 7, "pid": 1, "host": "elsewhere",
      "first_round": 0, "final_rounds": [], "step": 4}).encode())
  learner = run.join("w0", poll_interval=ms.POLL)
  learner.close(learner.pull(ms.params0()))
  assert run.learners()["w0"].status == "closed"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_processes_joining_as_one_name(tmp_path):
  url = _run(tmp_path)
  workers = [ms.spawn(url, "w0", index, 6) for index in range(2)]
  try:
    logs = [w.communicate(timeout=150)[0] for w in workers]
  finally:
    for w in workers:
      ms.kill(w)
  codes = sorted(w.returncode for w in workers)
  assert codes[0] == 0 and codes[1] != 0, logs
  loser = logs[[w.returncode for w in workers].index(codes[1])]
  assert "NameTaken" in loser and "closed" not in loser.splitlines()
  rounds = mail.open(url).rounds()
  assert [r.round for r in rounds] == [0, 1, 2]
  assert all([p.learner for p in r.participants] == ["w0"] for r in rounds)
