"""Heartbeats: each learner's ``learners/<name>.json``, and who counts as live.

A learner rewrites its heartbeat every few poll intervals from a background thread, with
an increasing ``seq``. An observer never compares wall clocks across machines: it
notes, on its own monotonic clock, when it last saw each learner's ``seq`` rise, and
holds a learner dead once that is older than its liveness timeout, or ten of the
learner's own beat periods if longer (``liveness``).

Only a rise counts. Each join of a name is an incarnation (``incarnation``, with ``seq``
from 1), and an observer remembers the highest ``seq`` it has seen of each: a heartbeat
that is not newer than that (an old one written back, in a keyed run the only
heartbeat anyone without the key can write) is ignored, so replaying a dead learner's
old heartbeats, in any order, never makes it live again nor brings back a status it
left. Each replayed heartbeat counts at most once, when it is the newest yet seen, and
an observer that starts while they are written back times the first two it sees by
the age they state: a dead learner's last heartbeats never make it live.

Who is live for round ``r``: a ``live`` learner whose ``first_round <= r``, and a
``closing`` one for the rounds in its ``final_rounds``, while its heartbeat is fresh.

A heartbeat is untrusted: it is read with a size bound (``MAX_HEARTBEAT_BYTES``) and
checked field by field (``parse``); with a run key it must carry a valid HMAC-SHA256
signature (``signing.sign_record``). A heartbeat that fails is ignored and reported:
logged once per reason, and listed by ``Roster.bad`` and
``run.status()["bad_heartbeats"]``. Ignored, it is as if unchanged: an observer keeps
the learner's last valid heartbeat, if it saw one, until that goes stale (a learner
whose first heartbeat seen is bad is neither known nor live).

``watch.Known``, what the closer's scan checks contributions' names against, is a
roster lookup that refreshes the roster at most once a scan.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

from gmjax.core.guards import quote
from gmjax.mail import layout
from gmjax.mail import signing
from gmjax.mail.heartbeat_record import Heartbeat as Heartbeat  # gmjax.mail.Heartbeat
from gmjax.mail.store import BadObject, Store

log = logging.getLogger(__name__)

LIVE, CLOSING, CLOSED = "live", "closing", "closed"
MIN_LIVENESS_SECONDS = 2.0
"""The least time a heartbeat may stay unchanged before its learner is presumed dead."""
MAX_HEARTBEAT_BYTES = 1 << 20
"""A learner's heartbeat takes a few hundred bytes, plus a few per fragment."""
MAX_COUNT = 2**53
"""Rounds, steps and sequence numbers stay below this (exact as JSON numbers anywhere)."""
MAX_TEXT = 256  # status, host, times: short strings
MAX_SECONDS = 1e15  # a step time or idle time past any real one, well inside a float
BEATS_TO_DEATH = 10
"""A learner is presumed dead once its heartbeat has stayed unchanged for this many of
its own beat periods (``beat_seconds``), and for the observer's liveness timeout."""
MAX_BEAT_SECONDS = 60.0  # a beat period counted at most this long (a minute a poll / 5)
FAILED = "failed"  # a learner whose background work failed: not live, like a closed one


class BadHeartbeat(ValueError):
  """A heartbeat that is malformed, unsigned or forged; ``reason`` says which."""

  def __init__(self, name: str, reason: str):
    super().__init__(f"heartbeat of {name} ignored: {reason}")
    self.name = name
    self.reason = reason


def dumps(record: Mapping[str, Any], key: bytes | None) -> bytes:
  """A heartbeat's bytes, signed when the run has a key."""
  record = {k: v for k, v in record.items() if k != signing.SIGNATURE}
  if key is not None:
    record[signing.SIGNATURE] = signing.sign_record(key, record)
  return json.dumps(record).encode()


def _count(record: Mapping[str, Any], field: str, name: str) -> None:
  value = record[field]
  if type(value) is not int or not 0 <= value < MAX_COUNT:  # bool is no count
    raise BadHeartbeat(name, f"{field}={quote(value)} is not an int in [0, 2**53)")


