"""Bounded storage: a run keeps the newest ``keep_versions`` versions of each fragment.

A run created with ``gmjax.mail.create(..., keep_versions=K)`` (stored in its manifest)
keeps, of each fragment, the newest ``K`` committed versions. After each commit of
version ``v`` the closer deletes (``prune``), for every version ``u ≤ v − K``: its
states (the committed one and any a dead closer left), Θ, update and commit records, in
that order, and the round directory of every round that closed such a version
(contributions, and whatever was planted there). A run created with
``keep_versions=None``, and one whose manifest predates the field, keeps everything.

Pruning never loses a commit and never strands a reader: every record kept is intact
and names only files that are kept, and a reader asking for a version that was pruned
gets the newest committed one instead (``resolve``): a learner that fell ``K`` versions
behind, or whose round was closed and pruned before it got there, merges the newest Θ
and goes on, as a learner joining then would. Recovery repairs a damaged version only
from the versions kept (``recovery.newest_intact_state``), and ``verify`` checks the
versions kept and reports the pruned ones as pruned, not missing.

The closer also keeps ``learners/`` short (``Compactor``): a heartbeat unchanged for
``DEAD_TIMEOUTS`` liveness timeouts (by the observer's clock; on first sight, by its
``last_seen``; or by the storage's dates, which any closer can read at once) belongs to a
dead incarnation and is deleted with its claims; so are
heartbeats that stayed malformed or forged that long, claims without a heartbeat, and
anything else planted there, and temporary files a kill tore mid-write. A live name's claims of earlier incarnations go too. A
round record lists every rejected contribution of a learner with a heartbeat, and at
most ``MAX_LISTED_STRANGERS`` of the others (files planted under names that never
joined), counting the rest: planted files cannot grow the records.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from gmjax.mail import commits
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail.records import RoundRecord
from gmjax.mail.store import Store

log = logging.getLogger(__name__)

MIN_KEEP_VERSIONS = 2
"""The newest version and the one before, which a learner mid-round still holds."""
DEAD_TIMEOUTS = 10
"""Liveness timeouts a heartbeat (or planted file) stays unchanged before it is compacted."""
MAX_LISTED_STRANGERS = 8
"""Rejections a round record lists of files whose names never joined the run."""
_LEADING_VERSION = re.compile(r"(0|[1-9][0-9]*)[.-]")


class Pruned(FileNotFoundError):
  """A version that was committed and then pruned: older than the newest ``keep_versions``.

  Attributes:
    fragment: the fragment.
    version: the version asked for.
    newest: the record of the fragment's newest committed version, which stands in.
  """

  def __init__(self, fragment: int, version: int, newest: RoundRecord):
    super().__init__(f"version {version} of fragment {fragment} was pruned (the run"
                     f" keeps its newest versions); version {newest.version} is newer")
    self.fragment = fragment
    self.version = version
    self.newest = newest


def check_keep_versions(value: Any) -> int | None:
  """Returns ``value`` if it is None or an int ``>= MIN_KEEP_VERSIONS``.

  Raises:
    TypeError: not None and not an int.
    ValueError: an int below ``MIN_KEEP_VERSIONS``.
  """
  if value is None:
    return None
  if isinstance(value, np.integer):
    value = int(value)  # an int as numpy holds it
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"keep_versions must be None (keep every version) or an int >="
                    f" {MIN_KEEP_VERSIONS}, got {type(value).__name__}: {value!r}.")
  if value < MIN_KEEP_VERSIONS:
    raise ValueError(
        f"keep_versions={value!r}: a run keeps at least the newest {MIN_KEEP_VERSIONS}"
        " versions of each fragment (the newest, and the one a learner mid-round still"
        f" holds); pass keep_versions >= {MIN_KEEP_VERSIONS}, or None to keep every"
        " version.")
  return value


def floor(newest: int, keep_versions: int | None) -> int:
  """The oldest version of a fragment kept once ``newest`` is committed."""
  if keep_versions is None:
    return 0
  return max(0, newest - keep_versions + 1)


def newest_record(store: Store, fragment: int, key: bytes | None, *, above: int = -1
                  ) -> RoundRecord | None:
  """The intact record of the newest committed version above ``above``, or None."""
  for version in reversed(commits.committed_versions(store, fragment)):
    if version <= above:
      return None
    try:
      return commits.read_commit(store, fragment, version, key)
    except FileNotFoundError:
      continue  # damaged (or pruned since the listing): the one before
  return None


def resolve(store: Store, fragment: int, version: int, key: bytes | None,
            keep_versions: int | None) -> RoundRecord:
  """The record of ``version``, or when it was pruned the newest committed record.

  Raises:
    FileNotFoundError: ``version`` is not committed (``commits.DamagedCommit`` when its
      records are all damaged).
  """
  try:
    return commits.read_commit(store, fragment, version, key)
  except commits.DamagedCommit:
    raise
  except FileNotFoundError:
    if keep_versions is None:
      raise
    # A newer intact version means this one was committed: versions commit in order.
    newest = newest_record(store, fragment, key, above=version)
    if newest is None:
      raise
    log.info("version %d of fragment %d was pruned; version %d stands in", version,
             fragment, newest.version)
    return newest


def is_committed(store: Store, fragment: int, version: int, key: bytes | None,
                 keep_versions: int | None) -> bool:
  """Whether ``version`` was committed (its record kept, or pruned since), as
  ``resolve`` would find, from the records' presence alone (none is parsed)."""
  if commits.is_committed(store, fragment, version, key):
    return True
  if keep_versions is None or commits.commit_slots(store, fragment, version, key):
    return False  # not committed yet, or every record of it damaged
  # A newer intact version means this one was committed: versions commit in order.
  return any(commits.is_committed(store, fragment, newer, key)
             for newer in reversed(commits.committed_versions(store, fragment))
             if newer > version)


