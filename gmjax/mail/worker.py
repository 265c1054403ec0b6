"""A learner's background worker: the one owner of its closer, roster and caches.

The training thread (``Learner``) never touches the closer, the roster or the cached Θ.
It sends the worker requests through a queue and gets answers as
``concurrent.futures.Future`` objects:

* ``publish(Publish(...))``: encode (unless the job carries its entries: error
  feedback) and upload a contribution, then watch its round;
* ``request(fragment, version)``: a future of that version's ``Commit`` (its Θ and its
  round record), resolved once it is committed (Θ from memory when this learner closed
  the round, rebuilt from the update, or read from storage).

The worker loops: take requests, upload, watch the rounds it contributed to (scan,
decide, close, as ``gmjax.mail.closer`` describes), and resolve the requests whose
versions are committed. No lock is held while it does storage I/O: its state is its own.
What the training thread may read is published as immutable values (``live_count``,
``estimates``). If the worker fails, every pending and later request fails with
``LearnerClosed``, and ``on_failure`` is called at once (the learner marks its heartbeat
failed).

The jobs and answers that cross the queue (``Publish``, ``Commit``, ...) live in
``gmjax.mail.worker_jobs``; ``Publish`` and ``Commit`` are importable from here too.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from gmjax.core import outer
from gmjax.core.codec import to_numpy
from gmjax.core.schedule import Estimates
from gmjax.mail import contributions
from gmjax.mail import layout
from gmjax.mail import recovery
from gmjax.mail import retention
from gmjax.mail import states
from gmjax.mail.closer import Closer
from gmjax.mail.errors import CorruptRecord, LearnerClosed, RoundTimeout
from gmjax.mail.heartbeats import Roster
from gmjax.mail.records import RoundRecord
from gmjax.mail.watch import Known, Watch
from gmjax.mail.worker_jobs import Commit as Commit
from gmjax.mail.worker_jobs import Key as Key
from gmjax.mail.worker_jobs import Publish as Publish
from gmjax.mail.worker_jobs import Request, Stop, Warm

log = logging.getLogger(__name__)


class Worker:
  """The background thread of one learner (see the module docstring).

  Attributes:
    closer: this learner's closer; only the worker's thread uses it.
    live_count: learners live when the roster was last read (an int, replaced whole).
    paces: the live learners' reported seconds per step, by name, when the roster was
      last read (a read-only mapping, replaced whole).
    failure: the exception the worker stopped with, or None.
  """

  def __init__(self, *, name: str, store, manifest, key: bytes | None, poll_interval: float,
               on_failure: Callable[[BaseException], None],
               startup_timeout: float | None = None):
    self.name = name
    self.store = store
    self.manifest = manifest
    self.key = key
    self.poll_interval = poll_interval
    self.closer = Closer(store, manifest, key, name, poll_interval, startup_timeout)
    self.fragment_schemas = [manifest.schema.subset(n) for n in manifest.plan]
    self._max_file_bytes = states.max_file_bytes(manifest.schema, manifest.config)
    self._on_failure = on_failure
    self._roster = Roster(store, key)
    self._known = Known(self._roster)
    self._inbox: queue.Queue = queue.Queue()
    self._watches: dict[int, Watch] = {}
    self._requests: dict[Key, list[concurrent.futures.Future]] = {}
    self._thetas: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
    self._newest: dict[int, int] = {}  # the newest version read, by fragment
    self._listed: dict[int, float] = {}  # when a fragment was last listed for pruning
    self._stopping = False
    self.live_count = 1
    self.paces: Mapping[str, float] = types.MappingProxyType({})
    self.failure: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name=f"gmjax-mail-{name}", daemon=True)

  # Called from the training thread: each only puts a message in the inbox.

  def start(self, *, warm: bool = True) -> None:
    """Starts the thread. With ``warm`` it first compiles the closer for the learners
    live now, so that the first round does not wait on a compile."""
    if warm:
      self._inbox.put(Warm())
    self._thread.start()

  def publish(self, job: Publish) -> None:
    """Uploads ``job`` (then watches its round), after what is queued before it."""
    self._inbox.put(job)

  def request(self, fragment: int, version: int) -> concurrent.futures.Future:
    """A future of the ``Commit`` of ``version`` of ``fragment``, resolved once it is
    committed."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if self.failure is not None:
      future.set_exception(self._closed_error())
    else:
      self._inbox.put(Request((fragment, version), future))
    return future

  def stop(self, timeout: float) -> None:
    """Lets queued uploads go out, then ends the thread (waiting up to ``timeout``)."""
    self._inbox.put(Stop())
    if self._thread.is_alive():
      self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  @property
  def estimates(self) -> Estimates:
    return self.closer.estimates  # an immutable value, replaced whole by the thread

  def timeout(self) -> float:
    return self.estimates.timeout(self.poll_interval)

  def liveness_timeout(self) -> float:
    return self.closer.liveness_timeout()

  def wait(self, future: concurrent.futures.Future, deadline: float, what: str) -> Any:
    """The result of ``future`` (from ``request``), polling for a failure meanwhile.

    Raises:
      RoundTimeout: not resolved by ``deadline`` (``time.monotonic()``).
      LearnerClosed: the worker failed or ended.
    """
    while True:
      self.check()
      if not self.alive and not future.done():
        raise LearnerClosed(f"learner {self.name!r}: its background thread ended")
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        raise RoundTimeout(
            f"learner {self.name!r} waited past its wait_timeout for {what}; pass a larger"
            " wait_timeout to join() or check that the run's learners are alive.")
      try:
        return future.result(timeout=min(remaining, self.poll_interval))
      except concurrent.futures.TimeoutError:
        continue

  def check(self) -> None:
    if self.failure is not None:
      raise self._closed_error()

  def _closed_error(self) -> LearnerClosed:
    error = LearnerClosed(f"learner {self.name!r} stopped: its background work failed with"
                          f" {self.failure!r}")
    error.__cause__ = self.failure
    return error

  # The thread.

  def _run(self) -> None:
    try:
      # On this process's own device: in a multi-process JAX job the default device may
      # belong to another process, and the closer's work is this process's alone.
      with jax.default_device(jax.local_devices()[0]):
        self._loop()
    except BaseException as error:  # pylint: disable=broad-except
      log.exception("learner %r: background work failed", self.name)
      self.failure = error
      try:
        self._on_failure(error)
      finally:
        self._fail_requests()
        self._drain_failed()

  def _loop(self) -> None:
    while True:
      if not self._take(timeout=self.poll_interval):
        break
      self._cycle()
    self._cycle()  # uploads queued while stopping still go out

  def _take(self, timeout: float) -> bool:
    """Handles the inbox's messages (waiting up to ``timeout`` for the first); False
    once asked to stop."""
    try:
      message = self._inbox.get(timeout=timeout)
    except queue.Empty:
      return not self._stopping
    while True:
      if isinstance(message, Publish):
        self._upload(message)
      elif isinstance(message, Request):
        self._requests.setdefault(message.key, []).append(message.future)
      elif isinstance(message, Warm):
        self._refresh_roster()
      elif isinstance(message, Stop):
        self._stopping = True
      try:
        message = self._inbox.get_nowait()
      except queue.Empty:
        return not self._stopping

  def _refresh_roster(self) -> None:
    self._roster.refresh()
    self.live_count = self._roster.live_count(self.closer.liveness_timeout())
    self.paces = types.MappingProxyType(self._roster.paces(self.closer.liveness_timeout()))
    # Compiles the closer for more contributions as soon as more learners are live,
    # between rounds rather than while one waits to close.
    self.closer.grow(max(1, self.live_count))

  def _fail_requests(self) -> None:
    for futures in self._requests.values():
      for future in futures:
        if not future.done():
          future.set_exception(self._closed_error())
    self._requests.clear()

  def _drain_failed(self) -> None:
    """Fails requests that arrive after the failure (the check in ``request`` races)."""
    while True:
      try:
        message = self._inbox.get_nowait()
      except queue.Empty:
        return
      if isinstance(message, Request) and not message.future.done():
        message.future.set_exception(self._closed_error())

  def _cycle(self) -> None:
    now = time.monotonic()
    if now - self._roster.refreshed >= self.poll_interval * 2:
      self._refresh_roster()
    for round_, watch in sorted(self._watches.items()):
      if self._committed(watch.fragment, watch.version):
        del self._watches[round_]
        continue
      # Only the designated closer reads every contribution as it lands; a follower
      # lists them, and reads them only when it takes over.
      self._known.since = time.monotonic()
      self.closer.scan(watch, self._known,
                       validate=self.closer.designated(watch, self._roster))
      if self.closer.decide(watch, self._roster):
        # Decide again on the freshest view before closing: a learner that joined since
        # the last refresh is live and awaited, and listed contributions get validated.
        self._roster.refresh()
        self._known.since = time.monotonic()
        self.closer.scan(watch, self._known)
        if not self.closer.decide(watch, self._roster):
          continue
        record = self.closer.close(watch, self._roster)
        if record is not None:
          del self._watches[round_]
          self._deliver(record)
          if record.closer == self.name:
            self.closer.tidy(record, self._roster)
    for fragment, version in sorted(self._requests):
      self._committed(fragment, version)

  def _committed(self, fragment: int, version: int) -> bool:
    """Whether ``version`` is committed; resolves the requests for its Θ if so (with
    the newest commit's, when ``version`` was pruned: ``retention.resolve``)."""
    try:
      record = states.read_commit(self.store, fragment, version, self.key)
    except states.DamagedCommit:
      return False
    except FileNotFoundError:
      if version == 0:
        states.version_zero_gone(self.store, fragment)
      if not self._maybe_pruned(fragment, version):
        return False
      try:
        record = retention.resolve(self.store, fragment, version, self.key,
                                   self.manifest.keep_versions)
      except FileNotFoundError:
        return False
    self._deliver(record, (fragment, version))
    return True

  def _maybe_pruned(self, fragment: int, version: int) -> bool:
    """Whether a newer version of ``fragment`` is known (from commits this worker read,
    or the learners' heartbeats), or no listing looked for one for a liveness timeout:
    only then is a missing record worth a listing."""
    if self.manifest.keep_versions is None:
      return False
    newest = self._newest.get(fragment, -1)
    for record in self._roster.records.values():
      held = (record.get("versions") or {}).get(str(fragment))
      if isinstance(held, int):
        newest = max(newest, held)
    now = time.monotonic()
    if newest > version or now - self._listed.get(fragment, now) > self.liveness_timeout():
      self._listed[fragment] = now
      return True
    self._listed.setdefault(fragment, now)
    return False

  def _deliver(self, record: RoundRecord, key: Key | None = None) -> None:
    self.closer.observe(record)
    self._newest[record.fragment] = max(self._newest.get(record.fragment, -1), record.version)
    futures = self._requests.pop(key or (record.fragment, record.version), None)
    if not futures:
      return
    try:
      theta = self._fetch(record)
    except FileNotFoundError as error:  # pruned between reading its record and its Θ
      newest = error.newest if isinstance(error, retention.Pruned) else (
          retention.newest_record(self.store, record.fragment, self.key,
                                  above=record.version)
          if self.manifest.keep_versions is not None else None)
      if newest is None:
        raise
      record = newest
      theta = self._fetch(record)
    commit = Commit(theta, record)
    for future in futures:
      if not future.done():
        future.set_result(commit)

  def _fetch(self, record: RoundRecord) -> dict[str, np.ndarray]:
    """Θ of the version ``record`` commits, by the cheapest verified route: held in
    memory (this learner closed the round), rebuilt from the update file and the previous
    Θ, or read from the commit's Θ file. The outer state is never read here."""
    fragment, version = record.fragment, record.version
    held = self._thetas.get(fragment)
    if held is not None and held[0] == version:
      return held[1]
    state = self.closer.states.get(fragment)
    theta = update = None
    if state is not None and state.version == version:
      theta = dict(state.theta)
    elif record.update and held is not None and held[0] == version - 1:
      update = self._update(record)
    if update is not None:
      specs = self.fragment_schemas[fragment].parameters
      rebuilt = outer.rebuild_jit(held[1], update, specs,
                                  self.manifest.config.commit_wire)
      rebuilt = {k: np.asarray(v) for k, v in jax.device_get(rebuilt).items()}
      if states.theta_digest(rebuilt) == record.theta_sha256:
        theta = rebuilt
      else:
        log.warning("rebuilt Θ of fragment %d version %d differs from the closer's;"
                    " reading the committed Θ instead", fragment, version)
    if theta is None:
      try:
        theta = states.load_theta(self.store, record, self._max_file_bytes)
      except CorruptRecord as error:  # a damaged state: supersede it (recovery.repair)
        _, state = recovery.repair(self.store, self.manifest, fragment, version, self.key,
                                   repr(error))
        theta = dict(state.theta)
    self._thetas[fragment] = (version, theta)
    return theta

  def _update(self, record: RoundRecord) -> dict[str, np.ndarray] | None:
    """The update file of ``record``'s commit; None (with a warning) if it is damaged:
    Θ is then read from the commit's Θ file or checkpoint."""
    try:
      return states.load_update(self.store, record, self._max_file_bytes)
    except CorruptRecord as error:
      log.warning("the update file of fragment %d version %d is damaged (%s); reading the"
                  " committed Θ instead", record.fragment, record.version, error)
      return None

  def _upload(self, job: Publish) -> None:
    schema = self.fragment_schemas[job.fragment]
    config = self.manifest.config
    entries = job.entries
    if entries is None:
      entries = config.delta_wire.encode(job.delta, schema)  # ValueError on NaN/Inf
    entries = to_numpy(entries, config.delta_layout(schema))
    data = contributions.dumps(
        entries, learner=self.name, round_=job.round, fragment=job.fragment,
        base_version=job.base_version, local_step=job.local_step, steps=job.steps,
        tokens=job.tokens, step_seconds=job.step_seconds, final=job.final,
        precision=config.delta_precision, key=self.key)
    # Not synced to disk: a contribution matters only until its round commits (the
    # commit's state is synced), and a machine crash that loses or truncates it loses
    # only this learner's uncommitted steps (a truncated one is rejected).
    self.store.put(layout.contribution(job.round, self.name), data, durable=False)
    self._watches.setdefault(job.round, self.closer.watch(job.round))
