"""A learner's rounds: publishing them, merging their commits, delayed phases, the flush.

Which rounds a learner contributes to, and at which base version:

* It starts at global step ``S`` (``Run.start_step``: the newest committed round's, or
  the step before an older round not committed) and contributes to every round ``r``
  with ``step_of(r) > S``, at the step that reaches ``step_of(r)`` (``first_round``).
* A contribution to round ``r`` of fragment ``f`` is ``anchor_f − θ_f`` against base
  version ``r div P`` (the version the round's closer starts from). Before publishing it
  the learner aligns ``f`` with that version if it does not hold it yet.
* With ``error_feedback = β`` it publishes ``encode(β·e_f + Δ)`` instead, and keeps the
  residual ``e_f ← β·e_f + Δ − decode(...)`` (``gmjax.core.feedback``) in host memory,
  F32, one per fragment. A learner that restarts (joins again) starts from zero
  residuals, which loses at most what they held, unless it keeps its state
  (``gmjax.mail.learner_state``).
* With ``outer_delay = 1`` (``gmjax.mail.delayed``) the delta of round ``r`` is taken
  from the start of the learner's phase (base version ``r div P − 1``, or the version it
  joined at), and right after publishing it the learner starts its next phase from the
  version before ``r``'s, waiting only if that commit has not landed within a whole
  phase; with ``eager`` plus its own correction.
* With ``overlap_steps = τ`` the commit of a round published at step ``s`` is merged at
  step ``s + τ`` (waiting for it if needed); with ``τ = None`` it is merged at the first
  ``step`` after it lands. At most ``in_flight`` rounds stay outstanding. If the round was
  committed before the learner got to it (it was late), it publishes nothing and merges
  the commit.
* A contribution's ``steps`` and ``tokens`` are those trained since the learner last
  published the fragment, except with ``overlap_steps = None`` and ``mixing = 0``: there
  a merge replaces the fragment by Θ, and with it every step trained before it (the
  merging step's own included), so the counts start again at each merge and a
  contribution counts exactly the steps its delta ``anchor − θ`` holds. A step that
  would publish round ``r`` but merged ``r``'s fragment (its commit landed just then, or
  ``in_flight`` or ``r``'s base version made the learner wait for it) has nothing of its
  own to send: it does not reach ``step_of(r)`` (``step_count`` stays at
  ``step_of(r) − 1``, or below with adaptive steps) and the next step publishes ``r``
  with that one step. A final contribution (``flush_on_close``) of a fragment merged
  since its last step is left out. With ``mixing > 0`` a merge keeps a share of the
  local progress, and with an integer ``τ`` every learner trains the same ``τ`` steps
  past each publish, as in-mesh: the counts run from the publish.
* With ``adaptive_steps`` (``gmjax.mail.pace``) it publishes round ``r`` at the step
  nearest the round's deadline instead, or at ``step_of(r)`` if it gets there first;
  ``step_count`` then counts its steps but stays below ``step_of(r)`` until it
  publishes ``r``, when it jumps to ``step_of(r)`` (so the schedule, the records and a
  joining learner see the same global steps), and ``local_step`` counts the steps it
  trained (what a learning-rate schedule should follow). ``overlap_steps`` then counts
  the learner's own steps. In a multi-process learner process 0 decides when a round is
  due and every process follows it (a small broadcast each step).

``Rounds`` carries this out for ``gmjax.mail.learner.Learner``, which inherits it, on
the training thread (a learner leaving publishes its final rounds: ``_flush``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import numpy as np

from gmjax.core import feedback
from gmjax.core.schema import Schema
from gmjax.mail import delayed
from gmjax.mail import heartbeats
from gmjax.mail import pace
from gmjax.mail import placement
from gmjax.mail import retention
from gmjax.mail import states
from gmjax.mail.errors import RoundTimeout
from gmjax.mail.worker_jobs import Commit, Publish

log = logging.getLogger("gmjax.mail.learner")  # one log for the learner, whichever part writes
LATE_WARNING = 3  # rounds in a row a learner is late for before it is told why


class NonFiniteDelta(ValueError):
  """A learner's delta that it encodes itself (error feedback, eager) is not finite."""