def check_kept(store: Store, fragment: int, version: int, key: bytes | None,
               keep_versions: int | None) -> None:
  """Raises ``Pruned`` if ``version`` is older than what the run keeps.

  For repairs: a version whose files were pruned is not damaged, and must not be
  committed again.
  """
  if keep_versions is None:
    return
  newest = newest_record(store, fragment, key, above=version)
  if newest is not None and version < floor(newest.version, keep_versions):
    raise Pruned(fragment, version, newest)


def prune(store: Store, manifest, fragment: int, newest: int) -> list[str]:
  """Deletes what the run no longer keeps once ``newest`` of ``fragment`` is committed.

  Every version below ``floor(newest, keep_versions)``: its states, Θ and updates
  (orphans and leftover temporary files too), then its commit records; then the round
  directories of the rounds that closed those versions.

  Returns:
    The paths deleted.
  """
  below = floor(newest, manifest.keep_versions)
  if below == 0:
    return []
  files, records = [], []
  folder = layout.fragment_dir(fragment)
  # A kill mid-write leaves a temporary file named after its version ("3.theta...tmp").
  for entry in store.list(folder) + store.temporaries(folder):
    match = _LEADING_VERSION.match(entry)
    if match is None or int(match.group(1)) >= below:
      continue
    path = f"{folder}/{entry}"
    # Records go last: a record kept always names files that are kept.
    group = records if layout.slot_version(entry) is not None else files
    group.append((int(match.group(1)), path))
  # Oldest first (a listing is in name order: "10.commit.json" before "9.commit.json"),
  # so that a prune cut short leaves the kept versions without a gap.
  files, records = ([path for _, path in sorted(group)] for group in (files, records))
  schedule = manifest.schedule
  rounds = []
  for entry in store.list("rounds"):
    if entry.isdigit() and len(entry) < 16:
      round_ = int(entry)
      if (schedule.fragment_of(round_) == fragment
          and schedule.version_after(round_) < below):
        rounds.append(layout.round_dir(round_))
  removed = []
  for path in files + records + rounds:
    store.delete(path)
    removed.append(path)
  if removed:
    log.info("pruned fragment %d below version %d: %d paths", fragment, below, len(removed))
  return removed


