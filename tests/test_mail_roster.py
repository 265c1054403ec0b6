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
