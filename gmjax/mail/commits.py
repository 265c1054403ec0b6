"""Commit records: the exclusive record of each version, its slots, and orphan sweeps.

The record of version ``v`` of fragment ``f`` is ``fragments/<f>/<v>.commit.json``
(slot 0); a writer that finds every slot so far damaged creates the next one,
``<v>.commit-<k>.json``, exclusively, listing the slots it ``supersedes``. The last
intact slot is the record in force (see ``recovery`` for when one is superseded).
Anything at a slot that cannot be a record (a folder, a FIFO, a file larger than
``MAX_RECORD_BYTES``, bytes that are not a valid record) damages that slot: readers go
on to the next slot, and a writer takes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any

from gmjax.mail import layout
from gmjax.mail import signing
from gmjax.mail.errors import CorruptRecord
from gmjax.mail.records import RoundRecord
from gmjax.mail.store import BadObject, Store

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 16 << 20
"""A commit record is a few KiB, plus about 200 bytes per participant and per listed
rejection (of learners with a heartbeat, ``retention.listed_rejections``): this bound
holds tens of thousands of learners."""
_DAMAGED_KEPT = 256  # verdicts on damaged slots remembered, by content
_UNREADABLE_TRIES = 3  # creates refused at a slot that then reads as no object


class DamagedCommit(FileNotFoundError):
  """Every record of a version is damaged: it counts as not committed (its round can be
  closed again, and its record superseded), and readers fall back to older versions.

  Attributes:
    problems: what is wrong with each record, by path.
  """

  def __init__(self, message: str, problems: dict[str, str]):
    super().__init__(message)
    self.problems = problems


# A record whose signature fails: forged, unsigned, or signed for another run.
NOT_SIGNED = "is not signed for this run with its key (unsigned, forged, or another run's)"

REQUIRED_FIELDS = {
    "fragment": int, "version": int, "step": int, "participants": list, "rejected": list,
    "state": str, "state_files": dict, "state_names": dict, "sha256": dict,
    "theta_sha256": str, "committed_at": str,
}


def record_problem(record: Any, fragment: int, version: int, key: bytes | None,
                   slot: int = 0) -> str | None:
  """What is wrong with a parsed commit record of ``version`` of ``fragment`` found at
  ``slot``, or None.

  A record at slot ``k`` lists slots ``0 .. k - 1`` as those it ``supersedes`` (signed,
  in a keyed run): a record copied to another slot (an older commit replayed over the
  one in force) does not describe its place and is damaged there.
  """
  if not isinstance(record, dict):
    return f"is a JSON {type(record).__name__}, not an object"
  if record.get("version") != version or record.get("fragment") != fragment:
    return f"does not describe version {version} of fragment {fragment}"
  expected = [layout.commit_slot(fragment, version, k) for k in range(slot)]
  if (record.get("supersedes") or []) != expected:
    return (f"supersedes {record.get('supersedes')!r}, not the slots before its own"
            f" ({expected}): a record written for another slot")
  for field, kind in REQUIRED_FIELDS.items():
    if not isinstance(record.get(field), kind) or isinstance(record.get(field), bool):
      return f"field {field!r} is missing or not a {kind.__name__}"
  if version > 0 and not isinstance(record.get("round"), int):
    return "field 'round' is missing or not an int"
  if key is not None and not signing.record_signature_ok(key, record):
    return NOT_SIGNED
  try:
    # Every field a reader parses: a record that passed the checks above but not these
    # would be taken as the version's commit, then fail every reader.
    RoundRecord.from_json(record, where="it")
  except CorruptRecord as error:
    return str(error)
  return None


_WARNED: set[tuple[Any, ...]] = set()  # damaged versions already logged
# (url, path, key, sha256 of the bytes) -> what is wrong with them. Readers poll the
# slots of the version they wait for: junk planted there (up to MAX_RECORD_BYTES of JSON
# that takes seconds to parse and judge) is judged once, not on every poll.
_DAMAGED: dict[tuple[Any, ...], str] = {}
_DAMAGED_LOCK = threading.Lock()


def _slot_problem(store: Store, path: str, data: bytes, fragment: int, version: int,
                  key: bytes | None, slot: int) -> tuple[dict[str, Any] | None, str | None]:
  """The record the bytes at slot ``slot`` hold, or what is wrong with them."""
  seen = (store.url, path, key, hashlib.sha256(data).digest())
  if seen in _DAMAGED:
    return None, _DAMAGED[seen]
  try:
    record = json.loads(data)
  except (ValueError, RecursionError) as error:
    problem = f"is not JSON ({type(error).__name__})"
  else:
    problem = record_problem(record, fragment, version, key, slot)
  if problem is None:
    return record, None
  with _DAMAGED_LOCK:  # learners' threads share it
    if len(_DAMAGED) >= _DAMAGED_KEPT:
      del _DAMAGED[next(iter(_DAMAGED))]
    _DAMAGED[seen] = problem
  return None, problem


def commit_slots(store: Store, fragment: int, version: int, key: bytes | None
                 ) -> list[tuple[str, dict[str, Any] | None, str | None]]:
  """Every record of ``version``, in slot order: ``(path, record or None, problem)``.

  Slot ``k`` is only ever created after slot ``k - 1``, so the slots end at the first
  missing one.
  """
  slots = []
  while True:
    path = layout.commit_slot(fragment, version, len(slots))
    try:
      data = store.read(path, MAX_RECORD_BYTES)
    except FileNotFoundError:
      return slots
    except BadObject as error:
      slots.append((path, None, error.reason))
      continue
    slots.append((path, *_slot_problem(store, path, data, fragment, version, key,
                                       len(slots))))


def _record_in_force(store: Store, fragment: int, version: int, key: bytes | None
                     ) -> tuple[str, dict[str, Any]]:
  """The path and JSON of the last intact record of ``version``: see ``read_commit``."""
  slots = commit_slots(store, fragment, version, key)
  if not slots:
    raise FileNotFoundError(layout.commit(fragment, version))
  for path, record, _ in reversed(slots):
    if record is not None:
      return path, record
  problems = {path: problem for path, _, problem in slots}
  # Readers poll a version until it commits: say so once per damage, not once per poll.
  seen = (store.url, fragment, version, tuple(sorted(problems)))
  (log.debug if seen in _WARNED else log.warning)(
      "every record of version %d of fragment %d is damaged: %s", version, fragment,
      problems)
  _WARNED.add(seen)
  raise DamagedCommit(f"every record of version {version} of fragment {fragment} is"
                      f" damaged: {problems}", problems)


def read_commit(store: Store, fragment: int, version: int, key: bytes | None
                ) -> RoundRecord:
  """The commit record of ``version`` of ``fragment``: the last intact one of its slots,
  typed (its signature, when it has one, stays in ``extra``).

  Raises:
    FileNotFoundError: ``version`` is not committed.
    DamagedCommit (a FileNotFoundError): it has records, all damaged (torn, zeroed,
      edited, unsigned in a keyed run).
    CorruptRecord: the record in force lacks a field or holds one of the wrong type.
  """
  path, record = _record_in_force(store, fragment, version, key)
  return RoundRecord.from_json(record, where=path)


def is_committed(store: Store, fragment: int, version: int, key: bytes | None) -> bool:
  """Whether ``version`` has an intact commit record (damaged ones do not count)."""
  try:
    _record_in_force(store, fragment, version, key)
  except FileNotFoundError:
    return False
  return True


def write_commit(store: Store, record: RoundRecord, key: bytes | None, *,
                 supersede: int = 0, keep_versions: int | None = None) -> bool:
  """Creates the commit record exclusively; True if this call made the commit.

  The file holds ``record.to_json()`` (``gmjax.mail.records``), with ``supersedes`` and
  the signature added when there are any.

  The record goes to the first free slot after damaged ones (listed in its
  ``supersedes``); an intact record in a slot means another closer committed first. A
  version the run's ``keep_versions`` has already pruned (below the floor of a newer
  intact record) is never committed again: its record is taken back and False
  returned, as when another closer won. A newer version alone proves nothing: a fast
  closer may commit on this record before this call looks.
  A repair (``recovery.repair``) passes ``supersede``, the number of slots it found,
  whose records it supersedes even when they parse (their state is damaged).
  """
  fragment, version = record.fragment, record.version
  fields = record.to_json()
  superseded: list[str] = []
  slot = unreadable = 0
  while True:
    final = dict(fields)
    if superseded:
      final["supersedes"] = list(superseded)
    if key is not None:
      final[signing.SIGNATURE] = signing.sign_record(key, final)
    path = layout.commit_slot(fragment, version, slot)
    if store.create(path, json.dumps(final, indent=1).encode()):
      newer = [v for v in committed_versions(store, fragment) if v > version]
      if keep_versions is not None and any(
          version < v - keep_versions + 1 and is_committed(store, fragment, v, key)
          for v in reversed(newer)):
        # A newer version was built on this one (an intact record: a damaged or planted
        # one proves nothing), so it was committed and then pruned (a closer paused
        # past the run's retention): its slot is free, but the version is history. The
        # record just made would stand below the kept versions with no state: taken
        # back, as if another closer had committed first.
        store.delete(path)
        log.warning("version %d of fragment %d was committed and pruned while %s was"
                    " written: not committed again", version, fragment, path)
        return False
      if superseded:
        log.warning("version %d of fragment %d committed in %s, superseding %s",
                    version, fragment, path, superseded)
      if version >= 2 and version % ORPHAN_SWEEP_EVERY == 0:
        try:
          remove_orphans(store, fragment, version - 1, key,
                         since=max(0, version - 1 - 2 * ORPHAN_SWEEP_EVERY))
        except Exception as error:  # pylint: disable=broad-except
          log.warning("sweep of orphaned states of fragment %d failed: %r", fragment, error)
      return True
    try:
      _, problem = _slot_problem(store, path, store.read(path, MAX_RECORD_BYTES), fragment,
                                 version, key, slot)
    except FileNotFoundError:
      unreadable += 1
      if unreadable < _UNREADABLE_TRIES:
        continue  # deleted by hand between create and read: try the slot again
      # Readers would stop at this slot too: taking the next one would hide the commit.
      raise CorruptRecord(f"{path} refuses an exclusive create yet reads as no object"
                          f" ({unreadable} times); check the storage") from None
    except BadObject as error:
      problem = error.reason
    if problem is None and slot >= supersede:
      return False
    if problem is not None:
      log.warning("%s is damaged (%s): taking the next slot", path, problem)
    superseded.append(path)
    slot += 1
    unreadable = 0


def version_zero_gone(store: Store, fragment: int) -> None:
  """Raises CorruptRecord if version 0 of ``fragment``, found not committed, has no
  later version either: it is committed when the run is created, never later, so its
  record was deleted, and nothing that waits for it or builds on it can go on."""
  if not committed_versions(store, fragment):
    raise CorruptRecord(
        f"{layout.commit(fragment, 0)} is gone from the run's storage, and no later version"
        f" of fragment {fragment} is committed: no round can close on it; restore that file"
        " or create the run again")


def committed_versions(store: Store, fragment: int) -> list[int]:
  """Versions with at least one commit record (intact or not), ascending."""
  versions = (layout.commit_version(e) for e in store.list(layout.fragment_dir(fragment)))
  return sorted(v for v in versions if v is not None)


ORPHAN_SWEEP_EVERY = 8  # a commit of every 8th version sweeps the versions before it


def remove_orphans(store: Store, fragment: int, below: int, key: bytes | None, *,
                   since: int = 0) -> list[str]:
  """Deletes states and updates of versions in ``[since, below)`` that no intact record
  of their version names.

  They are left by closers that died between saving a state and committing it (a
  closer that loses a race removes its own). The commit of version ``v`` sweeps below
  ``v - 1``: a closer still writing a state of such a version would be a whole round of
  the fragment late, and its commit could only fail.

  Returns:
    The paths removed.
  """
  entries = store.list(layout.fragment_dir(fragment))
  candidates: dict[int, list[str]] = {}
  for entry in entries:
    version = layout.state_version(entry)
    if version is not None and since <= version < below:
      candidates.setdefault(version, []).append(entry)
  removed = []
  for version, names in sorted(candidates.items()):
    named = set()
    for _, record, _ in commit_slots(store, fragment, version, key):
      if record is not None:
        for field in ("state", "update", "theta"):
          if record.get(field):
            named.add(str(record[field]).split("/")[2])  # fragments/<f>/<entry>[/...]
    if not named:
      continue  # no intact record: the files may be all that is left of the version
    for entry in names:
      if entry not in named:
        path = f"{layout.fragment_dir(fragment)}/{entry}"
        store.delete(path)
        removed.append(path)
  if removed:
    log.info("removed orphaned states of fragment %d: %s", fragment, removed)
  return removed
