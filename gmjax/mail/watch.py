"""What one observer knows about an open round, and what it makes of it at the close.

A ``Watch`` is one learner's view of a round it watches: the contributions it listed and
validated (``gmjax.mail.closer.Closer.scan`` fills it), when each arrived, and when the
round reached its quorum, became complete and became closable (``Closer.decide``). The
functions here read a watch and nothing else (no store, no clock): ``screen`` (the
contributions as they are aggregated: outliers rejected, tokens clamped),
``arrival_spread`` (the run's quorum estimate) and ``round_waits`` (the waits the round
record carries). They live apart from ``gmjax.mail.closer``, which reads storage, decides
and commits, so that what a round saw reads in one place and how it closes in another.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Container
from typing import Any

import numpy as np

from gmjax.core import guards
from gmjax.core.records import Contribution
from gmjax.mail import contributions
from gmjax.mail import heartbeats
from gmjax.mail.errors import ContributionRejected

log = logging.getLogger("gmjax.mail.closer")  # one log for closing rounds, whichever part writes


@dataclasses.dataclass
class Watch:
  """What one observer knows about one open round."""

  round: int
  fragment: int
  version: int
  found: dict[str, Contribution | ContributionRejected] = dataclasses.field(
      default_factory=dict)
  markers: dict[str, str | None] = dataclasses.field(default_factory=dict)  # when found
  arrived: dict[str, float] = dataclasses.field(default_factory=dict)  # first listed
  listed: set[str] = dataclasses.field(default_factory=set)  # seen, not yet validated
  norms: dict[str, float] = dataclasses.field(default_factory=dict)  # per step, by learner
  clamped: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  opened: float | None = None
  opened_at: str | None = None
  quorum_seen: float | None = None
  complete_since: float | None = None  # every live learner had contributed
  closable_since: float | None = None

  @property
  def valid(self) -> list[Contribution]:
    return [c for c in self.found.values() if isinstance(c, Contribution)]

  @property
  def rejected(self) -> list[ContributionRejected]:
    return [c for c in self.found.values() if isinstance(c, ContributionRejected)]

  @property
  def contributors(self) -> set[str]:
    """Learners with a contribution here, valid or not yet validated (a rejected file
    does not stand for its learner)."""
    return {c.learner for c in self.valid} | {
        contributions.learner_of(entry) for entry in self.listed}

  def to_read(self, listing: dict[str, str | None], known: Container[str] = ()) -> list[str]:
    """The entries of ``listing`` (name -> change marker) to read: new ones, rejected
    ones that changed since (or whose change the store cannot tell), and those rejected
    unread as a stranger's whose learner is ``known`` now (its heartbeat was bad then)."""
    entries = []
    for entry, marker in listing.items():
      found = self.found.get(entry)
      if entry.endswith(".tmp") or isinstance(found, Contribution):
        continue
      if entry not in self.found or marker is None or self.markers.get(entry) != marker or (
          found.reason == contributions.UNKNOWN and found.learner in known):
        entries.append(entry)
    return entries


def screen(watch: Watch, factor: float | None = guards.OUTLIER_FACTOR
           ) -> tuple[list[Contribution], list[ContributionRejected], list[dict[str, Any]]]:
  """The round's contributions as they are aggregated: outliers rejected, tokens clamped,
  by ``factor`` (``DiLoCo.outlier_factor``; None: neither).

  Returns:
    ``(valid, rejected, clamped)``: the contributions to aggregate (sorted by learner,
    tokens clamped), every rejection (outliers included) and every clamp, as the round
    record lists them.
  """
  valid = sorted(watch.valid, key=lambda c: c.learner)
  rejected = list(watch.rejected)
  clamped = [c for c in watch.clamped if c["learner"] in {v.learner for v in valid}]
  norms = np.asarray([watch.norms[c.learner] for c in valid], np.float64)
  if factor is None:
    return valid, rejected, clamped
  references = guards.reference(norms)
  kept = []
  for contribution, norm, reference, outlier in zip(
      valid, norms, references, guards.outliers(norms, factor)):
    if outlier:
      rejected.append(ContributionRejected(
          contribution.learner,
          f"delta norm per step {norm:.3g} is an outlier: more than"
          f" {factor:g}x {reference:.3g}, the lower median of the round's"))
      log.warning("round %d: %s", watch.round, rejected[-1])
    else:
      kept.append(contribution)
  valid = []
  for contribution, cap in zip(kept, token_caps([c.tokens for c in kept],
                                                [c.steps for c in kept], factor)):
    if cap is not None and contribution.tokens > cap:
      clamped.append({"learner": contribution.learner, "field": "tokens",
                      "reported": contribution.tokens, "used": cap})
      contribution = dataclasses.replace(contribution, tokens=cap)
    valid.append(contribution)
  return valid, rejected, clamped


