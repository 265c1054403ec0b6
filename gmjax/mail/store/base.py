"""The ``Store`` every backend implements: atomic operations, retries, deadlines.

A ``Store`` offers the few operations the mail protocol needs, each atomic: ``put``
(the object appears complete or not at all), ``create`` (exclusive: exactly one of any
number of racing writers succeeds), ``get``, ``list`` and ``delete``; and for objects
anyone may have planted, ``read(path, max_bytes)``, which reads at most ``max_bytes``
(and locally only a regular file) or raises ``BadObject``, and ``list_marked``, the
names under a prefix each with a marker that changes whenever its object is replaced.
Transient errors (connection resets, timeouts, HTTP 429/5xx) are retried with
exponential backoff and jitter for at most the store's retry budget, then
``StorageUnavailable`` is raised. A learner's store takes its budget from the run's
current timeout (``Estimates.timeout(poll_interval)``, see ``with_retry_budget``): past
it the run has moved on (the round closed without this call, or another learner took
over), so longer retries buy nothing. A store used outside a learner keeps
``retry_seconds``.

Every attempt on object storage has a deadline (``attempt_seconds``): half the retry
budget, at least ``MIN_ATTEMPT_SECONDS``, plus the time to move its bytes at
``MIN_BYTES_PER_SECOND``. An attempt past its deadline is abandoned (on ``gs://`` and
``s3://`` the request is cancelled) and counts as a transient error, so a server that
accepts a connection and never answers costs an attempt, not the process: the call is
retried, and raises ``StorageUnavailable`` once the budget is spent. A read whose size is
not known first asks for it (one more small request) so that its deadline covers the
download. A local directory and ``memory://`` have no deadline: their calls are the
kernel's or this process's, and cannot be abandoned.

Exclusive create, by backend:

* local directory: write a temporary file beside the target, ``fsync`` it, then
  ``os.link`` it to the final name, which fails if the name exists; the name never
  shows a partial file.
* ``gs://`` (gcsfs): one upload request with ``ifGenerationMatch=0``.
* ``s3://`` (s3fs, ``gmjax.mail.store.s3``): one ``PutObject`` with ``If-None-Match: *``.
* ``memory://``: a lock around check-and-write (the memory filesystem lives in one
  process).

A local directory and ``memory://`` are filesystems: a file where a write needs a
folder, or a folder where a ``put`` writes its object, would stop the write. Neither is
ever the run's own (the run's layout never puts an object where it keeps a folder), so
the write removes it, logs a warning, and goes on; on object stores a key and a prefix of
one name never collide.
"""

from __future__ import annotations

import abc
import copy
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gmjax.core import guards
from gmjax.mail.errors import CorruptRecord, StorageUnavailable
from gmjax.mail.store.transient import is_transient

log = logging.getLogger(__name__)

T = TypeVar("T")

_CHUNK = 4 << 20  # read and hash in 4 MiB pieces: each is hashed while still in cache
# An attempt's deadline: never under MIN_ATTEMPT_SECONDS (a healthy request takes well
# under a second), and its bytes at MIN_BYTES_PER_SECOND on top (a slow uplink still
# publishes a large delta; a hung one is found within that).
MIN_ATTEMPT_SECONDS = 2.0
MIN_BYTES_PER_SECOND = 1 << 20
_SMALL_BOUND = 64 << 20  # a read bound up to this times its attempts; above, the size
# The deadline of the attempt running on this thread, for backends that can enforce it.
_ATTEMPT = threading.local()


def attempt_deadline() -> float | None:
  """Seconds the storage attempt running on this thread may take, or None (no deadline)."""
  return getattr(_ATTEMPT, "seconds", None)


class BadObject(ValueError):
  """An object ``read`` refuses: not a regular file (locally: a FIFO, a device, a
  directory, a symbolic link), or larger than the reader's bound. Never transient.

  Attributes:
    path: the object's path in the store.
    reason: what is wrong with it, without the path.
  """

  def __init__(self, path: str, reason: str):
    super().__init__(f"{path} {reason}")
    self.path = path
    self.reason = reason


