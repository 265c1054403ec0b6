"""Old signed heartbeats of a dead learner, written back alternately, neither keep it live
for the closer nor hold its name."""

import datetime
import json
import threading
import time

import pytest

import gmjax
from gmjax import mail
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import names

import mail_support as ms

KEY = "replay-secret"


def _dead_learner(run):
  """Claims ``ghost`` and returns two of its live heartbeats, signed, from a while ago."""
  incarnation = "f" * 32
  names.claim(run.store, "ghost", incarnation=incarnation, liveness_timeout=0.0,
              poll_interval=ms.POLL, key=run.signing_key)
  then = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=10)
  return [heartbeats.dumps({
      "name": "ghost", "incarnation": incarnation, "pid": 1, "host": "elsewhere",
      "status": heartbeats.LIVE, "seq": seq, "step": 0, "first_round": 0,
      "final_rounds": [], "versions": {},
      "last_seen": (then + datetime.timedelta(seconds=seq)).isoformat()},
      run.signing_key) for seq in (5, 6)]


class Replay:
  """Writes the heartbeats back in turn, one every poll, until stopped."""

  def __init__(self, run, beats):
    self.stop = threading.Event()

    def replay():
      for turn in range(10**6):
        if self.stop.wait(ms.POLL):
          return
        run.store.put(layout.heartbeat("ghost"), beats[turn % 2])

    self.thread = threading.Thread(target=replay, daemon=True)

  def __enter__(self):
    self.thread.start()
    return self

  def __exit__(self, *exc):
    self.stop.set()
    self.thread.join()


def _run(tmp_path):
  return mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2),
                     key=KEY)


def test_replayed_heartbeats_never_make_a_dead_learner_live(tmp_path):
  run = _run(tmp_path)
  roster = heartbeats.Roster(run.store, run.signing_key)
  timeout = 0.3
  with Replay(run, _dead_learner(run)):
    started = time.monotonic()
    while time.monotonic() - started < 3 * timeout:
      roster.refresh()
      time.sleep(ms.POLL / 2)
  assert roster.records["ghost"]["seq"] == 6  # the newest seen stands, not a replay
  assert not roster.fresh("ghost", timeout)
  assert roster.live_for(0, timeout) == set()


@pytest.mark.timeout(120)
def test_replayed_heartbeats_do_not_hold_a_name(tmp_path):
  run = _run(tmp_path)
  with Replay(run, _dead_learner(run)):
    learner = mail.open(run.url, key=KEY).join("ghost", poll_interval=ms.POLL)
  learner.close(learner.pull(ms.params0()))
  assert run.learners()["ghost"].status == "closed"


def test_an_observer_that_starts_during_a_replay_never_sees_the_learner_live(tmp_path):
  run = _run(tmp_path)
  beats = _dead_learner(run)
  with Replay(run, beats):
    for _ in range(3):  # observers (restarted learners) that start at different turns
      roster = heartbeats.Roster(run.store, run.signing_key)
      for _ in range(6):
        roster.refresh()
        assert not roster.fresh("ghost", 60.0)
        time.sleep(ms.POLL)


def _beats_of(run, incarnation, claim, seqs, claimed_at=None):
  dated = {} if claimed_at is None else {"claimed_at": claimed_at}
  return [heartbeats.dumps({
      "name": "w", "incarnation": incarnation, "claim": claim, "pid": 1, "host": "h",
      "status": heartbeats.LIVE, "seq": seq, "step": 0, "first_round": 0,
      "final_rounds": [], "versions": {}, "last_seen": "2026-01-01T00:00:00+00:00",
      **dated}, run.signing_key) for seq in seqs]


def test_an_older_incarnations_heartbeats_in_order_do_not_supersede_a_live_one(tmp_path):
  # Recorded in order, an older incarnation's heartbeats rise when written back; with a
  # claim planted for it, a live learner that met them after a pause stopped.
  run = _run(tmp_path)
  claimed = {}
  for incarnation in ("a" * 32, "b" * 32):  # two joins of w: b is live
    claimed[incarnation] = names.claim(run.store, "w", incarnation=incarnation,
                                       liveness_timeout=0.0, poll_interval=ms.POLL,
                                       key=run.signing_key)
  assert claimed == {"a" * 32: 1, "b" * 32: 2}
  for older, claim, stops in (("a" * 32, 1, False), ("c" * 32, 3, True)):
    run.store.put("learners/w.claims/3", older.encode())  # planted, or a newer join's
    seen, verdicts = {}, []
    for beat in _beats_of(run, older, claim, range(1, names.ALIVE_BEATS + 2)):
      run.store.put(layout.heartbeat("w"), beat)
      verdicts.append(names.superseded(run.store, "w", "b" * 32, run.signing_key, seen,
                                       claimed["b" * 32]))
    assert any(verdicts) == stops, (older, verdicts)
  assert heartbeats.Heartbeat.from_json(heartbeats.parse(
      "w", _beats_of(run, "c" * 32, 3, [1])[0], run.signing_key)).claim == 3
  with pytest.raises(heartbeats.BadHeartbeat, match="claim"):
    heartbeats.parse("w", _beats_of(run, "c" * 32, -1, [1])[0], run.signing_key)