def parse(name: str, data: bytes, key: bytes | None) -> dict[str, Any]:
  """The heartbeat ``learners/<name>.json``, checked.

  Required: ``name`` (this file's), ``status`` (a short string: ``live``, ``closing``,
  ``closed`` or another word that counts as not live) and ``seq``; when present,
  ``first_round``, ``step``, ``trained``, ``claim`` (ints in ``[0, 2**53)``),
  ``final_rounds`` (a list of such ints), ``versions`` (fragment -> version), ``loss`` (a
  number or null), ``step_seconds``, ``idle_seconds`` and ``claimed_at`` (finite
  non-negative numbers or null), short strings for the times and host; others as they are.

  Raises:
    BadHeartbeat: with the reason it is ignored.
  """
  try:
    record = json.loads(data.decode("utf-8"))
  except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, nesting, huge ints
    raise BadHeartbeat(name, f"not JSON: {quote(str(error))}") from None
  if not isinstance(record, dict):
    raise BadHeartbeat(name, f"not a JSON object but {type(record).__name__}")
  if key is not None and not signing.record_signature_ok(key, record):
    raise BadHeartbeat(name, "bad or missing HMAC-SHA256 signature")
  for field in ("name", "status", "seq"):
    if field not in record:
      raise BadHeartbeat(name, f"no {field!r} field")
  if record["name"] != name:
    raise BadHeartbeat(name, f"name={quote(record['name'])} is not its file's")
  for field in ("status", "last_seen", "joined_at", "closed_at", "host"):
    value = record.get(field, "")
    if not isinstance(value, str) or len(value) > MAX_TEXT:
      raise BadHeartbeat(name, f"{field}={quote(value)} is not a short string")
  for field in ("seq", "first_round", "step", "trained", "claim"):
    if field in record:
      _count(record, field, name)
  for field in ("step_seconds", "idle_seconds", "beat_seconds", "claimed_at"):
    value = record.get(field)
    # Bounded below float's range: a JSON integer of 400 digits is no float.
    if value is not None and (type(value) not in (int, float) or not 0 <= value < MAX_SECONDS):
      raise BadHeartbeat(name, f"{field}={quote(value)} is not a finite number of seconds")
  pid = record.get("pid")
  if pid is not None and (type(pid) is not int or not 0 <= pid < 2**31):
    raise BadHeartbeat(name, f"pid={quote(pid)} is not a process id")
  incarnation = record.get("incarnation")
  if incarnation is not None and (not isinstance(incarnation, str)
                                  or len(incarnation) > MAX_TEXT):
    raise BadHeartbeat(name, f"incarnation={quote(incarnation)} is not a short string")
  rounds = record.get("final_rounds", [])
  if not isinstance(rounds, list) or not all(
      type(r) is int and 0 <= r < MAX_COUNT for r in rounds):
    raise BadHeartbeat(name, f"final_rounds={quote(rounds)} is not a list of rounds")
  versions = record.get("versions", {})
  if not isinstance(versions, dict) or not all(
      type(v) is int and 0 <= v < MAX_COUNT for v in versions.values()):
    raise BadHeartbeat(name, f"versions={quote(versions)} is not fragment -> version")
  loss = record.get("loss")  # NaN and inf are losses too; an int past a float's is not
  if loss is not None and (type(loss) not in (int, float) or (
      type(loss) is int and abs(loss) > sys.float_info.max)):
    raise BadHeartbeat(name, f"loss={quote(loss)} is not a number")
  return record


@dataclasses.dataclass(frozen=True)
class Heartbeats:
  """What one read of ``learners/`` found: valid heartbeats, and why others were ignored.

  Attributes:
    records: heartbeats by learner name.
    bad: reasons by (quoted) file name, for heartbeats that were ignored.
  """

  records: dict[str, dict[str, Any]]
  bad: dict[str, str]


