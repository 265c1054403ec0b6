"""``Heartbeat``: a learner's heartbeat (``learners/<name>.json``), typed, as
``gmjax.mail.heartbeats.parse`` accepted it (``Run.learners()`` gives them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gmjax.core.frozen import FrozenDict

_ALWAYS = ("name", "pid", "host", "joined_at", "incarnation", "status", "seq", "step",
           "first_round", "final_rounds", "versions", "step_seconds", "trained",
           "idle_seconds", "last_seen")  # what every heartbeat of a learner holds
_WHEN_SET = ("loss", "closed_at", "error", "beat_seconds", "claim")  # not in every one


@dataclasses.dataclass(frozen=True)
class Heartbeat:
  """A learner's heartbeat (``learners/<name>.json``) as ``parse`` accepted it, typed.

  A field a heartbeat lacks reads as None (``final_rounds`` as ``()``, ``versions`` as
  ``{}``). ``to_json`` gives the JSON a learner writes: the fields of ``_ALWAYS``, then
  those of ``_WHEN_SET`` not None, then any others (the signature included) as they came.

  Attributes:
    name: the learner.
    status: ``live``, ``closing``, ``closed``, ``failed`` (or another word: not live).
    seq: the heartbeat's number within its incarnation (from 1).
    pid: the learner's process id.
    host: the learner's host name.
    joined_at: when the learner joined (UTC ISO).
    incarnation: this join of the name.
    step: the learner's global step.
    first_round: the first round it contributes to.
    final_rounds: the rounds its last contributions go to (while ``closing``).
    versions: the version of each fragment it holds, by fragment (as a string).
    step_seconds: seconds per step it reports, or None.
    trained: steps it trained since it joined.
    idle_seconds: seconds its ``step``/``close`` waited for commits.
    last_seen: when it wrote the heartbeat (UTC ISO, by its clock).
    loss: the last loss it reported, or None.
    closed_at: when it closed (UTC ISO), or None.
    error: why its background work failed (``failed``), or None.
    beat_seconds: seconds between its periodic beats.
    claim: the number of the incarnation's claim on the name (``gmjax.mail.names``).
    extra: fields this version does not know, kept in their order.
  """

  name: str
  status: str
  seq: int
  pid: Any = None
  host: str | None = None
  joined_at: str | None = None
  incarnation: Any = None
  step: int | None = None
  first_round: int | None = None
  final_rounds: tuple[int, ...] = ()
  versions: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: FrozenDict({}))
  step_seconds: float | None = None
  trained: int | None = None
  idle_seconds: float | None = None
  last_seen: str | None = None
  loss: float | None = None
  closed_at: str | None = None
  error: Any = None
  beat_seconds: float | None = None
  claim: int | None = None
  extra: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: FrozenDict({}))

  def __post_init__(self):
    object.__setattr__(self, "final_rounds", tuple(self.final_rounds))
    object.__setattr__(self, "versions", FrozenDict(dict(self.versions)))
    object.__setattr__(self, "extra", FrozenDict(dict(self.extra)))

  def to_json(self) -> dict[str, Any]:
    """The heartbeat as a learner writes it (see the class docstring)."""
    record = {name: getattr(self, name) for name in _ALWAYS}
    record["final_rounds"] = list(self.final_rounds)
    record["versions"] = dict(self.versions)
    record.update({name: getattr(self, name) for name in _WHEN_SET
                   if getattr(self, name) is not None})
    record.update(self.extra)
    return record

  @classmethod
  def from_json(cls, record: Mapping[str, Any]) -> Heartbeat:
    """A heartbeat that ``parse`` accepted (its checks are not repeated here)."""
    known = {name: record[name] for name in (*_ALWAYS, *_WHEN_SET)
             if record.get(name) is not None}
    return cls(**known, extra={k: v for k, v in record.items()
                               if k not in _ALWAYS and k not in _WHEN_SET})
