"""Heartbeats: each learner's ``learners/<name>.json``, and who counts as live.

A learner rewrites its heartbeat every few poll intervals from a background thread, with
an increasing ``seq``. An observer never compares wall clocks across machines: it
notes, on its own monotonic clock, when it last saw each learner's ``seq`` change, and
holds a learner dead once that is older than the run's timeout.

Who is live for round ``r``: a ``live`` learner whose ``first_round <= r``, and a
``closing`` learner for the rounds in its ``final_rounds``; in both cases only while its
heartbeat is fresh.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from gmjax.mail import layout
from gmjax.mail.store import Store

log = logging.getLogger(__name__)

LIVE, CLOSING, CLOSED = "live", "closing", "closed"
# A learner whose background work failed: not live, like a closed one.
FAILED = "failed"


def read_all(store: Store) -> dict[str, dict[str, Any]]:
  """Every learner's heartbeat by name; unreadable ones are skipped (and logged)."""
  records = {}
  for entry in store.list("learners"):
    if not entry.endswith(".json"):
      continue
    name = entry[: -len(".json")]
    if not layout.is_valid_name(name):
      continue
    try:
      record = json.loads(store.get(layout.heartbeat(name)))
    except FileNotFoundError:
      continue  # removed between list and get
    except ValueError as error:
      log.warning("heartbeat of %r does not parse, ignoring it: %r", name, error)
      continue
    if isinstance(record, dict):
      records[name] = record
  return records


class Roster:
  """An observer's view of the learners: their heartbeats and when each last changed."""

  def __init__(self, store: Store):
    self._store = store
    self.records: dict[str, dict[str, Any]] = {}
    self._changed: dict[str, tuple[Any, float]] = {}
    self.refreshed = float("-inf")

  def refresh(self) -> None:
    now = time.monotonic()
    self.records = read_all(self._store)
    for name, record in self.records.items():
      seq = (record.get("seq"), record.get("status"))
      if name not in self._changed or self._changed[name][0] != seq:
        self._changed[name] = (seq, now)
    self.refreshed = now

  def fresh(self, name: str, timeout: float) -> bool:
    seen = self._changed.get(name)
    return seen is not None and time.monotonic() - seen[1] <= timeout

  def live_for(self, round_: int, timeout: float) -> set[str]:
    """Learners expected to contribute to ``round_``."""
    live = set()
    for name, record in self.records.items():
      if not self.fresh(name, timeout):
        continue
      status = record.get("status")
      if status == LIVE and int(record.get("first_round", 0)) <= round_:
        live.add(name)
      elif status == CLOSING and round_ in (record.get("final_rounds") or ()):
        live.add(name)
    return live

  def live_count(self, timeout: float) -> int:
    return sum(1 for name, record in self.records.items()
               if record.get("status") == LIVE and self.fresh(name, timeout))

  @property
  def known(self) -> set[str]:
    return set(self.records)