# botocore's errors for credentials it cannot find or use (s3fs raises them as they
# are), named rather than imported: a credentials problem, never transient.
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError",
                             "CredentialRetrievalError"})


class Store(abc.ABC):
  """Atomic object storage under one root URL.

  Paths are ``/``-separated and relative to the root (``rounds/3/a.safetensors``).

  Attributes:
    url: the root, as given.
    retry_seconds: how long transient errors are retried when no retry budget is set
      (``with_retry_budget``).
  """

  # Backends whose calls can hang on a server and can be abandoned set this.
  has_deadlines = False

  def __init__(self, url: str, *, retry_seconds: float = 30.0):
    self.url = url
    # Finite: the retries of a storage outage end, and a call that hangs is abandoned.
    self.retry_seconds = guards.seconds("retry_seconds", retry_seconds, finite=True,
                                        example="30")
    self._retry_budget: Callable[[], float] | None = None

  def with_retry_budget(self, budget: Callable[[], float]) -> Store:
    """This store (sharing its connection) with transient retries bounded by ``budget()``.

    Args:
      budget: called at the start of each operation; returns the seconds its retries may
        take, e.g. a learner's ``Estimates.timeout(poll_interval)``, so the bound follows
        the run's timings as they change.
    """
    bounded = copy.copy(self)
    bounded._retry_budget = budget  # pylint: disable=protected-access
    return bounded

  def retry_budget(self) -> float:
    """Seconds an operation may spend retrying transient errors, from now."""
    if self._retry_budget is None:
      return self.retry_seconds
    return float(self._retry_budget())

  def attempt_seconds(self, nbytes: int = 0, budget: float | None = None) -> float:
    """The deadline of one attempt that moves ``nbytes``: half the retry budget (at least
    ``MIN_ATTEMPT_SECONDS``) plus ``nbytes`` at ``MIN_BYTES_PER_SECOND``."""
    budget = self.retry_budget() if budget is None else budget
    return max(MIN_ATTEMPT_SECONDS, budget / 2) + max(0, nbytes) / MIN_BYTES_PER_SECOND

  # Implemented per backend.

  @abc.abstractmethod
  def _put(self, path: str, data: bytes, durable: bool = True) -> None:
    """Writes ``data`` at ``path``, replacing what is there, all at once."""

  @abc.abstractmethod
  def _create(self, path: str, data: bytes) -> None:
    """Writes ``data`` at ``path`` if nothing is there; raises FileExistsError if it is."""

  @abc.abstractmethod
  def _get(self, path: str) -> bytes:
    """The bytes at ``path``; FileNotFoundError if nothing is there."""

  def _get_hashed(self, path: str, digest: Any) -> bytes:
    """``_get``, feeding the bytes to ``digest`` (a hashlib object) as they come."""
    data = self._get(path)
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
      digest.update(view[start:start + _CHUNK])
    return data

  def _read(self, path: str, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of ``path``, else BadObject; backends override this to
    stop reading at the bound (this default reads the whole object first)."""
    data = self._get(path)
    if len(data) > max_bytes:
      raise BadObject(path, f"holds {len(data)} bytes, more than {max_bytes} bytes")
    return data

  def _size(self, path: str) -> int:
    return len(self._get(path))

  @abc.abstractmethod
  def _list(self, prefix: str) -> list[str]:
    """The names directly under ``prefix``, sorted."""

  def _list_marked(self, prefix: str) -> dict[str, str | None]:
    """The names directly under ``prefix``, each with its change marker; backends override
    this (this default knows no markers: None, read the object again)."""
    return {name: None for name in self._list(prefix)}

  def _list_dated(self, prefix: str) -> dict[str, float | None]:
    """The names directly under ``prefix``, each with its date; backends override this
    (this default knows no dates: None)."""
    return {name: None for name in self._list(prefix)}

  @abc.abstractmethod
  def _delete(self, path: str) -> None:
    """Removes ``path`` (a file or a folder); nothing if it is already gone."""

  def _delete_empty_folder(self, path: str) -> None:
    """Removes the folder ``path`` if it is empty; backends with folders override this
    (an object store's folder is a prefix that is gone with its last object)."""

  def _explain(self, what: str, path: str, error: BaseException) -> BaseException | None:
    """The error to raise for a non-transient ``error`` of ``what`` on ``path``, naming
    its fix; None raises ``error`` itself (backends override this)."""
    del what, path, error

  def bucket_problem(self) -> str | None:
    """Why the bucket the run lies in is not there, if it is known not to be; else None."""

  @property
  def local_root(self) -> str | None:
    """The directory of a local store (Orbax writes there directly), else None."""
    return None

  # The retried public operations.

  def _retry(self, what: str, path: str, call: Callable[[], T], nbytes: int = 0) -> T:
    budget = self.retry_budget()
    started = time.monotonic()
    delay, attempts = 0.02, 0
    deadline = self.attempt_seconds(nbytes, budget) if self.has_deadlines else None
    while True:
      try:
        _ATTEMPT.seconds = deadline
        try:
          return call()
        finally:
          _ATTEMPT.seconds = None
      except Exception as error:  # pylint: disable=broad-except
        attempts += 1
        if type(error).__name__ in _NO_CREDENTIALS:
          raise PermissionError(
              f"{what} {self.url}/{path.strip('/')}: no usable credentials for the"
              f" storage ({type(error).__name__}: {error}); configure them (for s3://,"
              " AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile), or pass"
              " storage_options") from error
        if not is_transient(error):
          explained = self._explain(what, path, error)
          if explained is None:
            raise
          raise explained from error
        # Twice at least: an attempt past the budget may have been this process paused.
        if attempts >= 2 and time.monotonic() + delay > started + budget:
          whose = ("the run's timeout for a learner; check the storage's availability or"
                   " raise the poll interval" if self._retry_budget is not None else
                   "retry_seconds; check the storage's availability, its endpoint and"
                   " the network, or raise retry_seconds")
          raise StorageUnavailable(
              f"{what} {self.url}/{path.strip('/')} still failed after {attempts}"
              f" attempt(s) over {time.monotonic() - started:.2f}s, the retry budget of"
              f" {budget:.2f}s ({whose}); last error: {error!r}.") from error
        log.warning("transient storage error on %s %s/%s, retrying in %.2fs: %r",
                    what, self.url, path, delay, error)
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 2.0)

  def put(self, path: str, data: bytes, *, durable: bool = True) -> None:
    """Writes ``data`` at ``path``, replacing what was there, atomically.

    Args:
      path: where.
      data: the bytes.
      durable: False lets a local store skip its fsyncs, for a copy that can be rebuilt
        from durable records: a machine crash may then lose or truncate it (readers must
        verify it), though no reader ever sees it partly written. Object stores are
        durable either way.
    """
    data = bytes(data)
    self._retry("put", path, lambda: self._put(path, data, durable), len(data))

  def create(self, path: str, data: bytes) -> bool:
    """Writes ``data`` at ``path`` only if nothing is there.

    A retried request whose first attempt did land finds its own bytes there; that
    counts as created.

    Returns:
      True if this call created the object, False if another writer had.
    """
    data = bytes(data)
    try:
      self._retry("create", path, lambda: self._create(path, data), len(data))
      return True
    except FileExistsError:
      try:
        return self.read(path, len(data)) == data
      except (FileNotFoundError, BadObject):
        # Exists, then vanished (a delete by hand): report the loss. Or it is no object
        # these bytes could be (a folder, a larger file): another writer's.
        return False

  def get(self, path: str) -> bytes:
    """The bytes at ``path``; FileNotFoundError if there are none."""
    return self._retry("get", path, lambda: self._get(path), self._size_for_deadline(path))

  def read(self, path: str, max_bytes: int) -> bytes:
    """The bytes at ``path`` if they are at most ``max_bytes``, read with that bound.

    For objects that anyone with write access may have planted (contributions,
    heartbeats): it never blocks on a FIFO, never reads a device or past the bound.

    Raises:
      FileNotFoundError: nothing is at ``path``.
      BadObject: ``path`` is not a regular file, or holds more than ``max_bytes``.
    """
    max_bytes = int(max_bytes)
    # An attempt's deadline follows the bytes it moves: the bound where it is small (a
    # contribution, a heartbeat), the object's size where the bound is far above it.
    moved = max_bytes if max_bytes <= _SMALL_BOUND else self._size_for_deadline(path)
    return self._retry("read", path, lambda: self._read(path, max_bytes), moved)

  def size(self, path: str) -> int:
    """The size in bytes of the object at ``path``; FileNotFoundError if there is none."""
    return self._retry("size", path, lambda: self._size(path))

  def get_verified(self, path: str, sha256: str, max_bytes: int | None = None) -> bytes:
    """The bytes at ``path``, hashed as they are read and checked against ``sha256``;
    with ``max_bytes``, read as ``read`` reads (a regular file, at most that many bytes).

    Raises:
      FileNotFoundError: nothing is at ``path``.
      BadObject: with ``max_bytes``, ``path`` is not a regular file or holds more.
      CorruptRecord: the bytes' sha256 is not ``sha256``.
    """
    if max_bytes is not None:
      data = self.read(path, max_bytes)
      actual = hashlib.sha256(data).hexdigest()
    else:
      def read() -> tuple[bytes, str]:
        digest = hashlib.sha256()
        data = self._get_hashed(path, digest)
        return data, digest.hexdigest()

      data, actual = self._retry("get", path, read, self._size_for_deadline(path))
    if actual != sha256:
      raise CorruptRecord(f"{path} does not match the sha256 its commit records")
    return data

  def _size_for_deadline(self, path: str) -> int:
    """The size of what a read of ``path`` will move, where attempts have deadlines (0
    where they do not, or where nothing is there: the read itself then says so)."""
    if not self.has_deadlines:
      return 0
    try:
      return self.size(path)
    except FileNotFoundError:
      return 0

  def exists(self, path: str) -> bool:
    try:
      self.get(path)
    except FileNotFoundError:
      return False
    return True

  def list(self, prefix: str) -> list[str]:
    """Names (not paths) of the entries directly under ``prefix``, sorted; [] if none."""
    return self._retry("list", prefix, lambda: sorted(self._list(prefix.strip("/"))))

  def temporaries(self, prefix: str) -> list[str]:
    """Names of this store's own temporary files directly under ``prefix``, sorted.

    A local directory writes each object beside its name first (``<name>.<hex>.tmp``);
    a kill mid-write leaves that file behind. ``list`` never shows them; whoever prunes
    a folder asks for them here. Object stores write none: [].
    """
    del prefix
    return []

  def list_marked(self, prefix: str) -> dict[str, str | None]:
    """Names directly under ``prefix``, sorted, each with a change marker.

    The marker of an object differs whenever it is replaced (locally its size, times and
    inode; on object stores its size with its ETag or generation), so a reader that
    judged an object can tell when to read it again. None where the backend cannot tell:
    read it again.
    """
    marked = self._retry("list", prefix, lambda: self._list_marked(prefix.strip("/")))
    return dict(sorted(marked.items()))

  def list_dated(self, prefix: str) -> dict[str, float | None]:
    """Names directly under ``prefix``, sorted, each with the time its object was last
    written, in seconds since the epoch by the storage's own clock (a local disk's
    modification time, an object store's update time): every date of one store comes
    from one clock, whichever machine wrote the object, so two of them can be compared.
    None for a folder, and where the backend cannot tell.
    """
    dated = self._retry("list", prefix, lambda: self._list_dated(prefix.strip("/")))
    return dict(sorted(dated.items()))

  def delete(self, path: str) -> None:
    """Removes the object at ``path`` (or the tree under it); no error if absent."""
    self._retry("delete", path, lambda: self._delete(path.strip("/")))

  def delete_empty_folder(self, path: str) -> None:
    """Removes the folder ``path`` only if it is empty, in one operation: what another
    process creates in it meanwhile is never deleted (``delete`` of a folder would)."""
    self._retry("delete", path, lambda: self._delete_empty_folder(path.strip("/")))

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.url!r})"
