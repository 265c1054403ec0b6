"""A run's store on an fsspec filesystem: ``memory://`` and ``gs://`` (gcsfs).

``gmjax.mail.store.open_store`` admits only protocols whose exclusive create is atomic;
S3 has its own store (``gmjax.mail.store.s3``). In ``memory://``, as on a disk, a file
stands in the way of a folder of its name and a folder reads as no object: a write
removes a file planted where its folders belong (logging a warning), and ``read`` of a
folder raises ``BadObject``.

On an asynchronous filesystem (gcsfs, s3fs) each request runs under the deadline of its
attempt (``gmjax.mail.store.base.attempt_deadline``): fsspec cancels the request when it
passes, and the store retries it.

fsspec's ``MemoryFileSystem`` is one dict shared by the process and takes no lock: its
``ls`` copies the keys, then looks each one up, so a delete on another thread between the
two raises ``KeyError`` in the listing thread. Every ``memory://`` call here runs under
one lock (``_MEMORY_LOCK``): the learners of a run in one process share that dict.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import re
import threading

from typing import Any

import fsspec

from gmjax.mail.errors import StorageNotInstalled
from gmjax.mail.store.base import (BadObject, MIN_ATTEMPT_SECONDS, Store,
                                   attempt_deadline)

log = logging.getLogger(__name__)
# Serializes every memory:// call (see the module docstring); reentrant, as a create
# clears planted files and writes under one hold.
_MEMORY_LOCK = threading.RLock()
# What changes when an object is replaced: s3fs reports ETag, gcsfs generation, memory://
# created (and every backend size).
_MARKERS = ("type", "size", "ETag", "generation", "created")
# Where each filesystem's details give an object's last write: gcsfs ("mtime", a
# datetime; "updated" in ISO form), s3fs ("LastModified"), fsspec's memory filesystem
# ("created", seconds).
_DATES = ("mtime", "LastModified", "updated", "created")


def _date(info: dict[str, Any]) -> float | None:
  """When the object ``info`` describes was last written, in seconds since the epoch by
  the storage's clock; None for a folder, or where the details say nothing of it."""
  if info.get("type") != "file":
    return None
  for field in _DATES:
    value = info.get(field)
    if isinstance(value, str):
      with contextlib.suppress(ValueError):
        value = datetime.datetime.fromisoformat(value)
    if isinstance(value, datetime.datetime):
      if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
      return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  return None


# How to fix credentials that storage refused, by protocol.
_GCS_CREDENTIALS = ("check the credentials (storage_options' token, or"
                    " GOOGLE_APPLICATION_CREDENTIALS) and that they may read and write"
                    " the run's prefix")
_S3_CREDENTIALS = ("check the credentials (storage_options' key and secret, or"
                   " AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile) and that"
                   " they may read and write the run's prefix")
_CREDENTIALS = {"gs": _GCS_CREDENTIALS, "gcs": _GCS_CREDENTIALS, "s3": _S3_CREDENTIALS,
                "s3a": _S3_CREDENTIALS}

_PATTERN = re.compile(r"[*?\[]")  # what fsspec's rm and expand_path take as a pattern

# The fsspec filesystem package each cloud protocol needs, and the gmjax extra that
# installs it.
_EXTRAS = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
           "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3")}


def _unsatisfiable(error: BaseException) -> bool:
  """Whether ``error`` is an HTTP 416 (a range past the object's end): gcsfs keeps the
  code, s3fs maps it to ``OSError(EINVAL)`` with S3's message."""
  return getattr(error, "code", None) == 416 or "range is not satisfiable" in str(error)


def require_filesystem(protocol: str) -> None:
  """Imports the filesystem package ``protocol`` needs, if it needs one of gmjax's extras.

  Raises:
    StorageNotInstalled: the package is not installed (an ``ImportError``); the
      message names the extra that installs it (``gs://`` needs gcsfs: ``pip install
      'gmjax[gcs]'``).
  """
  if protocol not in _EXTRAS:
    return
  package, extra = _EXTRAS[protocol]
  try:
    importlib.import_module(package)
  except ImportError as error:
    raise StorageNotInstalled(
        f"{protocol}:// needs {package}, which is not installed: pip install"
        f" 'gmjax[{extra}]' (or pip install {package}).", name=package) from error


