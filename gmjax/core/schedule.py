"""The round schedule and the timing estimates every runtime shares.

References:
  Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language
  Models*, arXiv 2311.08105.
  Douillard et al., *Streaming DiLoCo with overlapping communication*, arXiv 2501.18512.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Self

import numpy as np

from gmjax.core import guards

_EMA_DECAY = 0.1
# An observation counts for at most _RISE_FACTOR times the estimate plus _RISE_SECONDS:
# each estimate grows by at most 10% (and 10 ms) a round, whatever is observed.
_RISE_FACTOR = 2.0
_RISE_SECONDS = 0.1
_TIMEOUT_FACTOR = 3.0
_TIMEOUT_FLOOR_POLLS = 30
MAX_ESTIMATE_SECONDS = 86400.0
"""Each estimate is clamped to ``[0, MAX_ESTIMATE_SECONDS]`` (a day): a timeout built from
them stays finite and below ``9`` days whatever a record or a peer reports."""


def _clamp(seconds: Any) -> float | None:
  """An estimate as a number in ``[0, MAX_ESTIMATE_SECONDS]``; None if it is not one."""
  if isinstance(seconds, int) and not isinstance(seconds, bool):
    # Clamped as an int first: a JSON integer past a float's range is still a number.
    seconds = min(max(seconds, 0), MAX_ESTIMATE_SECONDS)
  try:
    seconds = float(seconds)
  except (TypeError, ValueError, OverflowError):
    return None
  if math.isnan(seconds):
    return None
  return min(max(float(seconds), 0.0), MAX_ESTIMATE_SECONDS)


@dataclasses.dataclass(frozen=True)
class RoundSchedule:
  """Which fragment each round synchronizes and at which global step.

  Round ``r`` targets fragment ``r mod P`` at global step

  .. math:: \\mathrm{step\\_of}(r) = (r \\operatorname{div} P) H + \\lfloor ((r \\bmod P) + 1) H / P \\rfloor

  so every fragment is synchronized exactly once per ``H`` global steps and the gaps
  between consecutive rounds sum to ``H``.

  Attributes:
    sync_every: ``H``, global steps between two syncs of one fragment.
    fragments: ``P``, the number of fragments, ``1 <= P <= H``.
    in_flight: rounds a learner may keep outstanding.
    overlap_steps: ``tau``, steps a learner may train past publishing a round before it
      waits for that round's commit; ``None`` bounds waiting by ``in_flight`` alone.
  """

  sync_every: int
  fragments: int
  in_flight: int = 1
  overlap_steps: int | None = None

  def __post_init__(self):
    for field in ("sync_every", "fragments", "in_flight"):
      value = _whole(getattr(self, field))
      if value is None or value < 1:
        raise ValueError(f"RoundSchedule {field} must be a positive int, got"
                         f" {guards.quote(getattr(self, field))}.")
      object.__setattr__(self, field, value)  # a numpy integer as a Python int
    if self.fragments > self.sync_every:
      raise ValueError(
          f"RoundSchedule needs fragments <= sync_every, got fragments={self.fragments} and"
          f" sync_every={self.sync_every}; use fewer fragments or sync less often."
      )
    tau = self.overlap_steps
    if tau is not None:
      whole = _whole(tau)
      if whole is None or not 0 <= whole < self.sync_every:
        raise ValueError(
            f"RoundSchedule overlap_steps must be None or an int in [0, sync_every), got"
            f" {guards.quote(tau)} with sync_every={self.sync_every}: the next round of a"
            " fragment needs the merged anchor.")
      object.__setattr__(self, "overlap_steps", whole)

  # Rounds and steps are ints (numpy integers too); each method names a bad one
  # (``_index``): a float or bool round would give a step or fragment that is none.
  def fragment_of(self, round: int) -> int:  # pylint: disable=redefined-builtin
    """The fragment round ``round`` (>= 0) synchronizes."""
    return _index("fragment_of", "round", round, 0) % self.fragments

  def step_of(self, round: int) -> int:  # pylint: disable=redefined-builtin
    """The global step of round ``round``'s sync; ``step_of(-1)`` is 0, the start."""
    cycle, position = divmod(_index("step_of", "round", round, -1), self.fragments)
    return cycle * self.sync_every + (position + 1) * self.sync_every // self.fragments

  def version_after(self, round: int) -> int:  # pylint: disable=redefined-builtin
    """The version of its fragment that round ``round`` (>= 0) commits."""
    return _index("version_after", "round", round, 0) // self.fragments + 1

  def gap(self, round: int) -> int:  # pylint: disable=redefined-builtin
    """Global steps from round ``round − 1``'s sync (the start, for round 0) to
    round ``round``'s."""
    round = _index("gap", "round", round, 0)  # pylint: disable=redefined-builtin
    return self.step_of(round) - self.step_of(round - 1)

  def round_at(self, step: int) -> int | None:
    """The round whose sync happens at global ``step`` (``>= 0``), or None if no round
    does."""
    return self._round_at(_index("round_at", "step", step, 0))

  def _round_at(self, step: int) -> int | None:
    """``round_at`` of any int ``step`` (None before step 1)."""
    if step < 1:
      return None
    cycle, offset = divmod(step, self.sync_every)
    if offset == 0:
      return cycle * self.fragments - 1
    for position in range(self.fragments):
      if (position + 1) * self.sync_every // self.fragments == offset:
        return cycle * self.fragments + position
    return None

  def due(self, count: int) -> bool:
    """Whether ``gmjax.diloco``'s update at state count ``count`` does round work.

    That update (the ``count``-th, from 0; it makes the global step ``count + 1``) does
    when it is the first (``count == 0``: every learner adopts learner 0's start), when
    a fragment syncs at its step, or when one merges ``overlap_steps`` after its sync.
    Every other update may be compiled without the round,
    ``update(..., between_rounds=True)``.

    Raises:
      ValueError: ``count`` is not an int >= 0, or ``overlap_steps`` is None (the
        in-mesh schedule needs an int).
    """
    value = _whole(count)
    if value is None or value < 0:
      raise ValueError(
          f"RoundSchedule.due(count={guards.quote(count)}): pass the state's step count,"
          " an int >= 0 (the number of updates the state has had), e.g. counted on the"
          " host as the updates are made, int(state.count) for one learner's state, or"
          " int(state.count[0]) for the state of learners stacked on a leading axis.")
    count = value
    if self.overlap_steps is None:
      raise ValueError(
          "RoundSchedule.due: overlap_steps is None; the in-mesh schedule merges a fixed"
          " number of steps after each sync: build it from a DiLoCo whose overlap_steps"
          " is an int.")
    step = int(count) + 1
    return (count == 0 or self._round_at(step) is not None
            or self._round_at(step - self.overlap_steps) is not None)

  def first_round_after(self, step: int) -> int:
    """The first round whose sync step is strictly after global ``step`` (``>= 0``)."""
    step = _index("first_round_after", "step", step, 0)
    r = max(0, (step // self.sync_every) * self.fragments - 1)
    while self.step_of(r) <= step:
      r += 1
    return r


@dataclasses.dataclass(frozen=True)
class Estimates:
  """Exponential moving averages of the round timings, carried from record to record.

  ``step`` is the learners' reported seconds per training step, ``quorum`` the seconds
  from a round's first aggregated contribution to its median one (the mail closer's
  ``arrival_spread``) and ``sync`` the seconds from closing to a durable commit.
  Each is ``None`` until its first observation, which is taken as is; later ones move the
  average by ``0.1·(min(new, 2·old + 0.1 s) - old)``, so no estimate (hence no timeout
  built from them) grows by more than 10% and 10 ms a round: a round that took long
  cannot lengthen the next round's wait much, and that round's length cannot feed back.
  """

  step: float | None = None
  quorum: float | None = None
  sync: float | None = None

  def updated(
      self,
      *,
      step: float | None = None,
      quorum: float | None = None,
      sync: float | None = None,
  ) -> Self:
    def ema(old: float | None, new: float | None) -> float | None:
      new = None if new is None else _clamp(new)
      if new is None:
        return old
      if old is None:
        return float(new)
      new = min(new, _RISE_FACTOR * old + _RISE_SECONDS)
      return old + _EMA_DECAY * (new - old)

    return dataclasses.replace(
        self,
        step=ema(self.step, step),
        quorum=ema(self.quorum, quorum),
        sync=ema(self.sync, sync),
    )

  def timeout(self, poll_interval: float) -> float:
    """Seconds after which a round these estimates describe is presumed not to commit.

    ``max(30·poll_interval, 3·(step + quorum + sync))`` with unknown terms left out.
    """
    expected = sum(s for s in (self.step, self.quorum, self.sync) if s is not None)
    return max(_TIMEOUT_FLOOR_POLLS * poll_interval, _TIMEOUT_FACTOR * expected)

  def to_json(self) -> dict[str, float | None]:
    return {"step": self.step, "quorum": self.quorum, "sync": self.sync}

  @classmethod
  def from_json(cls, record) -> Self:
    record = record if isinstance(record, dict) else {}
    return cls(**{k: (None if record.get(k) is None else _clamp(record[k]))
                  for k in ("step", "quorum", "sync")})


def _index(method: str, argument: str, value: Any, least: int | None) -> int:
  """``value`` as an int (at least ``least`` unless None), or a ValueError that names
  ``RoundSchedule.<method>``, its argument and the value."""
  whole = _whole(value)
  if whole is None or (least is not None and whole < least):
    wanted = "an int" if least is None else f"an int >= {least}"
    raise ValueError(f"RoundSchedule.{method}({argument}={guards.quote(value)}) needs {wanted}"
                     f" ({'rounds count' if argument == 'round' else 'global steps count'}"
                     " from 0).")
  return whole


def _whole(count: Any) -> int | None:
  """``count`` as a Python int if it is an integer scalar (an int, a numpy integer, a
  0-d integer array, concrete), else None (a bool, a float, a vector)."""
  if isinstance(count, (bool, np.bool_)) or np.dtype(getattr(count, "dtype", np.int64)) == bool:
    return None
  try:
    return operator.index(count)
  except TypeError:
    return None
