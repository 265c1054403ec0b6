"""A run's store on an fsspec filesystem: ``memory://`` and ``gs://`` (gcsfs).

``gmjax.mail.store.open_store`` admits only protocols whose exclusive create is atomic;
S3 has its own store (``gmjax.mail.store_s3``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading

from typing import Any

import fsspec

from gmjax.mail.store import BadObject, Store

_MEMORY_LOCK = threading.Lock()
# The fsspec filesystem package each cloud protocol needs, and the gmjax extra that
# installs it.
_EXTRAS = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
           "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3")}


def require_filesystem(protocol: str) -> None:
  """Imports the filesystem package ``protocol`` needs, if it needs one of gmjax's extras.

  Raises:
    ImportError: the package is not installed; the message names the extra that
      installs it (``gs://`` needs gcsfs: ``pip install 'gmjax[gcs]'``).
  """
  if protocol not in _EXTRAS:
    return
  package, extra = _EXTRAS[protocol]
  try:
    importlib.import_module(package)
  except ImportError as error:
    raise ImportError(
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

  def _path(self, path: str) -> str:
    path = path.strip("/")
    return f"{self.root}/{path}" if path else self.root

  def _put(self, path: str, data: bytes, durable: bool = True) -> None:
    """Writes ``data`` at ``path``, replacing what is there, all at once."""
    self.fs.pipe_file(self._path(path), data)

  def _create(self, path: str, data: bytes) -> None:
    target = self._path(path)
    if self._memory:
      with _MEMORY_LOCK:
        if self.fs.exists(target):
          raise FileExistsError(target)
        self.fs.pipe_file(target, data)
      return
    # gcsfs sends one upload with ifGenerationMatch=0 (open_store admits no other
    # protocol here; S3 has its own store).
    self.fs.pipe_file(target, data, mode="create")

  def _get(self, path: str) -> bytes:
    return self.fs.cat_file(self._path(path))

  def _read(self, path: str, max_bytes: int) -> bytes:
    # A ranged read (an HTTP Range request on object stores) that asks for one byte past
    # the bound: a larger object shows itself without being downloaded.
    data = self.fs.cat_file(self._path(path), start=0, end=max_bytes + 1)
    if len(data) > max_bytes:
      raise BadObject(path, f"holds more than {max_bytes} bytes")
    return data

  def _size(self, path: str) -> int:
    return int(self.fs.size(self._path(path)))

  def _list(self, prefix: str) -> list[str]:
    target = self._path(prefix)
    self.fs.invalidate_cache(target)
    try:
      entries = self.fs.ls(target, detail=False)
    except (FileNotFoundError, NotADirectoryError):
      return []
    names = []
    for entry in entries:
      name = str(entry).rstrip("/").rsplit("/", 1)[-1]
      if name and str(entry).rstrip("/") != target.rstrip("/"):
        names.append(name)
    return sorted(set(names))

  def _delete(self, path: str) -> None:
    target = self._path(path)
    with contextlib.suppress(FileNotFoundError):  # deleting what is gone is done
      self.fs.rm(target, recursive=True)
    self.fs.invalidate_cache(target)
