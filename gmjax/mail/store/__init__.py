"""Object storage for a run: a local directory, ``memory://``, ``gs://`` or ``s3://``.

``open_store(url)`` picks the backend. Each implements ``base.Store`` (atomic ``put``,
exclusive ``create``, bounded ``read``, ``list_marked``, retries and per-attempt
deadlines; its docstring says how):

* ``local``: a directory (a path or ``file://``);
* ``fsspec``: ``memory://`` and ``gs://`` (gcsfs);
* ``s3``: ``s3://`` (s3fs), imported only when a run on S3 is opened.

Other fsspec URLs are refused (``UnsupportedStorage``): fsspec's generic
``mode="create"`` is an ``exists()`` followed by a write, so two closers could both
commit one version.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from gmjax.mail.errors import UnsupportedStorage
from gmjax.mail.store.base import (MIN_ATTEMPT_SECONDS, MIN_BYTES_PER_SECOND, BadObject,
                                   Store, attempt_deadline, is_transient)
from gmjax.mail.store.fsspec import FsspecStore, require_filesystem
from gmjax.mail.store.local import LocalStore, fsync_dir

__all__ = ["MIN_ATTEMPT_SECONDS", "MIN_BYTES_PER_SECOND", "SUPPORTED_PROTOCOLS", "BadObject",
           "FsspecStore", "LocalStore", "Store", "attempt_deadline", "fsync_dir",
           "is_transient", "open_store"]

# URL schemes whose exclusive create is atomic and tested against a real server.
SUPPORTED_PROTOCOLS = ("file", "memory", "gs", "gcs", "s3", "s3a")
# The scheme of a URL with one slash (``gs:/bucket``), which would be a local folder.
_MISTYPED = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def meant(url: str) -> str | None:
  """The URL that ``url``, a scheme followed by one slash, was meant to be, else None."""
  mistyped = _MISTYPED.match(url)
  return mistyped and f"{mistyped[1]}://{url[mistyped.end():]}"


# Protocols whose URL is a bucket and a prefix in it.
_BUCKETED = ("gs", "gcs", "s3", "s3a")


def _check_bucket_url(url: str, protocol: str) -> None:
  """Raises ValueError unless ``url`` names a bucket, and, on S3, no object version:
  s3fs cuts ``?versionId=...`` off every key, so each file of the run would be one
  key (the key before it, which the S3 store's probe, deleted, would remove)."""
  if protocol in ("s3", "s3a") and "?versionId=" in url:
    cut = url.index("?versionId=")
    raise ValueError(
        f"url={url!r} names an object's version ({url[cut:]!r:.60}), which s3fs would"
        f" cut off every key of the run; a run's URL is a bucket and a prefix in it:"
        f" drop it, e.g. {url[:cut]!r}")
  if not url.split("://", 1)[1].split("/", 1)[0]:
    raise ValueError(f"url={url!r} names no bucket; give {protocol}://BUCKET/RUN, e.g."
                     f" {protocol}://my-bucket/runs/exp1")


def open_store(url: str, *, retry_seconds: float = 30.0,
               storage_options: dict[str, Any] | None = None) -> Store:
  """The store for ``url``: a local directory (a path or ``file://``) or an fsspec URL.

  Args:
    url: ``/path/to/run``, ``file:///path``, ``memory://run``, ``gs://bucket/run``, ...
    retry_seconds: how long transient errors are retried while no retry budget is set
      (a learner sets the run's timeout as its budget).
    storage_options: passed to the fsspec filesystem (e.g. ``{"token": ...}`` for gcsfs).

  Raises:
    TypeError: ``url`` is not a string, or ``storage_options`` not a dict.
    ValueError: ``storage_options`` given for a local folder (they would be ignored); a
      ``gs://`` or ``s3://`` URL without a bucket, an ``s3://`` one with
      ``?versionId=``.
    UnsupportedStorage: the URL's protocol has no atomic exclusive create
      (``SUPPORTED_PROTOCOLS`` lists those that do).
    StorageNotInstalled: the package for the URL's protocol (gcsfs, s3fs) is not
      installed; the message names the extra that installs it (an ``ImportError``).
  """
  if not isinstance(url, (str, os.PathLike)):
    raise TypeError(f"url must be a path or URL string, got {type(url).__name__}: {url!r}")
  url = os.fspath(url)
  if not url.strip() or "\0" in url:
    raise ValueError(f"url={url!r} names no run: give a folder (e.g. runs/mine) or a URL"
                     " (e.g. gs://bucket/run)")
  if meant(url):  # "gs:/bucket" would be a local folder named "gs:"
    raise ValueError(f"url={url!r} is not a URL: did you mean {meant(url)}?")
  if storage_options is not None and not isinstance(storage_options, Mapping):
    raise TypeError(f"storage_options must be None or a dict of the fsspec filesystem's"
                    f" options (e.g. {{'token': ...}} for gcsfs), got"
                    f" {type(storage_options).__name__} {storage_options!r:.80}.")
  if "://" not in url and "::" not in url or url.startswith("file://"):
    if storage_options:
      raise ValueError(f"url={url!r} is a local folder, which takes no storage_options"
                       f" (got {sorted(storage_options)!r:.80}); they are for gs:// and"
                       " s3:// URLs: drop them, or give the bucket's URL.")
    return LocalStore(url, retry_seconds=retry_seconds)
  protocol = url.split("://", 1)[0] if "://" in url else url.split("::", 1)[0]
  if protocol not in SUPPORTED_PROTOCOLS:
    raise UnsupportedStorage(
        f"url={url!r}: protocol {protocol!r} is not supported for a run, because its"
        " exclusive create (the commit of each version) is not known to be atomic:"
        " fsspec's generic create is an exists() check then a write, which two closers"
        f" can both pass. Use one of {', '.join(p + '://' for p in SUPPORTED_PROTOCOLS)}"
        " or a local directory.")
  if protocol in _BUCKETED:
    _check_bucket_url(url, protocol)
  require_filesystem(protocol)
  if protocol in ("s3", "s3a"):
    from gmjax.mail.store.s3 import S3Store  # pylint: disable=g-import-not-at-top

    return S3Store(url, retry_seconds=retry_seconds, storage_options=storage_options)
  return FsspecStore(url, retry_seconds=retry_seconds, storage_options=storage_options)
