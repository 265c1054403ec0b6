"""The roster judges a heartbeat it sees for the first time by the time it was written."""

import datetime
import json

from gmjax.mail import heartbeats
from gmjax.mail.store import open_store


def _beat(store, name, seconds_ago):
  when = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=seconds_ago)
  store.put(f"learners/{name}.json", json.dumps(
      {"name": name, "status": "live", "seq": 3, "step": 10,
       "last_seen": when.isoformat(timespec="milliseconds")}).encode())


def test_a_long_dead_learner_is_not_live_to_a_new_observer(tmp_path):
  # A learner that joins a long run finds the heartbeats of every learner that ever
  # died there; counting them as live made it wait for them and compile its closer for
  # all of them.
  store = open_store(str(tmp_path))
  for m in range(20):
    _beat(store, f"dead{m}", seconds_ago=3600)
  _beat(store, "alive", seconds_ago=0)
  roster = heartbeats.Roster(store)
  roster.refresh()
  assert roster.live_count(timeout=30.0) == 1
  assert roster.live_for(0, timeout=30.0) == {"alive"}


def test_a_heartbeat_without_a_readable_time_counts_from_when_it_is_seen(tmp_path):
  store = open_store(str(tmp_path))
  store.put("learners/w0.json", json.dumps({"name": "w0", "status": "live", "seq": 1}).encode())
  roster = heartbeats.Roster(store)
  roster.refresh()
  assert roster.live_count(timeout=30.0) == 1


def test_a_heartbeat_written_over_keeps_its_learner_until_it_goes_stale(tmp_path):
  # 4 bytes of junk over a live learner's heartbeat for half a second dropped it from
  # the roster at once: its contribution was rejected as "unknown learner: it never
  # joined the run", and the round closed without it.
  store = open_store(str(tmp_path))
  _beat(store, "b", seconds_ago=0)
  roster = heartbeats.Roster(store)
  roster.refresh()
  store.put("learners/b.json", b"\x00junk")
  roster.refresh()
  assert "b" in roster.bad and "b" in roster.known
  assert roster.live_for(0, timeout=30.0) == {"b"}
  assert roster.live_for(0, timeout=0.0) == set()  # an unchanged heartbeat goes stale
  store.put("learners/b.json", json.dumps(
      {"name": "b", "status": "live", "seq": 4, "step": 12}).encode())
  roster.refresh()
  assert roster.bad == {} and roster.records["b"]["seq"] == 4
  assert roster.live_for(0, timeout=30.0) == {"b"}


def test_a_contribution_read_while_its_heartbeat_was_bad_is_read_again_once_it_is_good(
    tmp_path):
  # A closer that first saw a learner while its heartbeat was written over rejected its
  # contribution unread ("never joined") and kept that verdict until the file changed:
  # the round closed without an honest learner's work.
  import numpy as np  # pylint: disable=g-import-not-at-top

  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax import mail  # pylint: disable=g-import-not-at-top
  from gmjax.mail import closer as closer_lib  # pylint: disable=g-import-not-at-top
  from gmjax.mail import contributions  # pylint: disable=g-import-not-at-top

  params = {"w": np.zeros((4, 8), np.float32)}
  run = mail.create(str(tmp_path / "run"), params, gmjax.DiLoCo(sync_every=2))
  joined = run.join("b", poll_interval=0.02)
  joined.close(joined.pull(params))
  good = run.store.read("learners/b.json", heartbeats.MAX_HEARTBEAT_BYTES)
  run.store.put("rounds/0/b.safetensors", contributions.dumps(
      {"w": np.ones((4, 8), np.float32)}, learner="b", round_=0, fragment=0,
      base_version=0, local_step=2, steps=2, tokens=2, step_seconds=0.01, final=False,
      precision=None, key=None))
  run.store.put("learners/b.json", b"\x00junk")
  closer = closer_lib.Closer(run.store, run.manifest, None, "c", 0.02)
  roster = heartbeats.Roster(run.store)
  roster.refresh()
  watch = closer.watch(0)
  closer.scan(watch, roster.known)
  assert [r.reason for r in watch.rejected] == [contributions.UNKNOWN]
  run.store.put("learners/b.json", good)
  roster.refresh()
  closer.scan(watch, roster.known)
  assert [c.learner for c in watch.valid] == ["b"] and watch.rejected == []