class Rounds:
  """The learner's round work; ``Learner`` inherits it (see the module docstring).

  It keeps no state of its own: it reads the learner's ``schedule``, ``manifest``,
  ``config``, ``name``, ``store``, ``key``, ``primary``, ``process_count``,
  ``first_round``, ``_pacer`` and ``_step_seconds``, updates its ``step_count``,
  ``_anchors``, ``_versions``, ``_outstanding`` (``(round, version, due step)``),
  ``_unadopted``, ``_futures``, ``_steps_since``, ``_tokens_since``, ``_residuals``,
  ``_delay``, ``_applied``, ``_late_rounds``, ``_pulled_records``, ``_round_work``,
  ``_spent``, its wait accounting (``idle_seconds``, ``_resumed``), and asks its
  ``worker.Worker`` for commits.
  """

  def _step_rounds(self, flat: dict[str, Any]) -> None:
    """A counted step's round work: merges the commits due, publishes the round the
    step reaches (by the schedule, or by its pace with adaptive steps), merges again.

    A ``RoundTimeout`` here leaves the step counted and its round unpublished or not
    merged, and so does a delta that is not finite (``NonFiniteDelta``, its heartbeat
    failed); the learner then takes no more steps (``_spent``): the next would skip that
    round, and its delta would hold more steps than a round allows.
    """
    try:
      self._merge_due(flat)
      round_ = self.schedule.round_at(self.step_count)
      if self._pacer is not None and round_ is None:
        due = self._pacer.due(time.monotonic(), self._step_seconds)
        if self.process_count > 1:
          due = delayed.agreed(due, self.process_count)  # every process follows process 0
        if due:
          round_ = self._pacer.clock.round
      if round_ is not None and round_ >= self.first_round:
        self._round_work = True
        if self._publish_round(flat, round_, final=False):
          self.step_count = max(self.step_count, self.schedule.step_of(round_))
          self._merge_due(flat)
          if self._pacer is not None:
            self._pacer.advance(time.monotonic(), self._resumed)
        else:
          # Its fragment merged at this step, and Θ replaced every step trained in it:
          # the step does not reach the round; the next one publishes it, with that step.
          self.step_count = min(self.step_count, self.schedule.step_of(round_) - 1)
    except RoundTimeout:
      self._spent = ("an earlier step() raised RoundTimeout, and a step after it would skip"
                     " that step's round: close(params) this learner (it waits for its rounds"
                     " again) and join again (with a state_dir, restore goes on from its save)")
      raise
    except NonFiniteDelta as error:  # failed, as a learner whose publish fails
      self._spent = f"an earlier step()'s delta was not finite ({error}): join again"
      if self._beats is not None:
        self._beats.fail(error)
      raise

  def _deadline(self) -> float:
    limit = self.wait_timeout
    if limit is None:
      limit = max(120.0, 10 * self._worker.timeout())
    return time.monotonic() + limit

  def _future(self, fragment: int, version: int) -> concurrent.futures.Future:
    key = (fragment, version)
    if key not in self._futures:
      self._futures[key] = self._worker.request(fragment, version)
    return self._futures[key]

  def _wait(self, fragment: int, version: int, deadline: float) -> Commit:
    future = self._future(fragment, version)
    what = f"version {version} of fragment {fragment}"
    if future.done():
      return self._noted(self._worker.wait(future, deadline, what))
    started = time.monotonic()
    try:
      return self._noted(self._worker.wait(future, deadline, what))
    finally:
      self._resumed = time.monotonic()
      self.idle_seconds += self._resumed - started

  def _noted(self, commit: Commit) -> Commit:
    if self._pacer is not None:
      self._pacer.note(commit.record)
    return commit

  def _overlap_clock(self) -> int:
    """The step count ``overlap_steps`` is counted in: the learner's own steps with
    adaptive steps (its global step jumps), the global step otherwise."""
    return self.local_step if self.adaptive else self.step_count

  def _align(self, flat: dict[str, Any], fragment: int, version: int,
             theta: dict[str, np.ndarray], record: Any = None) -> None:
    names_ = self.manifest.plan[fragment]
    # After a round with no outer step (skipped) a reset to Θ, as in-mesh: no mixing.
    mixing = 0.0 if record is not None and not record.outer_step else self.config.mixing
    merged = placement.align({n: flat[n] for n in names_}, {n: theta[n] for n in names_},
                             mixing=float(mixing))
    for n in names_:
      flat[n] = placement.like(merged[n], flat[n])
    self._anchors[fragment] = theta
    self._versions[fragment] = version
    self._applied += 1
    if self._merge_discards:
      self._steps_since[fragment] = self._tokens_since[fragment] = 0
    for key in [k for k in self._futures if k[0] == fragment and k[1] <= version]:
      del self._futures[key]
    if self._pulled and version > 0:
      self._starting = False

  def _bring_to(self, flat: dict[str, Any], fragment: int, version: int,
                deadline: float | None = None) -> None:
    """Aligns ``fragment`` with ``version`` (waiting for its commit) if it is older."""
    if self._versions[fragment] >= version:
      return
    commit = self._wait(fragment, version, deadline or self._deadline())
    # A version pruned since is stood in for by the newest (gmjax.mail.retention).
    self._align(flat, fragment, commit.record.version, commit.theta, commit.record)

  def _merge_due(self, flat: dict[str, Any], *, force: int = 0) -> None:
    """Merges outstanding commits that are due, and the oldest ``force`` ones anyway."""
    while self._outstanding:
      round_, version, due = self._outstanding[0]
      fragment = self.schedule.fragment_of(round_)
      if force > 0 or (due is not None and self._overlap_clock() >= due):
        force -= 1
        self._bring_to(flat, fragment, version)
      elif due is None:
        self._worker.check()
        future = self._future(fragment, version)
        if not future.done():
          break
        commit = self._noted(future.result())
        if commit.record.version > self._versions[fragment]:
          self._align(flat, fragment, commit.record.version, commit.theta, commit.record)
      else:
        break
      self._outstanding.pop(0)
      self._round_work = True

  def _publish_round(self, flat: dict[str, Any], round_: int, *, final: bool,
                     deadline: float | None = None) -> bool:
    """Publishes this learner's contribution to ``round_`` after the merges it needs.

    Returns:
      False, publishing nothing, when those merges (or one earlier in this step) left
      nothing trained in the round's fragment (overlap_steps=None with mixing 0): there
      is no honest contribution of zero steps. True otherwise (also when the round was
      committed without this learner, which then merges it).
    """
    fragment = self.schedule.fragment_of(round_)
    version = self.schedule.version_after(round_)
    while not final and len(self._outstanding) >= self.schedule.in_flight:
      self._merge_due(flat, force=1)
    delayed_ = self._delay is not None
    if not delayed_:
      self._bring_to(flat, fragment, version - 1, deadline)
    if self._steps_since[fragment] == 0:
      return False
    base = self._versions[fragment] if delayed_ else version - 1
    steps, count = self._steps_since[fragment], self._tokens_since[fragment]
    self._steps_since[fragment] = self._tokens_since[fragment] = 0
    if not delayed_ and version <= self._versions[fragment]:
      # Committed and pruned, and the newer version that stood in for it is merged
      # already (gmjax.mail.retention): that Θ is where this round puts the learner, late.
      self._align(flat, fragment, self._versions[fragment], self._anchors[fragment])
      self._count_late(round_, self.primary)
      return True
    if final or self.schedule.overlap_steps is None:
      due = None
    else:
      due = self._overlap_clock() + self.schedule.overlap_steps
    names_ = self.manifest.plan[fragment]
    # Every process gathers the fragment (a collective); only the primary publishes.
    snapshot = {n: placement.to_host(flat[n]) for n in names_}
    reference = self._delay.starts[fragment] if delayed_ else self._anchors[fragment]
    sent = None
    eager_ = delayed_ and self._delay.eager
    late = self.primary and (self._versions[fragment] >= version or retention.is_committed(
        self.store, fragment, version, self.key, self.manifest.keep_versions))
    if eager_:
      late = delayed.agreed(late, self.process_count)  # every process follows process 0
    self._count_late(round_, late)
    if not late and (self.primary or eager_):
      delta = placement.delta({n: reference[n] for n in names_}, snapshot)
      payload = {"delta": delta}
      if eager_ or self._residuals is not None:
        # Encoded here, where the residual and the eager correction (every process's) live:
        # both must follow these bytes. A delta not finite is NonFiniteDelta, not sent.
        residual = None if self._residuals is None else self._residuals[fragment]
        entries, sent, residual = _encode(self.config, self.manifest.schema.subset(names_),
                                          residual, delta, decode=eager_)
        if residual is not None:
          self._residuals[fragment] = residual
        payload = {"entries": entries}
      if self.primary:
        self._worker.publish(Publish(
            round=round_, fragment=fragment, base_version=base, local_step=self.local_step,
            steps=steps, tokens=count, step_seconds=self._step_seconds or 0.0, final=final,
            **payload))
    self._future(fragment, version)
    if delayed_ and not final:
      self._unadopted.append((round_, version, None))
      self._start_next_phase(flat, fragment, version - 1, sent, deadline)
    else:
      self._outstanding.append((round_, version, due))
    return True

  def _count_late(self, round_: int, late: bool) -> None:
    """Counts the rounds in a row closed before the learner got to them; warns at 3."""
    self._late_rounds = self._late_rounds + 1 if late else 0
    if late:
      log.info("learner %r: round %d closed before it got there; merging it", self.name,
               round_)
    if self._late_rounds == LATE_WARNING:
      log.warning(
          "learner %r: %d rounds in a row closed before it got to them (the last, %d),"
          " and the steps it trains count for nothing: %s", self.name,
          self._late_rounds, round_, pace.late_because(self._pacer is not None))

  def _start_next_phase(self, flat: dict[str, Any], fragment: int, version: int,
                        sent: Any, deadline: float | None) -> None:
    """Delayed: the next phase of ``fragment`` starts at ``version`` (+ the eager
    correction), the version before the round just published."""
    if version > self._versions[fragment]:
      commit = self._wait(fragment, version, deadline or self._deadline())
      theta, record = commit.theta, commit.record
      version = record.version  # newer when the version asked for was pruned
    else:  # held already: the version this learner joined at (its record from pull())
      theta, record = self._anchors[fragment], self._pulled_records.get(fragment)
    eager_ = self._delay.eager
    if eager_ and version > 0 and (record is None or record.version != version):
      try:
        record = states.read_commit(self.store, fragment, version, self.key)
      except FileNotFoundError:  # pruned (gmjax.mail.retention): its weight is gone
        log.warning("learner %r: the commit of fragment %d version %d is pruned; its"
                    " eager correction takes this learner's weight there as 0",
                    self.name, fragment, version)
        record = None
    weight = 0.0
    if eager_ and version == 0:
      weight = delayed.first_weight(self.store, self.key, self._worker.liveness_timeout(),
                                    self.process_count)
    elif eager_ and record is not None:
      weight = delayed.weight_of(record, self.name)
    start = self._delay.advance(fragment, theta, sent, weight)
    for n in self.manifest.plan[fragment]:
      flat[n] = placement.like(start[n].astype(theta[n].dtype), flat[n])
    self._anchors[fragment] = theta
    self._versions[fragment] = max(version, self._versions[fragment])
    self._applied += 1
    self._unadopted = [(r, v, due) for r, v, due in self._unadopted
                       if self.schedule.fragment_of(r) != fragment or v > version]
    for key in [k for k in self._futures if k[0] == fragment and k[1] <= version]:
      del self._futures[key]
    if version > 0:
      self._starting = False

  def _finish(self, flat: dict[str, Any], *, flush: bool) -> None:
    """Leaving: publishes the final rounds when ``flush`` and merges every round in
    flight (waiting for each as ``step`` waits: ``wait_timeout``)."""
    if self._delay is not None and flush:
      # Delayed: the final deltas are taken from the phases' starts, before any merge.
      self._flush(flat)
    # A delayed learner leaving waits for the rounds it published, like any other.
    self._outstanding.extend(self._unadopted)
    self._unadopted.clear()
    while self._outstanding:
      self._merge_due(flat, force=1)
    if self._delay is None and flush:
      self._flush(flat)

  def _flush(self, flat: dict[str, Any]) -> None:
    finals = []
    round_ = self.schedule.first_round_after(self.step_count)
    for offset in range(self.fragments):
      r = round_ + offset
      if self._steps_since[self.schedule.fragment_of(r)] > 0:
        finals.append(r)
    if not finals:
      return
    self._beat(status=heartbeats.CLOSING, final_rounds=tuple(finals))
    if self._beats is not None:
      self._beats.write().result()
    # A leaving learner waits for its final rounds (closing them if it is designated)
    # as step waits (wait_timeout), then goes: the others include its contributions.
    deadline = self._deadline()
    for r in finals:
      try:
        self._publish_round(flat, r, final=True, deadline=deadline)
      except RoundTimeout:
        log.warning("learner %r: base version of final round %d not committed in time;"
                    " leaving without it", self.name, r)
    for r, version, _ in list(self._outstanding):
      fragment = self.schedule.fragment_of(r)
      try:
        commit = self._wait(fragment, version, deadline)
      except RoundTimeout:
        log.warning("learner %r: final round %d not committed within wait_timeout;"
                    " leaving without it", self.name, r)
        continue
      if commit.record.version > self._versions[fragment]:
        self._align(flat, fragment, commit.record.version, commit.theta, commit.record)
    self._outstanding.clear()


def _encode(config: Any, schema: Schema, residual: dict[str, np.ndarray] | None,
            delta: dict[str, Any], decode: bool) -> tuple[dict, dict | None, dict | None]:
  """``(entries, decoded, residual)`` of a learner's delta of the fragment ``schema``
  holds: with error feedback (``residual`` not None) of ``β·e + Δ``, with the new
  residual; ``decoded`` (what the entries decode to) only if ``decode``.

  Raises:
    NonFiniteDelta: the value to send holds NaN or Inf (names the leaf).
  """
  try:
    if residual is not None:
      entries, decoded, residual = feedback.encode(
          residual, delta, config.error_feedback, schema, config.delta_wire)
      return entries, decoded if decode else None, residual
    entries = config.delta_wire.encode(delta, schema)
  except ValueError as error:  # the encoders' one refusal of these values
    raise NonFiniteDelta(str(error)) from None
  decoded = config.delta_wire.decode(entries, schema) if decode else None
  return entries, decoded, None
