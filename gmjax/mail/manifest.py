"""The run's manifest: format, schema, algorithm configuration, fragment plan and auth."""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Self

from gmjax.core.diloco import DiLoCo
from gmjax.core.schema import Schema
from gmjax.mail import layout
from gmjax.mail import signing
from gmjax.mail.errors import AuthenticationError, CorruptRecord


@dataclasses.dataclass(frozen=True)
class Manifest:
  """What every learner of a run agrees on.

  Attributes:
    schema: the parameters' names, dtypes and shapes.
    config: the algorithm (``gmjax.DiLoCo``).
    plan: the leaf names of each fragment.
    auth: None, or ``{scheme, salt, check}`` for a run keyed with HMAC-SHA256.
    created_at: UTC ISO time of creation (not part of the comparison).
  """

  schema: Schema
  config: DiLoCo
  plan: tuple[tuple[str, ...], ...]
  auth: dict[str, str] | None = None
  created_at: str = ""

  @classmethod
  def new(cls, schema: Schema, config: DiLoCo, key: bytes | None) -> Self:
    return cls(
        schema=Schema(schema.parameters),
        config=config,
        plan=tuple(tuple(names) for names in config.plan(schema)),
        auth=None if key is None else signing.new_auth(key),
        created_at=utc_now(),
    )

  def to_json(self) -> dict[str, Any]:
    return {
        "format": layout.FORMAT,
        "schema": self.schema.to_json(),
        "algorithm": self.config.to_json(),
        "plan": [list(names) for names in self.plan],
        "auth": self.auth,
        "created_at": self.created_at,
    }

  def dumps(self) -> bytes:
    return json.dumps(self.to_json(), indent=1).encode()

  @classmethod
  def loads(cls, data: bytes) -> Self:
    try:
      record = json.loads(data)
      if record.get("format") != layout.FORMAT:
        raise CorruptRecord(
            f"manifest format is {record.get('format')!r}, this gmjax reads"
            f" {layout.FORMAT!r}"
        )
      return cls(
          schema=Schema.from_json(record["schema"]),
          config=DiLoCo.from_json(record["algorithm"]),
          plan=tuple(tuple(str(n) for n in names) for names in record["plan"]),
          auth=record.get("auth"),
          created_at=str(record.get("created_at", "")),
      )
    except CorruptRecord:
      raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
      raise CorruptRecord(f"manifest.json does not parse: {error!r}") from error

  def same_run(self, other: Manifest, key: bytes | None) -> list[str]:
    """What differs between this stored manifest and a new one keyed with ``key``."""
    differences = []
    if self.schema != other.schema:
      differences.append("schema")
    if self.config != other.config:
      differences.append("algorithm")
    if self.plan != other.plan:
      differences.append("plan")
    if (self.auth is None) != (key is None) or (
        key is not None and not signing.key_matches(self.auth, key)):
      differences.append("key")
    return differences

  def check_key(self, key: bytes | None, url: str) -> None:
    """Raises AuthenticationError unless ``key`` is the run's key (or both are absent)."""
    if self.auth is None:
      if key is not None:
        raise AuthenticationError(
            f"run {url!r} was created without a key, but key= was given; open it"
            " without key=."
        )
      return
    if key is None:
      raise AuthenticationError(
          f"run {url!r} is signed with {self.auth.get('scheme')}; pass its key with key=."
      )
    if not signing.key_matches(self.auth, key):
      raise AuthenticationError(f"key= is not the key of run {url!r}.")

  @property
  def schedule(self):
    return self.config.schedule(len(self.plan))


def utc_now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
