"""Adaptive steps: every learner trains for the same wall time per round.

With ``DiLoCo(adaptive_steps=True)`` a learner publishes round ``r`` at a deadline
rather than at the schedule's step. The round's period is

.. math:: T_r = \\mathrm{gap}(r) \\cdot s_{\\mathrm{fast}}

(``gap(r) = step_of(r) − step_of(r − 1)``, ``sync_every / fragments`` on average): the
time the fastest learner, at ``s_fast`` seconds per step, takes for the round's
scheduled steps. Each learner keeps its own clock, which never re-anchors on its own
publish times, so the learners' offsets stay those of their start:

* the first round's period starts when the learner pulls; round ``r + 1``'s starts at
  round ``r``'s deadline ``D_r`` (or when ``r`` was published, if that came first: its
  scheduled step was reached before the deadline), or, if the step that published ``r``
  blocked (waiting for a commit), when that wait ended, if later: every learner waiting
  on the same commit starts again from it; the time a step spends saving the learner's
  state (``state_dir``) moves the clock on as much (``RoundClock.pause``);
* the learner publishes round ``r`` at the first step where ``now + s_own / 2 ≥ D_r``
  (the step boundary nearest the deadline, so at least one step), or at the round's
  scheduled step if that comes first (the fastest learner, and every learner while no
  pace is known): a contribution never covers more steps than the schedule's.

``s_fast`` must be the same on every learner for a round, or their deadlines would drift
apart. For round ``r`` it is taken from the round record of ``r − 1 − P`` (``P``
fragments), which every learner holds once it has published round ``r − 1`` (that is
the base version it aligned with): the fastest pace its participants reported
(``fastest``). Before such a record exists (the first ``P + 1`` rounds), or when it
was pruned, the learner takes the fastest pace among the live learners' heartbeats and
its own, and moves the deadline earlier as faster paces become known.

A learner's pace (``step_seconds``) is the lower median of its last 16 times from one
``step`` call to the next: the caller's training and ``step``'s bookkeeping, so that the
fastest learner reaches its round's last scheduled step at the deadline its own pace
sets. After a ``step`` that published or merged a round it counts from that call's end:
never a wait the slowest learner sets, nor a round's one-off work (a first publish
compiles), which would stretch every learner's rounds.

References:
  Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language
  Models*, arXiv 2311.08105.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import numpy as np

from gmjax.core import guards
from gmjax.core.schedule import MAX_ESTIMATE_SECONDS, RoundSchedule
from gmjax.mail.commits import read_commit
from gmjax.mail.errors import CorruptRecord
from gmjax.mail.records import RoundRecord

log = logging.getLogger(__name__)


def late_because(adaptive: bool) -> str:
  """Why a learner is late for round after round, and what to do."""
  if adaptive:
    return ("with adaptive steps a round lasts the fastest learner's time for its steps,"
            " and one step of this learner (or a save of its state) takes longer than"
            " that; raise sync_every, or run this learner on faster hardware")
  return ("with fixed steps a learner slower than the others by more than the run's grace"
          " misses every round; pass adaptive_steps=True to gmjax.DiLoCo for learners of"
          " different speeds")


def fastest(seconds: Iterable[float | None]) -> float | None:
  """The fastest credible pace among reported seconds per step, or None if none is.

  Reports that are missing, zero, not finite or above ``MAX_ESTIMATE_SECONDS`` are
  ignored, and so is any more than ``guards.OUTLIER_FACTOR`` times faster than the
  lower median of the reports, and the fastest unless another report is within that
  factor of it: one learner that reports an absurdly fast pace cannot shrink every
  round to a single step, even beside one other learner, while fast learners that are
  half the pool or more set it (a lone report is taken as it is).

  Example:
    >>> from gmjax.mail import pace
    >>> pace.fastest([0.08, 0.02, 0.04, None])
    0.02
    >>> pace.fastest([1e-9, 0.04, 0.05])  # not credible beside the others'
    0.04
    >>> pace.fastest([2e-5, 0.02])  # of two, nobody vouches for it
    0.02
    >>> pace.fastest([0.01, 0.01, 0.5, 0.5])  # half the pool is fast
    0.01
  """
  values = sorted(float(s) for s in seconds
                  if isinstance(s, (int, float)) and not isinstance(s, bool)
                  and math.isfinite(s) and 0 < s <= MAX_ESTIMATE_SECONDS)
  if len(values) <= 1:
    return values[0] if values else None
  median = values[(len(values) - 1) // 2]
  # Sorted, every report but the fastest has a faster one within the factor of it; the
  # slowest always passes both tests.
  return next(s for i, s in enumerate(values)
              if s * guards.OUTLIER_FACTOR >= median
              and (i > 0 or values[1] <= s * guards.OUTLIER_FACTOR))


class RoundClock:
  """One learner's deadlines under adaptive steps (see the module docstring).

  Attributes:
    round: the round being trained toward.
    start: when its period began (``time.monotonic()``).
    deadline: when it is due, or None while no pace is known.
    planned_by_record: whether ``deadline`` comes from a round record (final for the
      round) rather than from heartbeats (it may still move earlier).
  """

  def __init__(self, schedule: RoundSchedule, round_: int, start: float):
    self.schedule = schedule
    self.round = round_
    self.start = start
    self.deadline: float | None = None
    self.planned_by_record = False

  def plan(self, fast_seconds: float | None, *, from_record: bool) -> None:
    """Sets the deadline from ``s_fast``: from a record once and for all, from
    heartbeats only earlier than the one set."""
    if fast_seconds is None or self.planned_by_record:
      return
    deadline = self.start + self.schedule.gap(self.round) * fast_seconds
    if from_record or self.deadline is None:
      self.deadline = deadline
    else:
      self.deadline = min(self.deadline, deadline)
    self.planned_by_record = from_record

  def due(self, now: float, own_seconds: float | None) -> bool:
    """Whether the step ending at ``now`` is the boundary nearest the deadline."""
    if self.deadline is None:
      return False
    return now + 0.5 * (own_seconds or 0.0) >= self.deadline

  def advance(self, now: float, resumed: float | None) -> None:
    """Moves on to the next round after publishing this one at ``now``.

    Args:
      now: when the publishing step ended.
      resumed: when that step's last wait for a commit ended, or None if it did not
        wait.
    """
    if self.deadline is None:
      start = now  # no pace was known: nothing to keep the learners together yet
    else:
      # Published before the deadline (the round's scheduled step came first: a pace
      # measured too slow), the next round starts now, not at a deadline still ahead,
      # which would push every later one as far.
      start = min(self.deadline, now)
      if resumed is not None:
        start = max(start, resumed)
    self.round += 1
    self.start = start
    self.deadline = None
    self.planned_by_record = False

  def pause(self, seconds: float) -> None:
    """Moves the period on by ``seconds`` the learner spent not training (a save)."""
    self.start += seconds
    if self.deadline is not None:
      self.deadline += seconds


class Pacer:
  """One learner's adaptive steps: its ``RoundClock`` and the paces of the round records
  it holds (see the module docstring).

  Args:
    schedule: the run's schedule.
    store: the run's store, to read a round record the learner does not hold.
    key: the run's signing key.
    name: the learner's name (for logs).
    live_paces: the seconds per step the live learners report, this one's included.
  """

  def __init__(self, schedule: RoundSchedule, store, key: bytes | None, name: str,
               live_paces: Callable[[], Iterable[float | None]]):
    self.schedule = schedule
    self._store, self._key, self._name = store, key, name
    self._live_paces = live_paces
    self._paces: dict[int, float | None] = {}  # round -> its record's fastest pace
    self.clock: RoundClock | None = None

  def note(self, record: RoundRecord) -> None:
    """Keeps the pace of the round ``record`` closed: the learner holds that record
    already, and need not read it from storage to plan."""
    if record.round is not None:
      self._paces[record.round] = fastest(p.step_seconds for p in record.participants)

  def start(self, round_: int, now: float) -> None:
    """Starts the clock of the learner's first round at ``now`` (its ``pull``)."""
    self.clock = RoundClock(self.schedule, round_, now)
    self._plan(read_record=True)

  def due(self, now: float, own_seconds: float | None) -> bool:
    """Whether the learner's step ending at ``now`` publishes the clock's round."""
    self._plan(read_record=False)
    return self.clock.due(now, own_seconds)

  def advance(self, now: float, resumed: float | None) -> None:
    """Moves the clock on after the learner published its round (``RoundClock.advance``)."""
    self.clock.advance(now, resumed)
    self._plan(read_record=True)

  def _plan(self, *, read_record: bool) -> None:
    """Sets the deadline of the round the clock times: from the record of round
    ``r − 1 − P`` when ``read_record`` and it is readable, else (and on later steps,
    until a record sets it) from the paces of the live learners."""
    clock = self.clock
    if clock.planned_by_record:
      return
    earlier = clock.round - 1 - self.schedule.fragments
    if read_record and earlier >= 0:
      for r in [r for r in self._paces if r < earlier - self.schedule.fragments]:
        del self._paces[r]
      if earlier not in self._paces:  # held as a newer version stood in for it
        try:
          self.note(read_commit(self._store, self.schedule.fragment_of(earlier),
                               self.schedule.version_after(earlier), self._key))
        except (FileNotFoundError, CorruptRecord) as error:
          # Pruned (the learner is far behind) or damaged: heartbeats stand in.
          log.info("learner %r: no pace from round %d's record (%r); using heartbeats",
                   self._name, earlier, error)
      clock.plan(self._paces.get(earlier), from_record=True)
      if clock.planned_by_record:
        return
    clock.plan(fastest(self._live_paces()), from_record=False)