class FsspecStore(Store):
  """Any fsspec filesystem: ``memory://``, ``gs://`` (gcsfs) and others."""

  def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
               **kwargs: Any):
    super().__init__(url, **kwargs)
    options = dict(storage_options or {})
    protocol = url.split("://", 1)[0]
    require_filesystem(protocol)
    if protocol in ("gs", "gcs"):
      options.setdefault("use_listings_cache", False)
      options.setdefault("skip_instance_cache", True)
      if os.environ.get("STORAGE_EMULATOR_HOST"):
        options.setdefault("token", "anon")
    if protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
      # An emulator serves the JSON API only; gcsfs's default class would first probe the
      # gRPC control plane for the bucket type and wait out its timeout.
      from gcsfs.core import GCSFileSystem  # pylint: disable=g-import-not-at-top

      self.fs = GCSFileSystem(**options)
      root = self.fs._strip_protocol(url)  # pylint: disable=protected-access
    else:
      self.fs, root = fsspec.core.url_to_fs(url, **options)
    self.root = root.rstrip("/")
    self.protocol = protocol
    self._memory = protocol == "memory"
    self.has_deadlines = bool(getattr(self.fs, "async_impl", False))

  def bucket_problem(self) -> str | None:
    if self.protocol not in _EXTRAS:
      return None
    bucket = self.root.split("/", 1)[0]
    limit = {"timeout": MIN_ATTEMPT_SECONDS} if self.has_deadlines else {}
    try:
      # The bucket's own metadata: a 404 there is the only evidence taken. A listing, or
      # fsspec's info (which lists where the metadata is refused), finds an empty bucket
      # or one these credentials may not list as missing too.
      if self.protocol in ("s3", "s3a"):
        self.fs.call_s3("head_bucket", Bucket=bucket, **limit)
      else:
        self.fs.call("GET", "b/{}", bucket, json_out=True, **limit)
    except FileNotFoundError:
      return (f"the bucket {bucket!r} does not exist at this storage; create it, or give"
              " a URL in an existing bucket")
    except Exception:  # pylint: disable=broad-except
      return None  # refused (credentials for objects only), unreachable: no evidence
    return None

  def _explain(self, what: str, path: str, error: BaseException) -> BaseException | None:
    where = f"{what} {self.url}/{path.strip('/')}"
    if self.protocol not in _EXTRAS:
      return None
    if isinstance(error, PermissionError):
      return PermissionError(f"{where}: the storage refused access ({error});"
                             f" {_CREDENTIALS[self.protocol]}")
    if isinstance(error, FileNotFoundError) and what in ("put", "create"):
      problem = self.bucket_problem()  # a write finds nothing missing but its bucket
      if problem:
        return FileNotFoundError(f"{where}: {problem}")
    return None

  def _limit(self) -> dict[str, float]:
    """The keyword that bounds one request of an asynchronous filesystem by the current
    attempt's deadline: fsspec's blocking wrappers take ``timeout=`` themselves, wait
    for that long, and cancel the request."""
    seconds = attempt_deadline() if self.has_deadlines else None
    return {"timeout": seconds} if seconds else {}

  def _serial(self) -> contextlib.AbstractContextManager[Any]:
    """Holds ``_MEMORY_LOCK`` for a memory:// call (fsspec's memory filesystem is not
    safe across threads); nothing for other filesystems."""
    return _MEMORY_LOCK if self._memory else contextlib.nullcontext()

  def _path(self, path: str) -> str:
    path = path.strip("/")
    return f"{self.root}/{path}" if path else self.root

  def _put(self, path: str, data: bytes, durable: bool = True) -> None:
    """Writes ``data`` at ``path``, replacing what is there, all at once."""
    target = self._path(path)
    with self._serial():
      try:
        self.fs.pipe_file(target, data, **self._limit())
      except (FileExistsError, NotADirectoryError):
        if not self._memory:
          raise
        self._clear_folders(path)  # a file stands where a folder above the target belongs
        self.fs.pipe_file(target, data)

  def _clear_folders(self, path: str) -> None:
    """Removes files planted where the folders above ``path`` belong (memory://, under
    its lock)."""
    parts = path.strip("/").split("/")[:-1]
    for depth in range(1, len(parts) + 1):
      folder = self._path("/".join(parts[:depth]))
      if self.fs.isfile(folder):
        log.warning("removing a file planted at %s, where the run's layout keeps a folder",
                    folder)
        self.fs.rm_file(folder)

  def _create(self, path: str, data: bytes) -> None:
    target = self._path(path)
    if self._memory:
      with self._serial():
        if self.fs.exists(target):
          raise FileExistsError(target)
        self._clear_folders(path)
        self.fs.pipe_file(target, data)
      return
    # gcsfs sends one upload with ifGenerationMatch=0 (open_store admits no other
    # protocol here; S3 has its own store).
    self.fs.pipe_file(target, data, mode="create", **self._limit())

  def _get(self, path: str) -> bytes:
    with self._serial():
      return self.fs.cat_file(self._path(path), **self._limit())

  def _read(self, path: str, max_bytes: int) -> bytes:
    # A ranged read (an HTTP Range request on object stores) that asks for one byte past
    # the bound: a larger object shows itself without being downloaded.
    with self._serial():
      try:
        data = self.fs.cat_file(self._path(path), start=0, end=max_bytes + 1,
                                **self._limit())
      except Exception as error:  # pylint: disable=broad-except
        # S3 and GCS answer a range of an empty object with 416: it holds nothing.
        if _unsatisfiable(error) and self.fs.size(self._path(path), **self._limit()) == 0:
          return b""
        if not isinstance(error, FileNotFoundError):
          raise
        # In memory:// a folder takes the name from objects, as on a disk; on object
        # stores a prefix and a key of one name are independent (and asking costs a
        # request).
        if self._memory and self.fs.isdir(self._path(path)):
          raise BadObject(path, "is not a regular file (a folder)") from None
        raise
    if len(data) > max_bytes:
      raise BadObject(path, f"holds more than {max_bytes} bytes")
    return data

  def _size(self, path: str) -> int:
    with self._serial():
      return int(self.fs.size(self._path(path), **self._limit()))

  def _list(self, prefix: str) -> list[str]:
    target = self._path(prefix)
    self.fs.invalidate_cache(target)
    try:
      with self._serial():
        entries = self.fs.ls(target, detail=False, **self._limit())
    except (FileNotFoundError, NotADirectoryError):
      return []
    names = []
    for entry in entries:
      name = str(entry).rstrip("/").rsplit("/", 1)[-1]
      if name and str(entry).rstrip("/") != target.rstrip("/"):
        names.append(name)
    return sorted(set(names))

  def _details(self, prefix: str) -> dict[str, dict[str, Any]]:
    """Each entry directly under ``prefix``, with the filesystem's details of it."""
    target = self._path(prefix)
    self.fs.invalidate_cache(target)
    try:
      with self._serial():
        entries = self.fs.ls(target, detail=True, **self._limit())
    except (FileNotFoundError, NotADirectoryError):
      return {}
    details = {}
    for info in entries:
      entry = str(info["name"]).rstrip("/")
      name = entry.rsplit("/", 1)[-1]
      if name and entry != target.rstrip("/"):
        if details.get(name, {}).get("type") == "file" and info.get("type") != "file":
          continue  # an object and a prefix of one name (S3): the object's details count
        details[name] = info
    return details

  def _list_marked(self, prefix: str) -> dict[str, str]:
    return {name: ":".join(str(info.get(field)) for field in _MARKERS)
            for name, info in self._details(prefix).items()}

  def _list_dated(self, prefix: str) -> dict[str, float | None]:
    return {name: _date(info) for name, info in self._details(prefix).items()}

  def _delete(self, path: str) -> None:
    target = self._path(path)
    # Deleting what is gone is done.
    with contextlib.suppress(FileNotFoundError), self._serial():
      if _PATTERN.search(target):
        # fs.rm expands * ? [ as a pattern: it would delete other runs' objects (a run
        # named run-?) or a whole folder (a planted rounds/3/*). Exact names instead.
        if self.fs.isfile(target):
          self.fs.rm_file(target, **self._limit())
        else:
          for name in self.fs.find(target, **self._limit()):
            self.fs.rm_file(name, **self._limit())
      else:
        self.fs.rm(target, recursive=True, **self._limit())
    self.fs.invalidate_cache(target)