def test_a_learners_heartbeats_name_its_claim(tmp_path):
  run = _run(tmp_path)
  for expected in (1, 2):
    learner = run.join("w", poll_interval=ms.POLL)
    assert heartbeats.read_one(run.store, "w", run.signing_key)["claim"] == expected
    learner.close(learner.pull(ms.params0()))


def test_heartbeats_that_name_no_claim_do_not_supersede_a_learner_that_has_one(tmp_path):
  # Written back in order, with a claim planted for them: the same replay, from a gmjax
  # that wrote no claim into heartbeats.
  run = _run(tmp_path)
  for incarnation in ("a" * 32, "b" * 32):
    names.claim(run.store, "w", incarnation=incarnation, liveness_timeout=0.0,
                poll_interval=ms.POLL, key=run.signing_key)
  run.store.put("learners/w.claims/3", ("a" * 32).encode())
  seen = {}
  for seq in range(1, names.ALIVE_BEATS + 2):
    record = heartbeats.parse("w", _beats_of(run, "a" * 32, 1, [seq])[0], run.signing_key)
    del record["claim"], record["signature"]
    run.store.put(layout.heartbeat("w"), heartbeats.dumps(record, run.signing_key))
    assert names.superseded(run.store, "w", "b" * 32, run.signing_key, seen, 2) is None


def test_a_claim_planted_at_the_last_number_is_named_not_claimed_past(tmp_path):
  # The join claimed 2**53, which no reader counts, and its own heartbeats, naming it,
  # failed every reader's check.
  run = _run(tmp_path)
  run.store.put(f"learners/w.claims/{2**53 - 1}", b"x" * 32)
  with pytest.raises(mail.NameTaken, match=rf"claim {2**53 - 1}.*planted.*delete"):
    run.join("w", poll_interval=ms.POLL)
  assert run.store.list("learners/w.claims") == [str(2**53 - 1)]


def test_a_loss_past_a_floats_range_is_a_bad_heartbeat(tmp_path):
  run = _run(tmp_path)
  record = heartbeats.parse("w", _beats_of(run, "a" * 32, 1, [1])[0], run.signing_key)
  del record["signature"]
  for loss, ok in ((10**400, False), (-(10**400), False), (float("inf"), True),
                   (float("nan"), True), (3, True)):
    data = heartbeats.dumps(dict(record, loss=loss), run.signing_key)
    if ok:
      heartbeats.parse("w", data, run.signing_key)
    else:
      with pytest.raises(heartbeats.BadHeartbeat, match="loss"):
        heartbeats.parse("w", data, run.signing_key)
  run.store.put(layout.heartbeat("w"), heartbeats.dumps(dict(record, loss=10**400),
                                                        run.signing_key))
  # gmjax status raised OverflowError on it; it is a damaged heartbeat now.
  assert "learners/w.json: loss=" in mail.format_status(mail.open(run.url, key=KEY))


