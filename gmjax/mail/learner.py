"""A learner: trains on its own and meets the others through the run's storage.

Which rounds a learner contributes to, and at which base version:

* It starts at global step ``S``, the step of the newest committed round (0 in a new run),
  and contributes to every round ``r`` with ``step_of(r) > S``, at the ``step`` call that
  reaches ``step_of(r)``. Its heartbeat's ``first_round`` says so.
* A contribution to round ``r`` of fragment ``f`` is ``anchor_f − θ_f`` against base
  version ``r div P`` (the version the round's closer starts from). Before publishing it
  the learner aligns ``f`` with that version if it does not hold it yet.
* With ``overlap_steps = τ`` the commit of a round published at step ``s`` is merged at
  step ``s + τ`` (waiting for it if needed); with ``τ = None`` it is merged at the first
  ``step`` after it lands. At most ``in_flight`` rounds stay outstanding. If the round was
  committed before the learner got to it (it was late), it publishes nothing and merges
  the commit.

Storage and closing happen in a background thread (``_Worker``), so training continues
while a contribution uploads and a round closes; a second thread writes the heartbeat.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any

import jax
import numpy as np

from gmjax.core import outer
from gmjax.core.codec import encode_flat, layout as payload_layout, to_numpy
from gmjax.core.schema import Schema
from gmjax.mail import contributions
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import recovery
from gmjax.mail import states
from gmjax.mail.closer import HEARTBEAT_POLLS, Closer, Watch
from gmjax.mail.errors import CorruptRecord, LearnerClosed, RoundTimeout
from gmjax.mail.heartbeats import Roster
from gmjax.mail.manifest import utc_now

log = logging.getLogger(__name__)

_delta = jax.jit(outer.pseudo_gradient)
_align = jax.jit(outer.align, static_argnames=("mixing",))


class _Known:
  """Learner names with a heartbeat; a miss refreshes the roster once before failing."""

  def __init__(self, roster: Roster):
    self._roster = roster

  def __contains__(self, name: object) -> bool:
    if name in self._roster.records:
      return True
    self._roster.refresh()
    return name in self._roster.records


class _Worker:
  """The learner's background thread: uploads, watches rounds, closes them, fetches Θ."""

  def __init__(self, learner: Learner):
    self.learner = learner
    self.store = learner.store
    self.closer = learner.closer
    self.roster = Roster(learner.store, learner.key)
    self.known = _Known(self.roster)
    self.jobs: queue.Queue = queue.Queue()
    self.watches: dict[int, Watch] = {}
    self.wanted: set[tuple[int, int]] = set()
    self.ready: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    self.thetas: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
    self.condition = threading.Condition()
    self.lock = threading.RLock()  # guards closer and thetas between pull and the thread
    self.failure: BaseException | None = None
    self.stopping = threading.Event()
    self.wake = threading.Event()
    self.thread = threading.Thread(target=self._run, name=f"gmjax-mail-{learner.name}",
                                   daemon=True)

  # Called from the learner's thread.

  def want(self, fragment: int, version: int) -> None:
    with self.condition:
      if (fragment, version) not in self.ready:
        self.wanted.add((fragment, version))
    self.wake.set()

  def publish(self, job: dict[str, Any]) -> None:
    self.jobs.put(job)
    self.wake.set()

  def check(self) -> None:
    if self.failure is not None:
      raise LearnerClosed(
          f"learner {self.learner.name!r} stopped: its background work failed with"
          f" {self.failure!r}") from self.failure

  def wait(self, fragment: int, version: int, deadline: float) -> dict[str, np.ndarray]:
    self.want(fragment, version)
    with self.condition:
      while (fragment, version) not in self.ready:
        self.check()
        if not self.thread.is_alive() and not self.stopping.is_set():
          raise LearnerClosed(f"learner {self.learner.name!r}: background thread ended")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise RoundTimeout(
              f"learner {self.learner.name!r} waited past its wait_timeout for version"
              f" {version} of fragment {fragment}; pass a larger wait_timeout to join()"
              " or check that the run's learners are alive.")
        self.condition.wait(min(remaining, self.learner.poll_interval))
      return self.ready[(fragment, version)]

  def poll_ready(self, fragment: int, version: int) -> dict[str, np.ndarray] | None:
    self.check()
    with self.condition:
      return self.ready.get((fragment, version))

  def release(self, fragment: int, version: int) -> None:
    with self.condition:
      for key in [k for k in self.ready if k[0] == fragment and k[1] <= version]:
        del self.ready[key]

  def theta(self, fragment: int, version: int) -> dict[str, np.ndarray]:
    """Θ of ``version`` (rebuilt from the update when possible), verified."""
    with self.lock:
      record = states.read_commit(self.store, fragment, version, self.learner.key)
      return self._fetch(record)

  # The thread.

  def _run(self) -> None:
    try:
      while not self.stopping.is_set():
        self._cycle()
        self.wake.wait(self.learner.poll_interval)
        self.wake.clear()
      self._cycle()  # uploads queued while stopping still go out
    except BaseException as error:  # pylint: disable=broad-except
      log.exception("learner %r: background work failed", self.learner.name)
      self.failure = error
      with self.condition:
        self.condition.notify_all()

  def _cycle(self) -> None:
    while True:
      try:
        job = self.jobs.get_nowait()
      except queue.Empty:
        break
      self._upload(job)
    with self.lock:
      now = time.monotonic()
      if now - self.roster.refreshed >= self.learner.poll_interval * 2:
        self.roster.refresh()
      for round_, watch in sorted(self.watches.items()):
        if self._committed(watch.fragment, watch.version):
          del self.watches[round_]
          continue
        # Only the designated closer reads every contribution as it lands; a follower
        # lists them, and reads them only when it takes over.
        self.closer.scan(watch, self.known,
                         validate=self.closer.designated(watch, self.roster))
        if self.closer.decide(watch, self.roster):
          # Decide again on the freshest view before closing: a learner that joined since
          # the last refresh is live and awaited, and listed contributions get validated.
          self.roster.refresh()
          self.closer.scan(watch, self.known)
          if not self.closer.decide(watch, self.roster):
            continue
          record = self.closer.close(watch, self.roster)
          if record is not None:
            del self.watches[round_]
            self._deliver(record)
      with self.condition:
        wanted = sorted(self.wanted)
      for fragment, version in wanted:
        self._committed(fragment, version)

  def _committed(self, fragment: int, version: int) -> bool:
    """Whether ``version`` is committed; delivers its Θ if the learner wants it."""
    with self.condition:
      if (fragment, version) in self.ready:
        return True
    try:
      record = states.read_commit(self.store, fragment, version, self.learner.key)
    except FileNotFoundError:
      return False
    self._deliver(record)
    return True

  def _deliver(self, record: dict[str, Any]) -> None:
    self.closer.observe(record)
    key = (record["fragment"], record["version"])
    with self.condition:
      if key not in self.wanted:
        return
    theta = self._fetch(record)
    with self.condition:
      self.wanted.discard(key)
      self.ready[key] = theta
      self.condition.notify_all()

  def _fetch(self, record: dict[str, Any]) -> dict[str, np.ndarray]:
    """Θ of the version ``record`` commits, by the cheapest verified route: held in
    memory (this learner closed the round), rebuilt from the update file and the previous
    Θ, or read from the commit's Θ file. The outer state is never read here."""
    fragment, version = record["fragment"], record["version"]
    held = self.thetas.get(fragment)
    if held is not None and held[0] == version:
      return held[1]
    state = self.closer.states.get(fragment)
    theta = None
    if state is not None and state.version == version:
      theta = dict(state.theta)
    elif (record.get("update") and held is not None and held[0] == version - 1):
      update = states.load_update(self.store, record)
      specs = self.learner.fragment_schemas[fragment].parameters
      rebuilt = outer.rebuild_jit(held[1], update, specs,
                                  self.learner.manifest.config.commit_precision)
      rebuilt = {k: np.asarray(v) for k, v in jax.device_get(rebuilt).items()}
      if states.theta_digest(rebuilt) == record.get("theta_sha256"):
        theta = rebuilt
      else:
        log.warning("rebuilt Θ of fragment %d version %d differs from the closer's;"
                    " reading the committed Θ instead", fragment, version)
    if theta is None:
      try:
        theta = states.load_theta(self.store, record)
      except CorruptRecord as error:  # a damaged state: supersede it (recovery.repair)
        _, state = recovery.repair(self.store, self.learner.manifest, fragment, version,
                                   self.learner.key, repr(error))
        theta = dict(state.theta)
    self.thetas[fragment] = (version, theta)
    return theta

  def _upload(self, job: dict[str, Any]) -> None:
    learner = self.learner
    fragment = job["fragment"]
    schema = learner.fragment_schemas[fragment]
    precision = learner.manifest.config.delta_precision
    entries = encode_flat(job["delta"], schema, precision)  # ValueError on NaN/Inf
    entries = to_numpy(entries, payload_layout(schema, precision))
    data = contributions.dumps(
        entries, learner=learner.name, round_=job["round"], fragment=fragment,
        base_version=job["base_version"], local_step=job["local_step"],
        steps=job["steps"], tokens=job["tokens"], step_seconds=job["step_seconds"],
        final=job["final"], precision=precision, key=learner.key)
    # Not synced to disk: a contribution matters only until its round commits (the
    # commit's state is synced), and a machine crash that loses or truncates it loses
    # only this learner's uncommitted steps (a truncated one is rejected).
    learner.store.put(layout.contribution(job["round"], learner.name), data, durable=False)
    with self.lock:
      self.watches.setdefault(job["round"], self.closer.watch(job["round"]))


