"""A mail learner's own state under ``outer_delay=1`` (``gmjax.core.eager``).

Per fragment, in host memory: the start ``S`` of the current inner phase (F32), which
the learner's delta is taken from, and with ``eager`` the correction ``p``, the learner's
last decoded delta, and its own copy of the outer optimizer's state. After publishing
the delta of round ``k`` the learner takes Θ of the round before (version ``v − 1``,
which had a whole inner phase to land) and starts the next phase at
``S = Θ_{v−1} + p``. Like error feedback's residuals, none of it is stored: a learner
that joins again starts from ``p = 0`` at the newest Θ.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from gmjax.core import eager
from gmjax.mail import heartbeats
from gmjax.mail.records import RoundRecord

_proxy = jax.jit(eager.proxy)
log = logging.getLogger(__name__)


class Delay:
  """The delayed (and eager) learner's state of every fragment."""

  def __init__(self, config: Any, plan: tuple[tuple[str, ...], ...]):
    self.eager = bool(config.eager)
    self.plan = plan
    self._tx = config.outer_transform() if self.eager else None
    self._correct = (jax.jit(lambda d, s, p, names: eager.correct(self._tx, d, s, p, names),
                             static_argnums=3) if self.eager else None)
    self.starts: dict[int, dict[str, np.ndarray]] = {}
    self._correction: dict[int, dict[str, np.ndarray]] = {}
    self._previous: dict[int, dict[str, np.ndarray]] = {}
    self._states: dict[int, Any] = {}

  def begin(self, fragment: int, theta: Mapping[str, np.ndarray]) -> None:
    """Starts ``fragment`` afresh at ``theta`` (pull): no correction, no last delta."""
    names = self.plan[fragment]
    self.starts[fragment] = {n: np.asarray(theta[n], np.float32).copy() for n in names}
    if self.eager:
      zeros = {n: np.zeros(np.shape(theta[n]), np.float32) for n in names}
      self._correction[fragment] = dict(zeros)
      self._previous[fragment] = {n: z.copy() for n, z in zeros.items()}
      self._states[fragment] = eager.initial_state(self._tx, zeros, names)

  def advance(self, fragment: int, theta: Mapping[str, np.ndarray],
              sent: Mapping[str, Any] | None, weight: float) -> dict[str, np.ndarray]:
    """The start of the next phase of ``fragment``: ``theta`` (the Θ before the round
    just published) plus, eager, the correction for ``sent`` (the learner's decoded
    delta of that round; None: it sent nothing) at ``weight`` (its weight in the round
    that made ``theta``)."""
    names = self.plan[fragment]
    start = {n: np.asarray(theta[n]).astype(np.float32) for n in names}
    if self.eager:
      previous = self._previous[fragment]
      mine = {n: np.zeros_like(previous[n]) if sent is None
              else np.asarray(jax.device_get(sent[n]), np.float32) for n in names}
      if not all(np.all(np.isfinite(v)) for v in mine.values()):
        mine = {n: np.zeros_like(v) for n, v in mine.items()}
      d = _proxy(mine, previous, np.float32(weight))
      correction, state = self._correct(d, self._states[fragment],
                                        self._correction[fragment], names)
      correction = {n: np.asarray(v) for n, v in jax.device_get(correction).items()}
      # eager.start_finite on the host, where Θ lies (no copy of it to the device).
      with np.errstate(over="ignore", invalid="ignore"):
        finite = all(np.all(np.isfinite((start[n] + correction[n]).astype(
            np.asarray(theta[n]).dtype))) for n in names)
      if not finite:
        # An outer step of its own that overflowed: it starts at Θ (gmjax.core.eager).
        log.warning("eager: the correction of fragment %d is not finite at the"
                    " parameters' dtypes; it is dropped, and the learner starts at Θ",
                    fragment)
        correction, state = eager.restart(self._tx, False, correction, state, names)
        correction = {n: np.asarray(v) for n, v in jax.device_get(correction).items()}
      self._correction[fragment] = correction
      self._states[fragment] = state
      self._previous[fragment] = mine
      start = {n: start[n] + self._correction[fragment][n] for n in names}
    self.starts[fragment] = start
    return start


def weight_of(record: RoundRecord, learner: str) -> float:
  """``learner``'s weight in the round that ``record`` commits (0 if it is not in it, or
  no outer step was applied)."""
  if not record.outer_step:
    return 0.0
  return next((p.weight for p in record.participants if p.learner == learner), 0.0)


def _from_process_zero(value: int, process_count: int) -> int:
  if process_count <= 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def every_process(versions: dict[int, int], process_count: int) -> list[dict[int, int]]:
  """Each process's ``versions`` (an int key -> an int, e.g. fragment -> version), in
  process order (they call this in lockstep)."""
  if process_count <= 1:
    return [versions]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  order = sorted(versions)
  rows = multihost_utils.process_allgather(np.asarray([versions[f] for f in order], np.int64))
  return [dict(zip(order, map(int, row))) for row in np.asarray(rows).reshape(
      process_count, len(order))]


def agreed(flag: bool, process_count: int) -> bool:
  """Process 0's ``flag`` on every process of a learner (they call this in lockstep)."""
  return bool(_from_process_zero(int(flag), process_count))


def first_weight(store: Any, key: bytes | None, liveness_timeout: float,
                 process_count: int) -> float:
  """``1/M`` before any round, ``M`` the learners live now (process 0's count in a
  multi-process learner, so that every process computes the same start)."""
  roster = heartbeats.Roster(store, key)
  roster.refresh()
  return 1.0 / max(1, _from_process_zero(roster.live_count(liveness_timeout),
                                         process_count))