def token_caps(tokens: list[int], steps: list[int], factor: float) -> list[int | None]:
  """Each kept contribution's most tokens: ``factor`` times the lower median of the
  kept ones' tokens per step, times its own steps (None: no other to judge it by).

  Formed as the in-mesh screening forms it (``gmjax.transform.screen.judge``: the
  reference count and the factor in F32, their product floored), so that both runtimes
  clamp alike for any factor, not only one F32 holds exactly; a product past F32's
  range caps nothing.
  """
  per_step = np.asarray([t / s for t, s in zip(tokens, steps)], np.float64)
  with np.errstate(over="ignore"):  # a cap past F32's range caps nothing, as in-mesh
    caps = [np.floor(np.float32(factor) * np.float32(reference * count))
            for reference, count in zip(guards.reference(per_step), steps)]
  return [int(cap) if np.isfinite(cap) else None for cap in caps]


def arrival_spread(watch: Watch, valid: list[Contribution]) -> float | None:
  """Seconds from the first aggregated contribution's arrival to the lower median's: the
  run's quorum estimate.

  Counted over the contributions that are aggregated only (a rejected or planted file
  arrives whenever its writer likes), and a median, so learners that always publish
  late, fewer than half of them, move neither this nor the timeouts built from it. The
  round's own wait (``quorum_seconds``, until every live learner was in) is recorded,
  never fed back: a late learner stretches its round, not the next ones' grace.

  Returns:
    The spread, or None when this observer saw no aggregated contribution arrive.
  """
  aggregated = {c.learner for c in valid}
  times = sorted(at for entry, at in watch.arrived.items()
                 if isinstance(watch.found.get(entry), Contribution)
                 and watch.found[entry].learner in aggregated)
  if not times:
    return None
  return times[(len(times) - 1) // 2] - times[0]


def round_waits(watch: Watch, decided: float) -> dict[str, float | None]:
  """The round's waits as this closer saw them, up to ``decided`` (when it closed).

  Returns:
    ``wait_seconds`` (from the round's opening here, the first contribution this closer
    listed, to the close), ``grace_seconds`` (from the quorum to closable: the wait past
    the quorum for the rest, until they were all in or the grace ran out) and
    ``takeover_seconds`` (from closable to the close: a follower waiting on the
    designated closer); None where this closer did not see the moment.
  """
  def between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)

  return {"wait_seconds": between(watch.opened, decided),
          "grace_seconds": between(watch.quorum_seen, watch.closable_since),
          "takeover_seconds": between(watch.closable_since, decided)}


class Known:
  """Learner names with a heartbeat; a miss refreshes the roster, at most once a scan.

  A learner writes its heartbeat before any contribution, so a roster read after a
  scan's listing (``since``, set before the scan lists) knows every learner whose file
  the listing holds: files planted under a thousand names cost one refresh, not one each.
  """

  def __init__(self, roster: heartbeats.Roster):
    self._roster = roster
    self.since = float("-inf")

  def __contains__(self, name: object) -> bool:
    if name in self._roster.records:
      return True
    if self._roster.refreshed >= self.since:
      return False
    self._roster.refresh()
    return name in self._roster.records
