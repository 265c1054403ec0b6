"""Which storage errors are worth retrying: timeouts, resets, HTTP 429 and 5xx.

Each storage library raises its own types (aiohttp and requests under gcsfs, botocore
under s3fs, which maps most S3 error codes to ``OSError`` errnos); they are told apart
here by errno, HTTP code and type name, without importing any of them.
"""

from __future__ import annotations

import errno

_TRANSIENT_ERRNOS = frozenset(
    {errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
     errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE}
    # s3fs maps HTTP 500 (InternalError) to EREMOTEIO, 409/503 (conflict, SlowDown) to EBUSY.
    | ({errno.EREMOTEIO} if hasattr(errno, "EREMOTEIO") else set())
)
_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_NAMES = frozenset({
    "ClientConnectionError", "ClientOSError", "ServerDisconnectedError",
    "ServerTimeoutError", "ClientPayloadError", "ConnectionError", "ReadTimeout",
    "ProxyError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError"})


def is_transient(error: BaseException) -> bool:
  """Whether a storage error is worth retrying (a timeout, reset or HTTP 429/5xx)."""
  if isinstance(error, (FileNotFoundError, FileExistsError, PermissionError,
                        IsADirectoryError, NotADirectoryError)):
    return False
  if isinstance(error, (ConnectionError, TimeoutError, InterruptedError)):
    return True
  if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
    return True
  code = getattr(error, "code", None)
  if isinstance(code, int) and code in _TRANSIENT_HTTP:
    return True
  # S3's answer to two conditional writes of one key at once (s3fs maps it to EIO).
  if "ConditionalRequestConflict" in str(error):
    return True
  # aiohttp, requests (gcsfs: a 502 arrives as ProxyError) and botocore errors, without
  # importing them.
  return any(kind.__name__ in _TRANSIENT_NAMES for kind in type(error).__mro__)
