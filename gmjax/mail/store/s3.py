"""A run on Amazon S3 (or an S3-compatible service) through s3fs.

Exclusive create is one ``PutObject`` with ``If-None-Match: *``: S3 stores the object
only if no object has the key, and answers ``412 Precondition Failed`` otherwise (s3fs
raises ``FileExistsError``), so of any number of racing closers exactly one commits a
version. A concurrent conditional write of the same key may instead be answered with
``409 ConditionalRequestConflict``, which is transient: the retry then finds the
winner's object (or its own, which counts as created).

Some S3-compatible services accept the header and ignore it, which would let two
closers both commit a version without any error. The first exclusive create of each
endpoint and bucket in a process therefore probes the service: it creates a probe
object (under the run's prefix) twice and requires the second create to be refused, else
raises ``UnsupportedStorage``.

Credentials and the endpoint come from ``storage_options`` (``key``, ``secret``,
``endpoint_url``, ``client_kwargs``, ...), or from the usual ``AWS_*`` environment.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any

from gmjax.mail.errors import UnsupportedStorage
from gmjax.mail.store.fsspec import FsspecStore

_PROBED: set[tuple[str, str]] = set()
_PROBE_LOCK = threading.Lock()
PROBE_PREFIX = ".gmjax-probe"


class S3Store(FsspecStore):
  """``s3://bucket/prefix`` through s3fs, with conditional puts for exclusive create."""

  def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
               **kwargs: Any):
    options = dict(storage_options or {})
    # Every learner polls listings another process changes: never answer from a cache.
    options.setdefault("use_listings_cache", False)
    options.setdefault("skip_instance_cache", True)
    self._endpoint = str(options.get("endpoint_url")
                         or (options.get("client_kwargs") or {}).get("endpoint_url") or "aws")
    if self._endpoint != "aws" and "://" not in self._endpoint:
      raise ValueError(
          f"storage_options endpoint_url={self._endpoint!r} has no scheme; give the"
          f" service's URL, e.g. 'http://{self._endpoint}' (or 'https://...')")
    super().__init__(url, storage_options=options, **kwargs)

  def _put_if_absent(self, target: str, data: bytes) -> None:
    bucket, key, _ = self.fs.split_path(target)
    try:
      self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*",
                      **self._limit())
    finally:
      self.fs.invalidate_cache(target)

  def _check_conditional_puts(self, target: str) -> None:
    """Raises UnsupportedStorage if the service ignores ``If-None-Match: *``."""
    bucket = self.fs.split_path(target)[0]
    with _PROBE_LOCK:
      if (self._endpoint, bucket) in _PROBED:
        return
      # Under the run's own prefix: credentials may be limited to it.
      probe = f"{self.root}/{PROBE_PREFIX}/{uuid.uuid4().hex}"
      try:
        self._put_if_absent(probe, b"first")
        try:
          self._put_if_absent(probe, b"second")
        except FileExistsError:
          _PROBED.add((self._endpoint, bucket))
          return
        raise UnsupportedStorage(
            f"the S3 service at {self._endpoint} (bucket {bucket!r}) accepted a second"
            " PutObject with If-None-Match: * for an existing key, so it cannot commit"
            " a version exactly once; use Amazon S3, another service that honours"
            " conditional writes, gs://, or a local directory.")
      finally:
        # Nothing stored, or no right to delete it: the probe's verdict (or its error)
        # is what counts, not its removal.
        with contextlib.suppress(OSError):
          self.fs.rm_file(probe, **self._limit())

  def _create(self, path: str, data: bytes) -> None:
    target = self._path(path)
    self._check_conditional_puts(target)
    self._put_if_absent(target, data)