def scan(store: Store, key: bytes | None = None,
         cache: dict[str, tuple[Any, Any]] | None = None) -> Heartbeats:
  """Reads and checks every heartbeat of the run.

  With a ``cache`` the caller keeps between scans, a file whose change marker
  (``Store.list_marked``) is the one it had at its last read is not read again: files
  planted in ``learners/`` cost an observer's scan a listing, and a read when they change.
  """
  records, bad = {}, {}
  listed = (dict.fromkeys(store.list("learners")) if cache is None
            else store.list_marked("learners"))
  for gone in set(cache or ()) - set(listed):
    del cache[gone]
  for entry, marker in listed.items():
    if not entry.endswith(".json"):
      continue
    name = entry[: -len(".json")]
    if not layout.is_valid_name(name):
      bad[quote(name)] = f"not a valid learner name ({layout.NAME_PATTERN.pattern})"
      continue
    found = (cache or {}).get(entry)
    if found is None or marker is None or found[0] != marker:
      try:
        found = marker, parse(name, store.read(layout.heartbeat(name), MAX_HEARTBEAT_BYTES),
                              key)
      except FileNotFoundError:
        continue  # removed between list and read
      except (BadObject, BadHeartbeat) as error:
        found = marker, error.reason
      if cache is not None:
        cache[entry] = found
    (bad if isinstance(found[1], str) else records)[name] = found[1]
  return Heartbeats(records, bad)


def read_one(store: Store, name: str, key: bytes | None = None) -> dict[str, Any] | None:
  """The valid heartbeat of ``name``, or None if it has none (or an ignored one)."""
  try:
    return parse(name, store.read(layout.heartbeat(name), MAX_HEARTBEAT_BYTES), key)
  except FileNotFoundError:
    return None
  except (BadObject, BadHeartbeat) as error:
    log.warning("heartbeat of %s ignored: %s", quote(name), getattr(error, "reason", error))
    return None


def read_all(store: Store, key: bytes | None = None) -> dict[str, dict[str, Any]]:
  """Every learner's valid heartbeat by name; ignored ones are logged."""
  found = scan(store, key)
  for name, reason in found.bad.items():
    log.warning("heartbeat of %s ignored: %s", name, reason)
  return found.records


def liveness(record: Mapping[str, Any] | None, timeout: float) -> float:
  """How long ``record``'s learner may leave its heartbeat unchanged before an observer
  whose own liveness timeout is ``timeout`` presumes it dead: ``BEATS_TO_DEATH`` of its
  beat periods, if that is longer. A learner that polls (and so beats) less often than
  the observer is not dropped between two of its beats."""
  beat = None if record is None else record.get("beat_seconds")
  if beat is None:
    return timeout
  return max(timeout, BEATS_TO_DEATH * min(float(beat), MAX_BEAT_SECONDS))


def _age(record: Mapping[str, Any]) -> float:
  """Seconds since the heartbeat's ``last_seen`` by this machine's clock (0 if unknown)."""
  try:
    seen = datetime.datetime.fromisoformat(record["last_seen"])
    age = (datetime.datetime.now(datetime.timezone.utc) - seen).total_seconds()
  except (KeyError, TypeError, ValueError):
    return 0.0
  return max(0.0, age) if math.isfinite(age) else 0.0


