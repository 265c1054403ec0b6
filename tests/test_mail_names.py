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
def test_a_name_that_beats_slower_than_the_joiner_polls_is_still_taken(tmp_path):
  # The holder polls every 0.5 s, so it beats every 2.5 s; the joiner, polling every
  # 0.05 s, watched it for its own liveness timeout (2.5 s), saw too few beats, and
  # took the name of a live learner.
  url = _run(tmp_path)
  first = mail.open(url).join("w0", poll_interval=0.5)
  params = first.pull(ms.params0())
  with pytest.raises(mail.NameTaken, match="w0"):
    mail.open(url).join("w0", poll_interval=ms.POLL)
  first.close(params)


def test_a_learner_is_live_for_ten_of_its_own_beats(tmp_path):
  # An observer that polls more often than a learner beats dropped it between beats:
  # rounds closed without it.
  from gmjax.mail import heartbeats  # pylint: disable=g-import-not-at-top

  run = mail.open(_run(tmp_path))
  for name, beat in (("slow", 1.0), ("old", None), ("hostile", 1e9)):
    record = {"name": name, "status": "live", "seq": 1, "incarnation": name,
              **({} if beat is None else {"beat_seconds": beat})}
    run.store.put(layout.heartbeat(name), json.dumps(record).encode())
  roster = heartbeats.Roster(run.store)
  roster.refresh()
  assert heartbeats.liveness(roster.records["slow"], 2.5) == 10.0
  assert heartbeats.liveness(roster.records["old"], 2.5) == 2.5
  assert heartbeats.liveness(roster.records["hostile"], 2.5) == 600.0  # a minute a beat
  assert heartbeats.liveness(None, 2.5) == 2.5
  roster._changed = {n: roster._changed[n] - 5.0 for n in roster._changed}  # pylint: disable=protected-access
  assert roster.fresh("slow", 2.5) and not roster.fresh("old", 2.5)
  assert roster.live_for(0, 2.5) == {"slow", "hostile"}


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


@pytest.mark.timeout(120)
def test_a_paused_learner_whose_name_was_taken_stops_at_its_next_beat(tmp_path):
  # Paused past the liveness timeout while another joined as its name, it resumed and
  # both ran as one name, each overwriting the other's heartbeat and contributions.
  import time  # pylint: disable=g-import-not-at-top
  from gmjax.mail import heartbeats  # pylint: disable=g-import-not-at-top

  url = _run(tmp_path)
  first = mail.open(url).join("w0", poll_interval=ms.POLL)
  params = first.pull(ms.params0())
  first._beats.stop()  # pylint: disable=protected-access  # paused: its heartbeat stops
  second = mail.open(url).join("w0", poll_interval=ms.POLL)  # free once it looks dead
  second_params = second.pull(ms.params0())
  newer = heartbeats.read_one(second.store, "w0")["incarnation"]
  with pytest.raises(mail.NameTaken, match=r"'w0' was taken by a newer join"):
    for _ in range(40):  # its beats after the silence, until it has seen the newer rise
      first._beats.write().result()  # pylint: disable=protected-access
      time.sleep(0.3)
  with pytest.raises(mail.NameTaken, match=r"taken by a newer join"):
    first.step(params)
  first.close(params)  # cleans up, and writes nothing under the name
  record = heartbeats.read_one(second.store, "w0")
  assert (record["incarnation"], record["status"]) == (newer, "live")
  second_params = second.step(second_params)
  second.close(second_params)
  assert heartbeats.read_one(second.store, "w0")["status"] == "closed"


@pytest.mark.timeout(120)
def test_an_old_heartbeat_written_back_with_a_planted_claim_stops_no_learner(tmp_path):
  # A heartbeat of an earlier incarnation, signed, written back with a claim planted
  # for it (claims are not signed): one replay never rises, so the live learner goes on.
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), key="k")
  run = mail.open(url, key="k")
  earlier = run.join("w0", poll_interval=ms.POLL)
  earlier.pull(ms.params0())
  recorded = run.store.get(layout.heartbeat("w0"))  # live, signed
  old = json.loads(recorded)["incarnation"]
  earlier.close(None)
  learner = run.join("w0", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  learner._beats._written = (0.0, 0.0)  # pylint: disable=protected-access  # a silence
  for _ in range(3):
    run.store.put(layout.heartbeat("w0"), recorded)
    run.store.put("learners/w0.claims/9999", old.encode())
    learner._beats.write().result()  # pylint: disable=protected-access
  params = learner.step(params)
  learner.close(params)
  assert run.learners()["w0"].status == "closed"
