"""A learner: trains on its own and meets the others through the run's storage.

Which rounds a learner contributes to, at which base version, and when it merges their
commits: ``gmjax.mail.learner_rounds``. What it gets back when it joins again (``pull``,
``restore``): ``gmjax.mail.learner_resume``.

Three parts, each the only owner of its state: this API and its rounds
(``learner_rounds``: the training thread's own anchors, versions and counters), a
``worker.Worker`` that alone owns the closer, the roster and the cached Θ and answers
through futures, and a ``beats.HeartbeatWriter`` that writes the immutable snapshots it
is handed. No lock is held across storage I/O.

A learner may be a multi-process JAX job (``jax.distributed``): every process joins
with the same name, process 0 (``primary``) claims the name, beats, publishes and closes
rounds, and every process reads the commits itself and gets Θ. Parameters may be global
``jax.Array``s: a fragment is gathered to the host (``process_allgather``, so every
process calls ``step`` in lockstep) only on the steps that publish or merge it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
import uuid
from typing import Any

import jax
import numpy as np

from gmjax.core import guards
from gmjax.core.schema import Schema
from gmjax.mail import delayed
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import learner_args
from gmjax.mail import learner_exit
from gmjax.mail import learner_state
from gmjax.mail import names
from gmjax.mail import pace
from gmjax.mail.beats import Beat, HeartbeatWriter
from gmjax.mail.closer import HEARTBEAT_POLLS
from gmjax.mail.errors import LearnerClosed, NameTaken, RoundTimeout
from gmjax.mail.learner_resume import Resuming
from gmjax.mail.learner_rounds import NonFiniteDelta, Rounds
from gmjax.mail.manifest import utc_now
from gmjax.mail.worker import Worker

log = logging.getLogger(__name__)


PACE_STEPS = 16
"""A learner's pace (``step_seconds``) is the lower median of its last this many steps."""