def test_a_learner_whose_claims_the_closer_deleted_is_superseded_by_a_later_claim(tmp_path):
  # Paused past the closer's judgement, a learner's name was compacted (heartbeat and
  # every claim), and a new join claimed 1: below the paused learner's 2, its rising
  # heartbeats did not stop it, and both ran as one name for good. The new claim is
  # later by the storage's clock, which both heartbeats carry, signed.
  run = _run(tmp_path)
  dates = {}
  for number, incarnation in enumerate(("a" * 32, "b" * 32), 1):  # b is paused
    assert names.claim(run.store, "w", incarnation=incarnation, liveness_timeout=0.0,
                       poll_interval=ms.POLL, key=run.signing_key) == number
    dates[incarnation] = names.claimed_at(run.store, "w", number)
  assert dates["a" * 32] < dates["b" * 32]
  beats_of_a = _beats_of(run, "a" * 32, 1, range(1, names.ALIVE_BEATS + 2), dates["a" * 32])
  # A replay of a's heartbeats, with b's claim deleted and a claim planted for a, does
  # not stop b: a's claim is older by number and by date.
  run.store.delete("learners/w.claims/2")
  run.store.put("learners/w.claims/3", b"a" * 32)
  seen = {}
  for beat in beats_of_a:
    run.store.put(layout.heartbeat("w"), beat)
    assert names.superseded(run.store, "w", "b" * 32, run.signing_key, seen, 2,
                            dates["b" * 32]) is None
  run.store.delete(layout.heartbeat("w"))
  run.store.delete("learners/w.claims")  # the closer's compaction of a dead name
  time.sleep(0.01)
  assert names.claim(run.store, "w", incarnation="c" * 32, liveness_timeout=0.0,
                     poll_interval=ms.POLL, key=run.signing_key) == 1
  dates["c" * 32] = names.claimed_at(run.store, "w", 1)
  seen, verdicts = {}, []
  for beat in _beats_of(run, "c" * 32, 1, range(1, names.ALIVE_BEATS + 2), dates["c" * 32]):
    run.store.put(layout.heartbeat("w"), beat)
    verdicts.append(names.superseded(run.store, "w", "b" * 32, run.signing_key, seen, 2,
                                     dates["b" * 32]))
  assert verdicts[-1] is not None and "taken by a newer join" in str(verdicts[-1])
  # The new join itself is not stopped by b's heartbeats (b's claim is not the newest).
  seen = {}
  for beat in _beats_of(run, "b" * 32, 2, range(1, names.ALIVE_BEATS + 2), dates["b" * 32]):
    run.store.put(layout.heartbeat("w"), beat)
    assert names.superseded(run.store, "w", "c" * 32, run.signing_key, seen, 1,
                            dates["c" * 32]) is None


def test_a_learners_heartbeats_carry_its_claims_date(tmp_path):
  run = _run(tmp_path)
  learner = run.join("w", poll_interval=ms.POLL)
  record = heartbeats.read_one(run.store, "w", run.signing_key)
  assert record["claimed_at"] == names.claimed_at(run.store, "w", 1) is not None
  learner.close(learner.pull(ms.params0()))


def test_a_heartbeat_of_an_earlier_join_written_back_does_not_end_a_live_learner(tmp_path):
  # The signed heartbeat a1 wrote when it closed after its first join, written back
  # over its live one: an observer took a1 for closed (no bad heartbeat recorded), and
  # rounds closed without its contributions until its next beat.
  run = _run(tmp_path)
  learner = run.join("a1", poll_interval=ms.POLL)
  learner.close(learner.pull(ms.params0()))
  old = run.store.read(layout.heartbeat("a1"), heartbeats.MAX_HEARTBEAT_BYTES)
  learner = run.join("a1", poll_interval=1.0)  # beats seconds apart: none in between
  params = learner.pull(ms.params0())
  try:
    roster = heartbeats.Roster(run.store, run.signing_key)
    roster.refresh()
    assert roster.records["a1"]["status"] == heartbeats.LIVE
    live = roster.records["a1"]
    run.store.put(layout.heartbeat("a1"), old)
    roster.refresh()
    assert roster.records["a1"]["status"] == heartbeats.LIVE
    assert roster.records["a1"]["claim"] == live["claim"] > json.loads(old)["claim"]
    assert roster.records["a1"]["claimed_at"] > json.loads(old)["claimed_at"]
    assert roster.live_for(0, 5.0) == {"a1"}
  finally:
    learner.close(params)


def test_a_name_joined_again_after_its_claims_were_compacted_is_seen(tmp_path):
  # Its claims deleted, a name's next join claims number 1 again: an observer that had
  # seen claim 2 took the new join's heartbeats for an earlier join's, and the live
  # learner for closed. Claims are ordered by their dates, which do not start again.
  run = _run(tmp_path)
  roster = heartbeats.Roster(run.store, run.signing_key)
  for _ in range(2):
    learner = run.join("x", poll_interval=ms.POLL)
    learner.close(learner.pull(ms.params0()))
  roster.refresh()
  assert roster.records["x"]["claim"] == 2 and roster.records["x"]["status"] == "closed"
  for entry in run.store.list("learners/x.claims"):
    run.store.delete(f"learners/x.claims/{entry}")
  run.store.delete_empty_folder("learners/x.claims")
  time.sleep(1.1)  # storage dates of a local folder may be whole seconds
  learner = run.join("x", poll_interval=1.0)
  params = learner.pull(ms.params0())
  try:
    roster.refresh()
    assert roster.records["x"]["claim"] == 1 and roster.records["x"]["status"] == "live"
    assert roster.live_for(0, 5.0) == {"x"}
  finally:
    learner.close(params)