class Roster:
  """An observer's view of the learners: their heartbeats and when each last changed.

  Attributes:
    records: valid heartbeats by name.
    bad: why the others were ignored, by (quoted) name.
  """

  def __init__(self, store: Store, key: bytes | None = None):
    self._store = store
    self._key = key
    self.records: dict[str, dict[str, Any]] = {}
    self.bad: dict[str, str] = {}
    self._changed: dict[str, float] = {}  # when each name's newest beat was first seen
    self._newest: dict[tuple[str, Any], int] = {}  # (name, incarnation) -> highest seq
    self._rises: dict[tuple[str, Any], int] = {}  # how often that seq rose here
    self._claims: dict[str, float] = {}  # name -> newest claim's date a heartbeat named
    self.refreshed = float("-inf")
    self._read: dict[str, tuple[Any, Any]] = {}  # scan's cache: file -> (marker, result)

  def refresh(self) -> None:
    now = time.monotonic()
    found = scan(self._store, self._key, self._read)
    for name, reason in found.bad.items():
      if self.bad.get(name) != reason:  # once per reason, not once per poll
        log.warning("heartbeat of %s ignored: %s", name, reason)
    self.bad = found.bad
    # A learner whose heartbeat turns bad (torn, planted, forged over) keeps its last
    # valid one here, which ages as an unchanged heartbeat: it is not taken for a
    # learner that never joined, and goes dead only when that one is stale.
    records = {name: self.records[name] for name in found.bad if name in self.records}
    for name, record in found.records.items():
      incarnation = (name, record.get("incarnation"))
      newest = self._newest.get(incarnation)
      # The claim's date (the storage's clock, signed): claim numbers start again at 1
      # once a name's claims are compacted away, dates do not.
      claimed, newest_claim = record.get("claimed_at"), self._claims.get(name)
      if ((newest is not None and record["seq"] <= newest)
          or (claimed is not None and newest_claim is not None and claimed < newest_claim)):
        # Not newer than a beat already seen: unchanged, an old one written back, or one
        # of an earlier join of the name (a replay: it would end a live learner).
        if name in self.records:
          records[name] = self.records[name]
        continue
      if claimed is not None:
        self._claims[name] = max(claimed, newest_claim or claimed)
      self._newest[incarnation] = record["seq"]
      rises = self._rises[incarnation] = self._rises.get(incarnation, -1) + 1
      records[name] = record
      if rises < 2:
        # First sight of this incarnation, and its first rise: as old as the heartbeat
        # says it is, so a learner that joins a long run does not count every learner
        # that ever died there as live, nor one whose last two heartbeats are written
        # back. Only an age is taken from the writer's clock; a skewed clock delays a
        # live learner until its second beat, which is timed here again.
        seen = now - _age(record)
        self._changed[name] = max(seen, self._changed.get(name, seen))
      else:
        self._changed[name] = now
    self.records = records
    self.refreshed = now
    # Forget names whose heartbeat is gone (compacted away): in a long run of names that
    # come and go, what the roster keeps stays as long as learners/. A heartbeat that
    # comes back is a first sight, timed by the age it states.
    listed = set(found.records) | set(found.bad)
    for memory in (self._newest, self._rises):
      for key in [key for key in memory if key[0] not in listed]:
        del memory[key]
    for memory in (self._claims, self._changed):
      for name in [name for name in memory if name not in listed]:
        del memory[name]

  def fresh(self, name: str, timeout: float) -> bool:
    """Whether ``name``'s heartbeat changed within ``liveness(its record, timeout)``."""
    seen = self._changed.get(name)
    return seen is not None and time.monotonic() - seen <= liveness(
        self.records.get(name), timeout)

  def seen_rising(self, name: str) -> bool:
    """Whether ``name``'s heartbeat rose here after its first sight (timed by sight)."""
    record = self.records.get(name)
    return record is not None and self._rises.get((name, record.get("incarnation")), 0) >= 2

  def live_for(self, round_: int, timeout: float) -> set[str]:
    """Learners expected to contribute to ``round_``."""
    live = set()
    for name, record in self.records.items():
      if not self.fresh(name, timeout):
        continue
      status = record["status"]
      if status == LIVE and record.get("first_round", 0) <= round_:
        live.add(name)
      elif status == CLOSING and round_ in record.get("final_rounds", ()):
        live.add(name)
    return live

  def live_count(self, timeout: float) -> int:
    return sum(1 for name, record in self.records.items()
               if record["status"] == LIVE and self.fresh(name, timeout))

  def paces(self, timeout: float) -> dict[str, float]:
    """The ``step_seconds`` the live learners' heartbeats report, by name (those that
    report one)."""
    return {name: float(record["step_seconds"]) for name, record in self.records.items()
            if record["status"] == LIVE and self.fresh(name, timeout)
            and record.get("step_seconds") is not None}

  @property
  def known(self) -> set[str]:
    return set(self.records)

