"""The round record: what a commit (``fragments/<f>/<v>.commit.json``) says, typed.

A ``RoundRecord`` is built by the closer (and by ``create`` for version 0) and read by
learners, closers, ``Run.rounds`` and ``gmjax status``. Its JSON is the content of the
run's commit files (``gmjax.mail.layout``; the run layout in README.md, "Across
machines"); ``to_json`` gives the same keys, in the same order, with the same values as
the closer writes:

* every record: ``round`` (null for version 0, which is not a round), ``fragment``,
  ``version``, ``step``, ``participants``, ``rejected``, ``final``, ``outer_step``,
  ``cosine``, ``estimates`` (``{}`` for version 0), ``live``, ``closer``, ``state``,
  ``update``, ``theta``, ``sha256`` (``{state, update}``), ``state_files``,
  ``state_names``, ``theta_sha256``;
* rounds only: ``opened_at``, ``quorum_seconds``, ``sync_seconds``, then
  ``wait_seconds``, ``grace_seconds`` and ``takeover_seconds`` when known (records
  written before these existed have none of them, and read as None);
* every record: ``committed_at``, then ``note`` when there is one, then any fields this
  version does not know (kept as they came, so a newer closer's fields survive a read
  and re-write), the signature included.

``from_json`` is strict about the fields it knows (a missing or mistyped one raises
``CorruptRecord``) and tolerant of others.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from gmjax.core.frozen import FrozenDict
from gmjax.core.records import Participant
from gmjax.core.schedule import Estimates
from gmjax.mail.errors import CorruptRecord

_LARGEST_FLOAT = sys.float_info.max
_ROUND_ONLY = ("opened_at", "quorum_seconds", "sync_seconds")
_WAITS = ("wait_seconds", "grace_seconds", "takeover_seconds")  # optional, rounds only
_KNOWN = frozenset((
    "round", "fragment", "version", "step", "participants", "rejected", "final",
    "outer_step", "cosine", "estimates", "live", "closer", "state", "update", "theta",
    "sha256", "state_files", "state_names", "theta_sha256", *_ROUND_ONLY, *_WAITS,
    "committed_at",
    "note",
))


@dataclasses.dataclass(frozen=True)
class Rejection:
  """A contribution the closer rejected, as the round record lists it."""

  learner: str
  reason: str

  def to_json(self) -> dict[str, str]:
    return {"learner": self.learner, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class RoundRecord:
  """A committed version of a fragment and the round that produced it.

  Attributes:
    round: the round (None for version 0, the creator's parameters).
    fragment: the fragment.
    version: the version this commit makes.
    step: the global step of the round (0 for version 0).
    participants: the aggregated contributions, in learner order, with their weights.
    rejected: the contributions refused, with why.
    final: learners whose contribution was their last (they closed).
    outer_step: whether an outer step was applied (False: no valid contribution).
    cosine: mean pairwise cosine of the deltas, or None.
    estimates: the timing estimates after this round.
    live: the learners the closer held live for the round.
    closer: who committed (``"create"`` for version 0).
    state: the Orbax checkpoint's path.
    update: the update file's path, or None when commits carry Θ.
    theta: the Θ file's path, or None.
    state_sha256: sha256 of the checkpoint's file list.
    update_sha256: sha256 of the update file, or None.
    state_files: sha256 of each file of the checkpoint, by relative path.
    state_names: the parameter names behind Orbax's positional keys, per part.
    theta_sha256: ``states.theta_digest`` of the committed Θ.
    opened_at: when the closer first saw a contribution (UTC ISO), rounds only.
    quorum_seconds: seconds from the first contribution to the set that closed the
      round (never including the grace period), rounds only.
    sync_seconds: seconds from closing to the saved state, rounds only.
    wait_seconds: seconds from the round's opening at the closer (the first contribution
      it listed) to its decision to close; None if unknown (older records).
    grace_seconds: seconds from the quorum to the round being closable: the wait past
      the quorum for the other live learners, until all were in or the grace period
      ran out; None if unknown.
    takeover_seconds: seconds from closable to the close: a follower's wait for the
      designated closer (about 0 when the closer was designated); None if unknown.
    committed_at: UTC ISO time of the commit.
    note: a remark (e.g. why no outer step was taken), or None.
    extra: fields this version does not know, kept in their order.
  """

  round: int | None
  fragment: int
  version: int
  step: int
  participants: tuple[Participant, ...]
  rejected: tuple[Rejection, ...]
  final: tuple[str, ...]
  outer_step: bool
  cosine: float | None
  estimates: Estimates
  live: tuple[str, ...]
  closer: str
  state: str
  update: str | None
  theta: str | None
  state_sha256: str
  update_sha256: str | None
  state_files: Mapping[str, str]
  state_names: Mapping[str, tuple[str, ...]]
  theta_sha256: str
  committed_at: str
  opened_at: str | None = None
  quorum_seconds: float | None = None
  sync_seconds: float | None = None
  wait_seconds: float | None = None
  grace_seconds: float | None = None
  takeover_seconds: float | None = None
  note: str | None = None
  extra: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: FrozenDict({}))

  def __post_init__(self):
    # Sequences become tuples and mappings read-only dicts, so a record built by a
    # closer equals the same record read back, and neither can be changed in place.
    normal = {
        "participants": tuple(self.participants), "rejected": tuple(self.rejected),
        "final": tuple(self.final), "live": tuple(self.live),
        "state_files": FrozenDict(dict(self.state_files)),
        "state_names": FrozenDict(
            {k: tuple(v) for k, v in self.state_names.items()}),
        "extra": FrozenDict(dict(self.extra)),
    }
    for name, value in normal.items():
      object.__setattr__(self, name, value)

  def to_json(self) -> dict[str, Any]:
    """The record as the commit file holds it (see the module docstring)."""
    record = {
        "round": self.round,
        "fragment": self.fragment,
        "version": self.version,
        "step": self.step,
        "participants": [p.to_json() for p in self.participants],
        "rejected": [r.to_json() for r in self.rejected],
        "final": list(self.final),
        "outer_step": self.outer_step,
        "cosine": self.cosine,
        "estimates": {} if self.round is None else self.estimates.to_json(),
        "live": list(self.live),
        "closer": self.closer,
        "state": self.state,
        "update": self.update,
        "theta": self.theta,
        "sha256": {"state": self.state_sha256, "update": self.update_sha256},
        "state_files": dict(self.state_files),
        "state_names": {k: list(v) for k, v in self.state_names.items()},
        "theta_sha256": self.theta_sha256,
    }
    if self.round is not None:
      record.update(opened_at=self.opened_at, quorum_seconds=self.quorum_seconds,
                    sync_seconds=self.sync_seconds)
      record.update({name: getattr(self, name) for name in _WAITS
                     if getattr(self, name) is not None})
    record["committed_at"] = self.committed_at
    if self.note is not None:
      record["note"] = self.note
    record.update(self.extra)
    return record

  @classmethod
  def from_json(cls, record: Any, *, where: str = "a commit record") -> RoundRecord:
    """Parses a commit record.

    Args:
      record: the parsed JSON.
      where: names the record in error messages (e.g. its path).

    Raises:
      CorruptRecord: a field this version knows is missing or of the wrong type.
    """
    if not isinstance(record, Mapping):
      raise CorruptRecord(f"{where} is not a JSON object")
    read = _Reader(record, where)
    round_ = read.field("round", int, optional=True)
    sha = read.field("sha256", Mapping)
    estimates = read.field("estimates", Mapping)
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
               for v in estimates.values()):
      raise CorruptRecord(f"{where}: estimates {estimates!r} are not numbers")
    try:
      estimates = Estimates.from_json(estimates)
    except (TypeError, ValueError) as error:
      raise CorruptRecord(f"{where}: estimates {estimates!r} are not numbers") from error
    names = read.field("state_names", Mapping)
    return cls(
        round=round_,
        fragment=read.field("fragment", int),
        version=read.field("version", int),
        step=read.field("step", int),
        participants=tuple(_participant(p, where) for p in read.field("participants", list)),
        rejected=tuple(_rejection(r, where) for r in read.field("rejected", list)),
        final=read.strings("final"),
        outer_step=read.field("outer_step", bool),
        cosine=read.field("cosine", float, optional=True),
        estimates=estimates,
        live=read.strings("live"),
        closer=read.field("closer", str),
        state=read.field("state", str),
        update=read.field("update", str, optional=True),
        theta=read.field("theta", str, optional=True),
        state_sha256=_Reader(sha, f"{where}: sha256").field("state", str),
        update_sha256=_Reader(sha, f"{where}: sha256").field("update", str, optional=True),
        state_files=_string_map(read.field("state_files", Mapping), f"{where}: state_files"),
        state_names={str(part): _Reader(names, f"{where}: state_names").strings(part)
                     for part in names},
        theta_sha256=read.field("theta_sha256", str),
        committed_at=read.field("committed_at", str),
        opened_at=read.field("opened_at", str, optional=True, absent=round_ is None),
        quorum_seconds=read.field("quorum_seconds", float, optional=True,
                                  absent=round_ is None),
        sync_seconds=read.field("sync_seconds", float, optional=True, absent=round_ is None),
        **{name: read.field(name, float, optional=True, absent=True) for name in _WAITS},
        note=read.field("note", str, optional=True, absent=True),
        extra={k: v for k, v in record.items() if k not in _KNOWN},
    )


class _Reader:
  """Typed access to one JSON object's fields; every failure is a ``CorruptRecord``."""

  def __init__(self, record: Mapping[str, Any], where: str):
    self.record, self.where = record, where

  def field(self, name: str, kind: type, *, optional: bool = False,
            absent: bool = False) -> Any:
    if name not in self.record:
      if absent:
        return None
      raise CorruptRecord(f"{self.where} has no {name!r} field")
    value = self.record[name]
    if value is None and optional:
      return value
    if kind is int:
      ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
      ok = isinstance(value, (int, float)) and not isinstance(value, bool)
      if ok and isinstance(value, int) and abs(value) > _LARGEST_FLOAT:
        # A reader computing with it would raise OverflowError.
        raise CorruptRecord(f"{self.where}: field {name!r} is an integer of"
                            f" {value.bit_length()} bits, past a float's range")
    else:
      ok = isinstance(value, kind)
    if not ok:
      raise CorruptRecord(f"{self.where}: field {name!r} should be {kind.__name__}"
                          f"{' or null' if optional else ''}, got {type(value).__name__}")
    return value

  def strings(self, name: str) -> tuple[str, ...]:
    values = self.field(name, list)
    if not all(isinstance(v, str) for v in values):
      raise CorruptRecord(f"{self.where}: field {name!r} should be a list of strings")
    return tuple(values)


def _participant(value: Any, where: str) -> Participant:
  if not isinstance(value, Mapping):
    raise CorruptRecord(f"{where}: a participant is not an object")
  read = _Reader(value, f"{where}: participant")
  return Participant(learner=read.field("learner", str),
                     local_step=read.field("local_step", int),
                     steps=read.field("steps", int), tokens=read.field("tokens", int),
                     weight=read.field("weight", float),
                     step_seconds=read.field("step_seconds", float, optional=True,
                                             absent=True))


def _rejection(value: Any, where: str) -> Rejection:
  if not isinstance(value, Mapping):
    raise CorruptRecord(f"{where}: a rejected entry is not an object")
  read = _Reader(value, f"{where}: rejected entry")
  return Rejection(read.field("learner", str), read.field("reason", str))


def _string_map(value: Mapping[str, Any], where: str) -> Mapping[str, str]:
  if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
    raise CorruptRecord(f"{where} should map strings to strings")
  return value