class Learner(Resuming, Rounds):
  """One learner of a run. Made by ``Run.join``; call ``pull`` once, then ``step`` after
  every inner step, then ``close`` (or use it as a context manager).

  Attributes:
    name: the learner's name in the run.
    step_count: the global step this learner has reached (with adaptive steps it jumps
      to a round's step when it publishes the round early, and a step that merged the
      fragment it was to publish stays below the round's step; see
      ``gmjax.mail.learner_rounds``).
    local_step: the steps this learner has trained since it joined.
    idle_seconds: the seconds ``step`` and ``close`` spent blocked waiting for commits
      since the learner joined.
    adaptive: whether rounds are timed by deadlines (``DiLoCo.adaptive_steps``).
    primary: whether this process writes for the learner (process 0 of its JAX job).
  """

  def __init__(self, run, name: str, *, poll_interval: float = 0.05,
               wait_timeout: float | None = None, startup_timeout: float = 60.0,
               process_index: int | None = None, process_count: int | None = None,
               state_dir: Any = None):
    poll_interval = guards.seconds("poll_interval", poll_interval, finite=True,
                                   example="0.05")
    startup_timeout = guards.seconds("startup_timeout", startup_timeout)
    if wait_timeout is not None:
      wait_timeout = guards.seconds("wait_timeout", wait_timeout,
                                    none="None (10 run timeouts, at least 120 s) or ")
    self.process_index = (jax.process_index() if process_index is None
                          else learner_args.process_number("process_index", process_index))
    self.process_count = (jax.process_count() if process_count is None
                          else learner_args.process_number("process_count", process_count))
    if (self.process_index, self.process_count) != (jax.process_index(), jax.process_count()):
      # Its processes agree by JAX collectives (Θ, the eager weights, its saves): another
      # count hangs them, another index makes two primaries.
      raise ValueError(
          f"process_index={self.process_index}, process_count={self.process_count} are not"
          f" this JAX job's ({jax.process_index()} of {jax.process_count()}): a learner of"
          " several processes is one jax.distributed job, its processes in lockstep; leave"
          " both out (they default to the job's), or start the processes with"
          " jax.distributed.initialize.")
    self.primary = self.process_index == 0
    self.run = run
    self.name = layout.check_name(name)
    self.manifest = run.manifest
    learner_args.check_same_state_dir(state_dir, self.process_index, self.process_count)
    self._state_dir = learner_state.open_state_dir(
        state_dir, (learner_state.run_id(self.manifest.to_json()), run.url), self.name)
    self.config = self.manifest.config
    self.schedule = self.manifest.schedule
    if self.process_count > 1 and self.schedule.overlap_steps is None:
      raise ValueError("a learner of several processes needs an integer overlap_steps: with"
                       " None each process would merge commits whenever they land.")
    self.key = run.signing_key
    self.poll_interval = float(poll_interval)
    self.wait_timeout = wait_timeout
    self.startup_timeout = float(startup_timeout)
    self._starting = True
    self.store = run.store.with_retry_budget(self._retry_budget)
    self.fragments = len(self.manifest.plan)
    self._worker = Worker(name=self.name, store=self.store, manifest=self.manifest,
                          key=self.key, poll_interval=self.poll_interval,
                          on_failure=self._background_failed,
                          startup_timeout=self.startup_timeout)
    self._tree_schema: Schema | None = None
    self._anchors: dict[int, dict[str, np.ndarray]] = {}
    # The commit record of each version pull() gave: a delayed, eager learner reads its
    # weight there when its first round is published, by which time a run that prunes
    # may have deleted it.
    self._pulled_records: dict[int, Any] = {}
    # local_step where this join's steps start (heartbeat ``trained``): a restore sets it
    # back by the steps it carries into this join's first rounds.
    self._trained_from = 0
    self._late_rounds = 0  # rounds in a row closed before this learner got to them
    self._versions: dict[int, int] = {}
    self._outstanding: list[tuple[int, int, int | None]] = []  # (round, version, due step)
    self._futures: dict[tuple[int, int], concurrent.futures.Future] = {}
    self._steps_since = [0] * self.fragments
    # Error feedback: per fragment, the F32 residual of its last delta (zeros at first).
    self._residuals = {
        f: {n: np.zeros(self.manifest.schema[n].shape, np.float32) for n in names_}
        for f, names_ in enumerate(self.manifest.plan)
    } if self.config.error_feedback is not None else None
    self._delay = (delayed.Delay(self.config, self.manifest.plan)
                   if self.config.outer_delay else None)
    # Delayed: rounds published whose commits no phase has started from yet.
    self._unadopted: list[tuple[int, int, None]] = []
    self._tokens_since = [0] * self.fragments
    # With overlap_steps=None and mixing 0 a merge replaces a fragment by Θ, and with it
    # every step trained since its round: its next delta holds, and counts, only the
    # steps after the merge (see gmjax.mail.learner_rounds).
    self._merge_discards = (self.schedule.overlap_steps is None
                            and float(self.config.mixing) == 0.0)
    self._step_seconds: float | None = None
    self._step_times: collections.deque[float] = collections.deque(maxlen=PACE_STEPS)
    self._last_step_end: float | None = None
    self._step_entered: float | None = None
    self._round_work = False  # whether the last step() published or merged a round
    self._spent: str | None = None  # why a step() left it unable to step on (no more)
    self.idle_seconds = 0.0
    self._resumed: float | None = None  # when this step()'s last wait ended
    self.adaptive = bool(self.config.adaptive_steps)
    self._pacer = pace.Pacer(
        self.schedule, self.store, self.key, self.name,
        lambda: [*self._worker.paces.values(), self._step_seconds]) if self.adaptive else None
    self._last_flat: dict[str, Any] | None = None
    self._applied = 0  # commits applied (merged, or a phase started from), ever
    self._restore_checked = self._state_dir is None or not self._state_dir.saved
    self.local_step = 0
    self._pulled = self._closed = False
    self._cleaned: set[str] = set()  # the parts of leaving done: "worker", "heartbeat"
    self._user: threading.Thread | None = None  # the thread that last called it
    self._calling = threading.RLock()  # held through step, pull and restore
    self._holder: tuple[str, str] | None = None  # (thread, method) holding it
    self.step_count = self.run.start_step()
    self.first_round = self.schedule.first_round_after(self.step_count)
    self._beats: HeartbeatWriter | None = None
    if self.primary:
      incarnation = uuid.uuid4().hex
      try:
        claimed = names.claim(self.store, self.name, incarnation=incarnation,
                              liveness_timeout=self._worker.liveness_timeout(),
                              poll_interval=self.poll_interval, key=self.key)
      except BaseException:
        if self._state_dir is not None:
          self._state_dir.close()
        raise
      self._beats = HeartbeatWriter.joined(
          self.store, self.name, incarnation,
          Beat(heartbeats.LIVE, self.step_count, self.first_round),
          self.poll_interval * HEARTBEAT_POLLS, key=self.key, claim=claimed,
          claimed_at=names.claimed_at(self.store, self.name, claimed))
    self._worker.start(warm=self.primary)
    learner_exit.OPEN.add(self)

  # Plumbing.

  def _retry_budget(self) -> float:
    # Until its first round commits the run's timeout is a floor of a few polls, too
    # short for a storage hiccup at start-up; the learner retries for startup_timeout.
    timeout = self._worker.timeout() if hasattr(self, "_worker") else 0.0
    return max(timeout, self.startup_timeout) if self._starting else timeout

  def _background_failed(self, error: BaseException) -> None:
    del error
    if self._beats is not None:
      self._beats.fail(self._worker.failure)

  def _beat(self, **changes: Any) -> None:
    if self._beats is not None:
      self._beats.update(versions=tuple(sorted(self._versions.items())),
                         step_seconds=self._step_seconds,
                         trained=self.local_step - self._trained_from,
                         idle_seconds=self.idle_seconds, **changes)

  def _check_open(self, what: str) -> None:
    self._user = threading.current_thread()
    if self._closed:
      raise LearnerClosed(f"learner {self.name!r} is closed; {what} needs a new join().")
    if self._beats is not None and self._beats.superseded is not None:
      raise NameTaken(self._beats.superseded)  # another learner runs under this name now
    self._worker.check()

  # The API.

  @property
  def batch_size(self) -> int | None:
    """``global_batch_size // live learners`` (at least 1), or None when the run sets no
    global batch."""
    total = self.config.global_batch()
    if total is None:
      return None
    return max(1, total // max(1, self._worker.live_count))

  @property
  def versions(self) -> dict[int, int]:
    """The committed version of each fragment this learner holds."""
    return dict(self._versions)

  @learner_args.one_call_at_a_time
  def step(self, params: Any, *, tokens: int | None = None, loss: float | None = None,
           state: Any = None, position: Any = None) -> Any:
    """Counts one inner step; publishes, merges and waits as the schedule says.

    Args:
      params: the parameters after this inner step.
      tokens: tokens trained in this step (weights the learner's deltas); 1 if None.
      loss: the step's loss, shown in the heartbeat.
      state: with ``join(..., state_dir=...)``, required: the learner's own state after
        this step (the inner optimizer's), saved when this step applies a commit.
      position: with a ``state_dir``, a JSON value saved with ``state`` (where the data
        stream goes on from after this step).

    Returns:
      ``params``, with fragments whose commits were merged replaced by
      ``mixing·θ + (1 − mixing)·Θ`` (with the shardings ``params`` had).

    Raises:
      RoundTimeout: a commit it waits for did not come within ``wait_timeout``; the step
        counted, and the learner takes no more (``LearnerClosed``): close it, join again.

    With adaptive steps the round this step publishes, if any, is the one whose
    deadline it is nearest (``gmjax.mail.pace``). With ``overlap_steps=None`` and
    ``mixing=0`` a step that merged the fragment of the round it was to publish (so
    that nothing it trained is left in it) publishes the round at the next step.
    """
    self._check_open("step")
    if self._spent is not None:
      raise LearnerClosed(f"learner {self.name!r}: {self._spent}.")
    if not self._pulled:
      raise ValueError(f"learner {self.name!r}: call pull(params) before step().")
    position = learner_args.check_step(self._state_dir, self.name, state, position,
                                        restore_checked=self._restore_checked)
    tokens = learner_args.tokens_value(tokens)
    loss = learner_args.loss_value(loss)
    # A step's seconds run from the last step() to this one, and after a step() that
    # published or merged a round only from its end: never the time step() waits for a
    # round to close, which the slowest learner sets and which, counted, would lengthen
    # the timeouts that set it, round over round, nor a round's own work, whose one-off
    # costs (a first publish compiles) would stretch the adaptive rounds this pace
    # times. An ordinary step()'s bookkeeping counts: the fastest learner then reaches
    # its round's last scheduled step at the deadline its pace sets.
    entered = time.perf_counter()
    since = self._last_step_end if self._round_work else self._step_entered
    if since is not None:
      # The lower median of the last steps: a one-off (a step that compiles again, an
      # evaluation between steps) does not set the pace for the steps after it.
      self._step_times.append(entered - since)
      self._step_seconds = float(sorted(self._step_times)[(len(self._step_times) - 1) // 2])
    self._step_entered, self._round_work, self._resumed = entered, False, None
    flat = self._tree_schema.check(params)
    self._last_flat = flat
    self.step_count += 1
    self.local_step += 1
    count = 1 if tokens is None else int(tokens)
    for f in range(self.fragments):
      self._steps_since[f] += 1
      self._tokens_since[f] += count
    applied = self._applied
    self._step_rounds(flat)
    if self._state_dir is not None and self._applied != applied:
      self._save(state, position)
    self._beat(step=self.step_count, **({} if loss is None else {"loss": loss}))
    self._last_step_end = time.perf_counter()
    return self._tree_schema.unflatten(flat)

  def close(self, params: Any) -> Any:
    """Leaves the run: merges rounds in flight, publishes final contributions
    (``flush_on_close``), waits for them as ``step`` waits (``wait_timeout``), marks the
    heartbeat closed. Its threads are stopped and its last heartbeat written even when
    it fails, or is interrupted (a later ``close`` finishes the cleanup). A round that
    does not commit in that time is left unmerged, with a warning.

    Returns:
      ``params`` merged with the newest commits this learner waited for.

    Raises:
      LearnerClosed: the learner's background work had failed (after cleaning up).
    """
    return self._leave(params, flush=self.config.flush_on_close)

  def _leave(self, params: Any, *, flush: bool) -> Any:
    if self._closed:
      self._clean_up()  # once more, if an interrupt stopped the first
      return params
    flat = None
    superseded = self._beats is not None and self._beats.superseded is not None
    if self._pulled and params is not None and not superseded:  # nothing under its name
      # Checked first, as step checks them: the learner stays open for a close with
      # the right parameters (it closed, and that close published nothing).
      flat = self._tree_schema.check(params)
    try:
      self._worker.check()
      if flat is not None:
        try:
          self._finish(flat, flush=flush)
        except (RoundTimeout, NonFiniteDelta) as error:
          log.warning("learner %r: leaving without the rounds still in flight or its final"
                      " contributions: %s", self.name, error)
    finally:
      self._closed = True
      self._clean_up()
    self._worker.check()
    return params if flat is None else self._tree_schema.unflatten(flat)

  def _clean_up(self) -> None:
    """Stops the threads and writes the closing heartbeat; each part runs even when one
    before it is interrupted, and a part done is not done again."""
    try:
      if "worker" not in self._cleaned:
        if self._state_dir is not None:
          self._state_dir.close()
        self._worker.stop(timeout=max(10.0, 3 * self._worker.timeout()))
        self._cleaned.add("worker")
        learner_exit.OPEN.discard(self)
    finally:
      if self._beats is not None and "heartbeat" not in self._cleaned:
        self._beats.stop()
        if self._beats.superseded is None:
          self._beat(status=heartbeats.CLOSED, step=self.step_count, closed_at=utc_now())
          try:
            self._beats.write().result()
          except Exception as error:  # pylint: disable=broad-except
            log.warning("learner %r: closing heartbeat not written: %r", self.name, error)
        self._cleaned.add("heartbeat")

  def __enter__(self) -> Learner:
    return self

  def __exit__(self, kind, value, traceback) -> None:
    """Leaves the run. On a normal exit it flushes the parameters last passed to (or
    returned by) ``step`` when ``flush_on_close``; on an exception it only cleans up."""
    if self._closed:
      self._clean_up()
      return
    params = None
    if self._last_flat is not None and kind is None:
      params = self._tree_schema.unflatten(self._last_flat)
    try:
      # On an exception nothing is waited for: the block ends as soon as it is cleaned up.
      self._leave(params, flush=kind is None and self.config.flush_on_close)
    except LearnerClosed:
      if kind is None:
        raise
      log.warning("learner %r: background work had failed", self.name)

  def __repr__(self) -> str:
    return f"Learner({self.name!r}, step={self.step_count}, versions={self._versions})"
