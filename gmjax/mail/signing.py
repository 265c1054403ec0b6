"""HMAC-SHA256 signatures of contributions and commit records, for runs with a key.

A run created with ``key=`` stores in its manifest a random salt and
``HMAC(key, salt)``, so ``open`` can tell a wrong key from a right one without the key
ever being stored. Learners sign each contribution over its metadata (canonical JSON,
without the signature) and every entry's name, dtype, shape and bytes; closers sign
commit records over their canonical JSON. Comparison is constant-time.

Signatures cover the run: a manifest created by this gmjax marks its auth ``run_bound``,
and every object of that run (contributions, commit records, heartbeats) is signed with
``run_key(key, auth)``, ``HMAC(key, "gmjax/run:" + salt)``, a key no other run shares
even when it was created with the same key. An object copied from another run fails its
signature check like a forged one. The manifest itself is signed with the key; a manifest
copied from another run is found by ``open`` (its salt signs none of the run's records).
Runs whose manifest has no ``run_bound`` (created before signatures covered the run) are
signed and checked with the key itself, as they always were.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from gmjax.core.schema import NUMPY_DTYPES

SCHEME = "HMAC-SHA256"
SIGNATURE = "signature"
_CODE_OF = {dtype: code for code, dtype in NUMPY_DTYPES.items()}


def as_key(key: bytes | str | None) -> bytes | None:
  """The key as bytes (a str is UTF-8 encoded); None stays None."""
  if key is None:
    return None
  if not isinstance(key, (str, bytes, bytearray)):
    raise TypeError(f"key must be non-empty bytes or str, got {type(key).__name__}")
  if not key:
    raise ValueError(f"key={key!r} is empty: pass a non-empty str or bytes, or None for"
                     " a run without a key.")
  return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def new_auth(key: bytes) -> dict[str, str]:
  """The manifest's ``auth`` record for a run keyed with ``key``."""
  salt = secrets.token_hex(16)
  return {"scheme": SCHEME, "salt": salt, "check": _hmac(key, salt.encode()),
          "run_bound": True}


def run_key(key: bytes | None, auth: Mapping[str, Any] | None) -> bytes | None:
  """The key the objects of the run with manifest ``auth`` are signed with.

  Args:
    key: the run's key, or None for an unkeyed run (None is returned).
    auth: the manifest's ``auth`` record.

  Returns:
    ``HMAC-SHA256(key, "gmjax/run:" + salt)`` for a run whose auth is ``run_bound``, else
    ``key`` (a run created before signatures covered the run).
  """
  if key is None or not isinstance(auth, Mapping) or auth.get("run_bound") is not True:
    return key
  return hmac.new(key, b"gmjax/run:" + str(auth.get("salt", "")).encode(),
                  hashlib.sha256).digest()


def key_matches(auth: Mapping[str, Any], key: bytes) -> bool:
  return _same(auth.get("check", ""), _hmac(key, str(auth["salt"]).encode()))


def sign_payload(key: bytes, entries: Mapping[str, Any], metadata: Mapping[str, str]) -> str:
  return _hmac(key, _payload_message(entries, metadata))


def payload_signature_ok(key: bytes, entries: Mapping[str, Any],
                         metadata: Mapping[str, str]) -> bool:
  unsigned = {k: v for k, v in metadata.items() if k != SIGNATURE}
  return _same(metadata.get(SIGNATURE, ""), _hmac(key, _payload_message(entries, unsigned)))


def sign_record(key: bytes, record: Mapping[str, Any]) -> str:
  return _hmac(key, _canonical({k: v for k, v in record.items() if k != SIGNATURE}))


def record_signature_ok(key: bytes, record: Mapping[str, Any]) -> bool:
  return _same(record.get(SIGNATURE, ""), sign_record(key, record))


def _same(given: Any, expected: str) -> bool:
  """Whether ``given`` (untrusted) is the hex signature ``expected``, in constant time.

  Compared as bytes: ``hmac.compare_digest`` raises a TypeError for a ``str`` with a
  character past ASCII, which a hostile file could hold.
  """
  if not isinstance(given, str):
    return False
  return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("ascii"))


def _hmac(key: bytes, message: bytes) -> str:
  return hmac.new(key, message, hashlib.sha256).hexdigest()


def _canonical(value: Any) -> bytes:
  return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _payload_message(entries: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
  digest = hashlib.sha256(_canonical(dict(metadata)))
  for name in sorted(entries):
    array = np.ascontiguousarray(np.asarray(entries[name]))
    header = _canonical([name, _CODE_OF.get(array.dtype, str(array.dtype)), list(array.shape)])
    digest.update(len(header).to_bytes(8, "little") + header)
    digest.update(array.tobytes())
  return digest.digest()