def listed_rejections(rejected: Iterable[Any], known: set[str]) -> tuple[list[Any], int]:
  """The rejections a round record lists, and how many it leaves out.

  Every rejection of a learner with a heartbeat is listed; of the others (files planted
  under names that never joined) the first ``MAX_LISTED_STRANGERS`` by name.
  """
  rejected = list(rejected)
  strangers = sorted((r for r in rejected if r.learner not in known), key=lambda r: r.learner)
  listed = [r for r in rejected if r.learner in known] + strangers[:MAX_LISTED_STRANGERS]
  return listed, max(0, len(strangers) - MAX_LISTED_STRANGERS)


class Compactor:
  """Keeps ``learners/`` short: deletes what dead incarnations and planters left there.

  One per closer; ``compact`` is called after this closer's commits, at most once per
  ``interval`` seconds.
  """

  def __init__(self, store: Store):
    self._store = store
    self._since: dict[str, tuple[Any, float]] = {}  # entry -> (what it was, first seen)
    self._trimmed: dict[str, str] = {}  # name -> incarnation whose older claims went
    self._last = float("-inf")

  def _stale(self, entry: str, what: Any, now: float, dead_after: float) -> bool:
    seen = self._since.get(entry)
    if seen is None or seen[0] != what:
      self._since[entry] = (what, now)
      return False
    return now - seen[1] > dead_after

  def compact(self, roster, dead_after: float, *, interval: float,
              storage_clock: Callable[[], float | None] | None = None) -> list[str]:
    """Deletes dead heartbeats, their claims and planted entries under ``learners/``.

    An entry is dead once unchanged for ``dead_after`` seconds, as this closer saw it
    (the roster's clock for valid heartbeats, first sight for the rest), or, with
    ``storage_clock``, as the storage's own dates say (``Store.list_dated``): a closer
    that has just started judges an entry written long ago at once, so that learners
    that come and go faster than ``dead_after`` still get ``learners/`` compacted.

    Args:
      roster: the closer's ``heartbeats.Roster`` (its valid heartbeats, the ignored
        ones, and when it saw each change).
      dead_after: seconds an entry must stay unchanged before it is deleted.
      interval: the least seconds between two compactions.
      storage_clock: returns the storage's clock now (or None), e.g. the date of the
        record this closer has just written; called once a compaction. None judges by
        sight only.

    Returns:
      The paths deleted.
    """
    now = time.monotonic()
    if now - self._last < interval:
      return []
    self._last = now
    storage_now = None if storage_clock is None else storage_clock()
    dated = self._store.list_dated("learners")
    old = lambda date, after=dead_after: (storage_now is not None and date is not None
                                          and storage_now - date > after)
    beats = {e[: -len(".json")] for e in dated if e.endswith(".json")}
    dead, removed = set(), []
    for entry, date in dated.items():
      if entry.endswith(".json"):
        name = entry[: -len(".json")]
        record = roster.records.get(name)
        if record is not None:
          # A learner that beats less often than the observers poll is live for ten of
          # its own beats (heartbeats.liveness), by the storage's clock as by sight. One
          # seen rising here is judged by sight alone: the storage's dates can jump (a
          # clock stepped on the machine that wrote them).
          if not roster.fresh(name, dead_after) or (
              not roster.seen_rising(name)
              and old(date, heartbeats.liveness(record, dead_after))):
            dead.add(name)
          continue
        reason = roster.bad.get(name)
        if self._stale(entry, reason, now, dead_after) or old(date):
          dead.add(name)  # ignored (malformed, forged, planted) all that time
      elif entry.endswith(".claims") and layout.is_valid_name(entry[: -len(".claims")]):
        name = entry[: -len(".claims")]
        if name not in beats and (self._stale(entry, None, now, dead_after)
                                  or self._claims_old(name, old)):
          removed += self._drop_claims(name, None)  # a claim whose holder never beat
      elif self._stale(entry, None, now, dead_after) or old(date):
        self._store.delete(f"learners/{entry}")  # neither a heartbeat nor claims
        removed.append(f"learners/{entry}")
    for name in sorted(dead):
      removed += self._drop_name(name, roster.records.get(name))
    temporaries = self._store.temporaries("learners")
    for entry in temporaries:
      if self._stale(entry, None, now, dead_after):  # a write a kill tore, long ago
        self._store.delete(f"learners/{entry}")
        removed.append(f"learners/{entry}")
    # Forget entries that are gone: what a closer keeps stays as long as learners/.
    self._since = {e: seen for e, seen in self._since.items()
                   if e in dated or e in temporaries}
    self._trimmed = {name: i for name, i in self._trimmed.items() if name in beats}
    for name, record in roster.records.items():
      incarnation = record.get("incarnation")
      if name not in dead and isinstance(incarnation, str) and (
          self._trimmed.get(name) != incarnation):
        self._trimmed[name] = incarnation
        removed += self._drop_claims(name, incarnation, older_only=True)
    if removed:
      log.info("compacted learners/: %d entries removed", len(removed))
    return removed

  def _claims_old(self, name: str, old: Callable[[float | None], bool]) -> bool:
    """Whether every claim of ``name`` is ``old`` by its date (a folder has none)."""
    dates = self._store.list_dated(f"learners/{name}.claims").values()
    return bool(dates) and all(old(date) for date in dates)

  def _drop_name(self, name: str, record: dict[str, Any] | None) -> list[str]:
    """Deletes a dead name's heartbeat (if it is still the one judged), then its claims."""
    path = f"learners/{name}.json"
    if record is not None:
      again = heartbeats.read_one(self._store, name, None)
      # A learner that joined under the name since is not dead: leave it.
      if again is None or (again.get("seq"), again.get("incarnation")) != (
          record.get("seq"), record.get("incarnation")):
        return []
    self._store.delete(path)
    self._since.pop(f"{name}.json", None)
    incarnation = None if record is None else record.get("incarnation")
    return [path] + self._drop_claims(name, incarnation if isinstance(incarnation, str)
                                      else None)

  def _drop_claims(self, name: str, incarnation: str | None, *,
                   older_only: bool = False) -> list[str]:
    """Deletes the claims of ``name`` up to the one ``incarnation`` holds (all of them
    when it is None; only the older ones with ``older_only``). Claims are deleted one
    by one, so a claim made by a join since is kept."""
    folder = f"learners/{name}.claims"
    entries = self._store.list(folder)
    numbers = sorted(n for e in entries if (n := layout.claim_number(e)))
    # Anything else there was planted (no join writes it; ``list`` shows no store
    # temporaries): deleted whenever the claims are judged.
    removed = [f"{folder}/{e}" for e in entries if layout.claim_number(e) is None]
    for path in removed:
      self._store.delete(path)
    if not numbers:
      if removed:
        self._store.delete_empty_folder(folder)
      return removed
    last = numbers[-1]
    if incarnation is not None:
      try:
        held = self._store.read(f"{folder}/{last}", 256).decode("ascii", "replace")
      except (FileNotFoundError, ValueError):
        held = None
      if held != incarnation:
        return removed  # a newer join holds the name: its claims are not ours to judge
    keep = last if older_only else last + 1
    for number in numbers:
      if number < keep:
        self._store.delete(f"{folder}/{number}")
        removed.append(f"{folder}/{number}")
    if not older_only and removed:
      # An empty folder (a local store), unless a join has just claimed in it.
      self._store.delete_empty_folder(folder)
    self._since.pop(f"{name}.claims", None)
    return removed