class Learner:
  """One learner of a run. Made by ``Run.join``; call ``pull`` once, then ``step`` after
  every inner step, then ``close``.

  Attributes:
    name: the learner's name in the run.
    step_count: the global step this learner has reached.
  """

  def __init__(self, run, name: str, *, poll_interval: float = 0.05,
               wait_timeout: float | None = None):
    if not isinstance(poll_interval, (int, float)) or not poll_interval > 0:
      raise ValueError(f"poll_interval must be a positive number of seconds, got"
                       f" {poll_interval!r}.")
    if wait_timeout is not None and not wait_timeout > 0:
      raise ValueError(f"wait_timeout must be None or positive seconds, got {wait_timeout!r}.")
    self.run = run
    self.name = layout.check_name(name)
    # Transient storage errors are retried for at most the run's current timeout.
    self.store = run.store.with_retry_budget(lambda: self.closer.timeout())
    self.manifest = run.manifest
    self.key = run.key
    self.poll_interval = float(poll_interval)
    self.wait_timeout = wait_timeout
    self.config = self.manifest.config
    self.schedule = self.manifest.schedule
    self.fragments = len(self.manifest.plan)
    self.fragment_schemas = [self.manifest.schema.subset(n) for n in self.manifest.plan]
    self.closer = Closer(self.store, self.manifest, self.key, self.name, self.poll_interval)
    self._worker = _Worker(self)
    self._tree_schema: Schema | None = None
    self._anchors: dict[int, dict[str, np.ndarray]] = {}
    self._versions: dict[int, int] = {}
    self._outstanding: list[tuple[int, int, int | None]] = []  # (round, version, due step)
    self._steps_since = [0] * self.fragments
    self._tokens_since = [0] * self.fragments
    self._step_seconds: float | None = None
    self._last_step_time: float | None = None
    self.step_count, self.local_step = 0, 0
    self._pulled = False
    self._closed = False
    self._heartbeat_lock = threading.Lock()
    self._heartbeat: dict[str, Any] = {
        "name": self.name, "status": heartbeats.LIVE, "seq": 0, "pid": os.getpid(),
        "host": socket.gethostname(), "joined_at": utc_now(), "final_rounds": [],
    }
    newest = run.newest_versions()
    self.step_count = max((run.commit_step(f, v) for f, v in newest.items()), default=0)
    self.first_round = self.schedule.first_round_after(self.step_count)
    self._beat(step=self.step_count, first_round=self.first_round)
    self._beats = threading.Thread(target=self._beat_loop, daemon=True,
                                   name=f"gmjax-heartbeat-{self.name}")
    self._beats.start()
    self._worker.thread.start()

  # Heartbeat.

  def _beat(self, **fields: Any) -> None:
    with self._heartbeat_lock:
      self._heartbeat.update(fields)
      self._heartbeat["seq"] += 1
      self._heartbeat["last_seen"] = utc_now()
      self._heartbeat["versions"] = {str(f): v for f, v in self._versions.items()}
      data = heartbeats.dumps(self._heartbeat, self.key)  # signed with the run's key
      # A periodic beat (the step count alone) is superseded within a few polls and
      # stale after a machine crash anyway: no fsync, which would also flush the large
      # files being written alongside. Beats that say more (joined, closing, closed) are.
      self.store.put(layout.heartbeat(self.name), data, durable=bool(fields.keys() - {"step"}))

  def _beat_loop(self) -> None:
    interval = self.poll_interval * HEARTBEAT_POLLS
    while not self._worker.stopping.wait(interval):
      try:
        self._beat(step=self.step_count)
      except Exception as error:  # pylint: disable=broad-except
        # A missed beat only makes others suspect this learner sooner; keep beating.
        log.warning("learner %r: heartbeat failed: %r", self.name, error)

  # Helpers.

  def _deadline(self) -> float:
    limit = self.wait_timeout
    if limit is None:
      limit = max(120.0, 10 * self.closer.timeout())
    return time.monotonic() + limit

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise LearnerClosed(f"learner {self.name!r} is closed; {what} needs a new join().")
    self._worker.check()

  def _as_like(self, value: Any, like: Any) -> Any:
    if isinstance(like, np.ndarray) or np.isscalar(like):
      return np.array(value, dtype=like.dtype if hasattr(like, "dtype") else None)
    return jax.numpy.asarray(value)

  def _align(self, flat: dict[str, Any], fragment: int, version: int,
             theta: dict[str, np.ndarray]) -> None:
    names = self.manifest.plan[fragment]
    current = {n: flat[n] for n in names}
    merged = _align(current, {n: theta[n] for n in names}, mixing=float(self.config.mixing))
    for n in names:
      flat[n] = self._as_like(merged[n], current[n])
    self._anchors[fragment] = theta
    self._versions[fragment] = version
    self._worker.release(fragment, version)

  def _bring_to(self, flat: dict[str, Any], fragment: int, version: int,
                deadline: float | None = None) -> None:
    """Aligns ``fragment`` with ``version`` (waiting for its commit) if it is older."""
    if self._versions[fragment] >= version:
      return
    theta = self._worker.wait(fragment, version, deadline or self._deadline())
    self._align(flat, fragment, version, theta)

  def _merge_due(self, flat: dict[str, Any], *, force: int = 0) -> None:
    """Merges outstanding commits that are due, and the oldest ``force`` ones anyway."""
    while self._outstanding:
      round_, version, due = self._outstanding[0]
      fragment = self.schedule.fragment_of(round_)
      if force > 0 or (due is not None and self.step_count >= due):
        force -= 1
        self._bring_to(flat, fragment, version)
      elif due is None:
        theta = self._worker.poll_ready(fragment, version)
        if theta is None:
          break
        self._align(flat, fragment, version, theta)
      else:
        break
      self._outstanding.pop(0)

  # The API.

  @property
  def batch_size(self) -> int | None:
    """``global_batch_size // live learners``, or None when the run sets no global batch."""
    total = self.config.global_batch()
    if total is None:
      return None
    live = max(1, self._worker.roster.live_count(self.closer.liveness_timeout()))
    return max(1, total // live)

  @property
  def versions(self) -> dict[int, int]:
    """The committed version of each fragment this learner holds."""
    return dict(self._versions)

  def pull(self, like: Any) -> Any:
    """The newest committed Θ of every fragment, shaped like ``like``.

    Args:
      like: a pytree shaped like the run's parameters (its values are not used).

    Returns:
      A tree like ``like`` (numpy leaves stay numpy, others become jax arrays).

    Raises:
      ValueError: ``like`` does not match the run's schema, or ``step`` was already called.
    """
    self._check_open("pull")
    if self.local_step:
      raise ValueError(f"learner {self.name!r}: pull() must come before the first step().")
    schema = Schema.from_tree(like)
    if schema != self.manifest.schema:
      raise ValueError(
          f"pull(like): the tree's schema {schema.to_json()[:4]}... differs from the run's"
          f" {self.manifest.schema.to_json()[:4]}...; pass parameters shaped like those the"
          " run was created with.")
    self._tree_schema = schema
    flat = dict(schema.flatten(like))
    newest = self.run.newest_versions()
    self.step_count = max((self.run.commit_step(f, v) for f, v in newest.items()), default=0)
    self.first_round = self.schedule.first_round_after(self.step_count)
    for fragment, version in newest.items():
      theta = self._worker.theta(fragment, version)
      for n in self.manifest.plan[fragment]:
        flat[n] = self._as_like(theta[n], flat[n])
      self._anchors[fragment] = theta
      self._versions[fragment] = version
    self._beat(step=self.step_count, first_round=self.first_round)
    self._pulled = True
    return schema.unflatten(flat)

  def step(self, params: Any, *, tokens: int | None = None, loss: float | None = None) -> Any:
    """Counts one inner step; publishes, merges and waits as the schedule says.

    Args:
      params: the parameters after this inner step.
      tokens: tokens trained in this step (weights the learner's deltas); 1 if None.
      loss: the step's loss, shown in the heartbeat.

    Returns:
      ``params``, with fragments whose commits were merged replaced by
      ``mixing·θ + (1 − mixing)·Θ``.
    """
    self._check_open("step")
    if not self._pulled:
      raise ValueError(f"learner {self.name!r}: call pull(params) before step().")
    if tokens is not None and (isinstance(tokens, bool) or int(tokens) != tokens or tokens < 0):
      raise ValueError(f"tokens must be a non-negative int or None, got {tokens!r}.")
    now = time.perf_counter()
    if self._last_step_time is not None:
      seconds = now - self._last_step_time
      self._step_seconds = seconds if self._step_seconds is None else (
          0.9 * self._step_seconds + 0.1 * seconds)
    self._last_step_time = now
    flat = dict(self._tree_schema.check(params))
    self.step_count += 1
    self.local_step += 1
    count = 1 if tokens is None else int(tokens)
    for f in range(self.fragments):
      self._steps_since[f] += 1
      self._tokens_since[f] += count
    if loss is not None:
      with self._heartbeat_lock:
        self._heartbeat["loss"] = float(loss)
    self._merge_due(flat)
    round_ = self.schedule.round_at(self.step_count)
    if round_ is not None and round_ >= self.first_round:
      self._publish_round(flat, round_, final=False)
      self._merge_due(flat)
    return self._tree_schema.unflatten(flat)

  def _publish_round(self, flat: dict[str, Any], round_: int, *, final: bool,
                     deadline: float | None = None) -> None:
    fragment = self.schedule.fragment_of(round_)
    version = self.schedule.version_after(round_)
    while not final and len(self._outstanding) >= self.schedule.in_flight:
      self._merge_due(flat, force=1)
    self._bring_to(flat, fragment, version - 1, deadline)
    steps, count = self._steps_since[fragment], self._tokens_since[fragment]
    self._steps_since[fragment] = self._tokens_since[fragment] = 0
    if final:
      due = None
    elif self.schedule.overlap_steps is None:
      due = None
    else:
      due = self.step_count + self.schedule.overlap_steps
    if states.is_committed(self.store, fragment, version, self.key):
      log.info("learner %r: round %d closed before it got there; merging it", self.name,
               round_)
    else:
      names = self.manifest.plan[fragment]
      snapshot = {n: (np.array(flat[n]) if isinstance(flat[n], np.ndarray) else flat[n])
                  for n in names}
      delta = _delta({n: self._anchors[fragment][n] for n in names}, snapshot)
      self._worker.publish({
          "round": round_, "fragment": fragment, "base_version": version - 1,
          "delta": delta, "local_step": self.local_step, "steps": steps, "tokens": count,
          "step_seconds": self._step_seconds or 0.0, "final": final,
      })
    self._worker.want(fragment, version)
    self._outstanding.append((round_, version, due))

  def close(self, params: Any) -> Any:
    """Leaves the run: merges rounds in flight, publishes final contributions
    (``flush_on_close``), waits for them up to the run's timeout, marks the heartbeat
    closed.

    Returns:
      ``params`` merged with the newest commits this learner waited for.
    """
    if self._closed:
      return params
    self._check_open("close")
    flat = dict(self._tree_schema.check(params)) if self._pulled else None
    try:
      if flat is not None:
        while self._outstanding:
          self._merge_due(flat, force=1)
        if self.config.flush_on_close:
          self._flush(flat)
    finally:
      self._closed = True
      self._worker.stopping.set()
      self._worker.wake.set()
      self._worker.thread.join(timeout=max(10.0, 3 * self.closer.timeout()))
      self._beats.join(timeout=10.0)
      self._beat(status=heartbeats.CLOSED, step=self.step_count, closed_at=utc_now())
    self._worker.check()
    return params if flat is None else self._tree_schema.unflatten(flat)

  def _flush(self, flat: dict[str, Any]) -> None:
    finals = []
    round_ = self.schedule.first_round_after(self.step_count)
    for offset in range(self.fragments):
      r = round_ + offset
      if self._steps_since[self.schedule.fragment_of(r)] > 0:
        finals.append(r)
    if not finals:
      return
    self._beat(status=heartbeats.CLOSING, final_rounds=finals)
    # A leaving learner waits for its final rounds (closing them if it is designated)
    # for one run timeout, then goes: the others include its contributions anyway.
    deadline = time.monotonic() + self.closer.timeout()
    for r in finals:
      try:
        self._publish_round(flat, r, final=True, deadline=deadline)
      except RoundTimeout:
        log.info("learner %r: base version of final round %d not committed in time;"
                 " leaving without it", self.name, r)
    for r, version, _ in list(self._outstanding):
      fragment = self.schedule.fragment_of(r)
      try:
        theta = self._worker.wait(fragment, version, deadline)
      except RoundTimeout:
        log.info("learner %r: final round %d not committed within the timeout; leaving",
                 self.name, r)
        continue
      self._align(flat, fragment, version, theta)
    self._outstanding.clear()

  def __enter__(self) -> Learner:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    if not self._closed:
      self._closed = True
      self._worker.stopping.set()
      self._worker.wake.set()
      self._worker.thread.join(timeout=10.0)
      self._beat(status=heartbeats.CLOSED, step=self.step_count, closed_at=utc_now())

  def __repr__(self) -> str:
    return f"Learner({self.name!r}, step={self.step_count}, versions={self._versions})"
