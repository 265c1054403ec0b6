"""A learner's heartbeat writer: it writes immutable snapshots, and waits on no one.

The learner hands the writer a frozen ``Beat`` (``update``): a plain reference swap,
never a lock, so a training step never waits on a heartbeat's storage write. The
writer's own thread rewrites ``learners/<name>.json`` every ``interval`` seconds from the
newest snapshot, with an increasing ``seq``; a snapshot that says more than the step
(joined, closing, closed) is written at once and durably when the learner asks
(``write``, which returns a future). All writes happen on the writer's thread, so they
land in ``seq`` order.

When the learner's background work fails, ``fail`` marks the heartbeat ``failed`` at
once; others then treat the learner as not live, and every later beat says so.

After a silence (a beat more than two intervals after the last one written: the
process was paused, or storage cut off), and until it is settled, the writer reads the
heartbeat there before it writes: if a newer incarnation of the name writes it
(``names.superseded``: another joined as this learner while it was silent), the writer
writes nothing more and keeps the ``NameTaken`` message in ``superseded`` for the
learner to raise.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from typing import Any

from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import names
from gmjax.mail.errors import NameTaken
from gmjax.mail.manifest import utc_now

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Beat:
  """What a heartbeat says about its learner at one moment.

  ``step_seconds`` is the lower median of the learner's last 16 times from one ``step`` call
  to the next, counted from the end of a ``step`` that published or merged a round (so
  never a wait for a commit nor a round's own work; None until it has timed a step); ``trained`` the steps it trained since it joined
  (``Learner.local_step``); ``idle_seconds`` the seconds its ``step`` and ``close``
  spent blocked waiting for commits since it joined.
  """

  status: str
  step: int
  first_round: int
  versions: tuple[tuple[int, int], ...] = ()
  final_rounds: tuple[int, ...] = ()
  loss: float | None = None
  closed_at: str | None = None
  step_seconds: float | None = None  # seconds per step (lower median of 16), waits excluded
  trained: int = 0  # steps trained since this learner joined (its local_step)
  idle_seconds: float = 0.0  # seconds step()/close() spent waiting for commits


class HeartbeatWriter:
  """Writes one learner's heartbeat from its own thread (see the module docstring).

  Args:
    store: the run's store.
    identity: the fields that never change (name, pid, host, joined_at, incarnation,
      beat_seconds).
    beat: the first snapshot.
    interval: seconds between periodic beats.
  """

  def __init__(self, store, identity: dict[str, Any], beat: Beat, interval: float,
               key: bytes | None = None):
    self._store = store
    self._key = key
    self._identity = dict(identity)
    self._latest = beat
    self._failure: str | None = None
    self._interval = interval
    self.superseded: str | None = None  # why a newer join holds the name, once one does
    self._foreign: dict[str, tuple[int, int]] = {}  # other incarnations seen after a silence
    self._written: tuple[float, float] | None = None  # monotonic, wall time of the last write
    self._seq = 0
    self._requests: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._run, daemon=True,
                                    name=f"gmjax-heartbeat-{identity['name']}")

  @classmethod
  def joined(cls, store, name: str, incarnation: str, beat: Beat,
             interval: float, key: bytes | None = None, claim: int | None = None,
             claimed_at: float | None = None) -> HeartbeatWriter:
    """The writer of a learner that just joined (``claim``: the number of its claim on
    the name; ``claimed_at``: its date by the storage's clock): its first beat is written
    (durably) before this returns, then the thread starts."""
    identity = {"name": name, "pid": os.getpid(), "host": socket.gethostname(),
                "joined_at": utc_now(), "incarnation": incarnation,
                "beat_seconds": interval}
    if claim is not None:
      identity["claim"] = claim
    if claimed_at is not None:
      identity["claimed_at"] = claimed_at
    writer = cls(store, identity, beat, interval, key)
    writer.write().result()
    writer.start()
    return writer

  @property
  def latest(self) -> Beat:
    return self._latest

  def update(self, **changes: Any) -> Beat:
    """Replaces the snapshot by one with ``changes``; the next beat writes it."""
    self._latest = dataclasses.replace(self._latest, **changes)
    return self._latest

  def write(self) -> concurrent.futures.Future:
    """Writes the newest snapshot now, durably; the future resolves once it is stored.

    Before ``start`` (and after ``stop``) it writes on the calling thread.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    if self._thread.is_alive():
      self._requests.put(future)
    else:
      try:
        self._put(durable=True)
        future.set_result(None)
      except Exception as error:  # pylint: disable=broad-except
        future.set_exception(error)
    return future

  def fail(self, error: BaseException) -> None:
    """Marks the heartbeat failed, written at once; it stays failed."""
    self._failure = f"{type(error).__name__}: {error}"[:200]
    self._requests.put(concurrent.futures.Future())

  def start(self) -> None:
    self._thread.start()

  def stop(self, timeout: float = 10.0) -> None:
    """Ends the thread after the writes already asked for."""
    self._requests.put(None)
    if self._thread.is_alive():
      self._thread.join(timeout)

  def _run(self) -> None:
    while True:
      try:
        request = self._requests.get(timeout=self._interval)
      except queue.Empty:
        request = False
      if request is None:
        return
      try:
        # A periodic beat (the step count alone) is superseded within a few intervals
        # and stale after a machine crash anyway: no fsync, which would also flush the
        # large files being written alongside. Beats the learner asks for are durable.
        self._put(durable=request is not False)
        if request:
          request.set_result(None)
      except Exception as error:  # pylint: disable=broad-except
        # A missed beat only makes others suspect this learner sooner; keep beating.
        if not isinstance(error, NameTaken):  # logged once, where it was found
          log.warning("learner %r: heartbeat failed: %r", self._identity["name"], error)
        if request:
          request.set_exception(error)

  def _silent(self) -> bool:
    """Whether this writer was silent for long enough that another join may have taken
    the name (or one was seen since): only then is the heartbeat there read first."""
    if self._foreign:
      return True
    if self._written is None:
      return False
    gap = max(time.monotonic() - self._written[0], time.time() - self._written[1])
    return gap > 2 * self._interval

  def _put(self, *, durable: bool) -> None:
    if self.superseded is None and self._silent():
      taken = names.superseded(self._store, self._identity["name"],
                               self._identity["incarnation"], self._key, self._foreign,
                               self._identity.get("claim"),
                               self._identity.get("claimed_at"))
      if taken is not None:
        self.superseded = str(taken)
        log.error("learner %r: %s", self._identity["name"], taken)
    if self.superseded is not None:
      raise NameTaken(self.superseded)
    self._seq += 1
    self._store.put(layout.heartbeat(self._identity["name"]), self.dumps(),
                    durable=durable)
    self._written = (time.monotonic(), time.time())

  def dumps(self) -> bytes:
    beat = self._latest
    record = {
        **self._identity,
        "status": heartbeats.FAILED if self._failure is not None else beat.status,
        "seq": self._seq,
        "step": beat.step,
        "first_round": beat.first_round,
        "final_rounds": list(beat.final_rounds),
        "versions": {str(f): v for f, v in beat.versions},
        "step_seconds": beat.step_seconds,
        "trained": beat.trained,
        "idle_seconds": beat.idle_seconds,
        "last_seen": utc_now(),
    }
    if beat.loss is not None:
      record["loss"] = beat.loss
    if beat.closed_at is not None:
      record["closed_at"] = beat.closed_at
    if self._failure is not None:
      record["error"] = self._failure
    return heartbeats.dumps(record, self._key)  # signed with the run's key
