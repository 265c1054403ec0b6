"""The run's manifest: format, schema, algorithm configuration, fragment plan and auth.

A keyed run's manifest carries ``signature``: HMAC-SHA256 with the run's key over the
canonical JSON of every other field as stored, so a changed learning rate, schedule,
precision, plan or schema (or a removed signature) is refused with
``AuthenticationError`` when the run is opened, joined or created again. An unkeyed
run's manifest has no signature and is trusted like its storage.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Self

from gmjax.core import layers
from gmjax.core.diloco import DiLoCo
from gmjax.core.guards import quote
from gmjax.core.schema import ParameterSpec, Schema
from gmjax.mail import layout
from gmjax.mail import signing
from gmjax.mail.errors import AuthenticationError, CorruptRecord, RunNotFound
from gmjax.mail.store import BadObject, Store

MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest a reader takes: a model's schema and plan, a few hundred bytes a
leaf (a planted object past it is refused before it is downloaded)."""


def stored_schema(schema: Schema, config: DiLoCo) -> Schema:
  """The run's schema from the specs a manifest stores: with ``layer_axis``, those of
  the blocks, given back the stacked leaves they were cut from (``source``) and their
  ``pieces``, so that ``config.cut``, ``plan`` and ``schedule`` of it are the run's.
  Specs that are no such cut stay as they are."""
  if config.layer_axis is None:
    return schema
  blocks: dict[str, list[tuple[int, ParameterSpec]]] = {}
  whole = []
  prefixes = [p.rstrip("/") for p in config.layer_axis]
  stacked = lambda leaf: any(leaf == p or leaf.startswith(p + "/") for p in prefixes)
  for spec in schema.parameters:
    block = layers.block_of(spec.name)
    if block and stacked(block[0]):  # a leaf of its own may be named like a block
      blocks.setdefault(block[0], []).append((block[2], spec))
    else:
      whole.append(spec)
  shapes = {spec.name: spec.shape for spec in whole}
  shapes.update({leaf: parts[0][1].shape for leaf, parts in blocks.items()})
  try:
    axes = layers.stacked_leaves(shapes, config.layer_axis)
    sources = []
    for leaf, parts in blocks.items():
      shape = list(parts[0][1].shape)
      shape[axes[leaf]] = max(stop for stop, _ in parts)
      sources.append(ParameterSpec(leaf, parts[0][1].dtype, tuple(shape)))
    cut = config.cut(Schema((*whole, *sources)))
  except (ValueError, KeyError, IndexError):
    return schema
  return cut if cut == schema else schema


@dataclasses.dataclass(frozen=True)
class Manifest:
  """What every learner of a run agrees on.

  Attributes:
    schema: the parameters' names, dtypes and shapes.
    config: the algorithm (``gmjax.DiLoCo``).
    plan: the leaf names of each fragment.
    auth: None, or ``{scheme, salt, check, run_bound}`` for a run keyed with
      HMAC-SHA256 (``run_bound``: its objects are signed with ``signing.run_key``).
    created_at: UTC ISO time of creation (not part of the comparison).
    keep_versions: how many of each fragment's newest versions the run keeps on
      storage (``gmjax.mail.retention``); None keeps every version, as manifests
      written before the field existed do.
  """

  schema: Schema
  config: DiLoCo
  plan: tuple[tuple[str, ...], ...]
  auth: dict[str, str] | None = None
  created_at: str = ""
  keep_versions: int | None = None
  # The fields as stored (with the signature), which the signature is checked over.
  stored: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

  @classmethod
  def new(cls, schema: Schema, config: DiLoCo, key: bytes | None,
          keep_versions: int | None = None) -> Self:
    manifest = cls(
        schema=stored_schema(Schema(schema.parameters), config),
        config=config,
        plan=tuple(tuple(names) for names in config.plan(schema)),
        auth=None if key is None else signing.new_auth(key),
        created_at=utc_now(),
        keep_versions=keep_versions,
    )
    record = manifest.to_json()
    if key is not None:
      # Signed over the JSON as it will be parsed back, so readers check the same bytes.
      record = json.loads(json.dumps(record))
      record[signing.SIGNATURE] = signing.sign_record(key, record)
    return dataclasses.replace(manifest, stored=record)

  def to_json(self) -> dict[str, Any]:
    if self.stored is not None:
      return dict(self.stored)
    return {
        "format": layout.FORMAT,
        "schema": self.schema.to_json(),
        "algorithm": self.config.to_json(),
        "plan": [list(names) for names in self.plan],
        "auth": self.auth,
        "created_at": self.created_at,
        "keep_versions": self.keep_versions,
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
      if record.get("auth") is not None and not isinstance(record["auth"], dict):
        raise CorruptRecord(f"manifest auth is {type(record['auth']).__name__}, not an object")
      config = DiLoCo.from_json(record["algorithm"])
      return cls(
          schema=stored_schema(Schema.from_json(record["schema"]), config),
          config=config,
          plan=tuple(tuple(str(n) for n in names) for names in record["plan"]),
          auth=record.get("auth"),
          created_at=str(record.get("created_at", "")),
          keep_versions=_keep_versions(record),
          stored=record,
      )
    except CorruptRecord:
      raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
      # RecursionError: JSON nested past the parser's depth (a hostile manifest).
      raise CorruptRecord(f"manifest.json does not parse: {quote(repr(error))}") from None

  def same_run(self, other: Manifest, key: bytes | None) -> list[str]:
    """What differs between this stored manifest and a new one keyed with ``key``, each
    with the stored and the given value (the first leaf that differs, for the schema)."""
    differences = []
    if self.schema != other.schema:
      stored = {p.name: p for p in self.schema.parameters}
      given = {p.name: p for p in other.schema.parameters}
      names = sorted(n for n in stored.keys() | given.keys() if stored.get(n) != given.get(n))
      show = lambda p: "absent" if p is None else f"{p.dtype}{list(p.shape)}"
      differences.append("schema" + (f" (leaf {names[0]!r}: stored {show(stored.get(names[0]))},"
                                     f" given {show(given.get(names[0]))})" if names else ""))
    if self.config != other.config:
      fields = [f.name for f in dataclasses.fields(self.config)
                if getattr(self.config, f.name) != getattr(other.config, f.name)]
      differences.append("algorithm (" + "; ".join(
          f"{f}: stored {getattr(self.config, f)!r}, given {getattr(other.config, f)!r}"
          for f in fields) + ")")
    if self.plan != other.plan:
      differences.append("plan")
    if self.keep_versions != other.keep_versions:
      differences.append(f"keep_versions (stored {self.keep_versions!r}, given"
                         f" {other.keep_versions!r})")
    if (self.auth is None) != (key is None) or (
        key is not None and not self.key_matches(key)):
      differences.append("key")
    return differences

  def check_key(self, key: bytes | None, url: str) -> None:
    """Raises AuthenticationError unless ``key`` is the run's key (or both are absent)."""
    if self.auth is None:
      if key is not None:
        raise AuthenticationError(
            f"run {url!r} was created without a key, but key= was given; open it"
            " without key=.", key="unexpected")
      return
    if key is None:
      raise AuthenticationError(
          f"run {url!r} is signed with"
          f" {self.auth.get('scheme') if isinstance(self.auth, dict) else 'a key'};"
          " pass its key with key=.", key="missing")
    if not self.key_matches(key):
      raise AuthenticationError(f"key= is not the key of run {url!r}.", key="wrong")
    self.check_signature(key, url)

  def key_matches(self, key: bytes) -> bool:
    """Whether this keyed manifest's auth check accepts ``key``."""
    return isinstance(self.auth, dict) and "salt" in self.auth and signing.key_matches(
        self.auth, key)

  def check_signature(self, key: bytes, url: str) -> None:
    """Raises AuthenticationError unless the stored fields verify under ``key``."""
    stored = self.stored if self.stored is not None else self.to_json()
    if signing.SIGNATURE not in stored:
      raise AuthenticationError(
          f"the manifest of keyed run {url!r} carries no signature: it was edited (or"
          " written by a gmjax that did not sign manifests); recreate the run.")
    if not signing.record_signature_ok(key, stored):
      raise AuthenticationError(
          f"the manifest of run {url!r} does not match its signature: it was edited"
          " after the run was created (schema, algorithm, plan or another field);"
          " restore it or recreate the run.")

  @property
  def schedule(self):
    return self.config.schedule(len(self.plan))


def read_manifest(store: Store, url: str) -> Manifest:
  """The manifest of the run at ``url`` (``store``); ``RunNotFound`` if it has none."""
  try:
    data = store.read(layout.MANIFEST, MAX_MANIFEST_BYTES)
  except FileNotFoundError:
    problem = store.bucket_problem()
    if problem:
      raise RunNotFound(f"no run at {url!r}: {problem}.") from None
    raise RunNotFound(
        f"no run at {url!r} (no {layout.MANIFEST}); create one with"
        " gmjax.mail.create(url, params, config).") from None
  except BadObject as error:  # planted: a huge object, a FIFO, a folder
    raise CorruptRecord(f"{layout.MANIFEST} of run {url!r} {error.reason}") from None
  return Manifest.loads(data)


def _keep_versions(record: dict[str, Any]) -> int | None:
  """The stored ``keep_versions``: absent (an older manifest) keeps every version."""
  from gmjax.mail import retention  # pylint: disable=g-import-not-at-top

  try:
    return retention.check_keep_versions(record.get("keep_versions"))
  except (TypeError, ValueError) as error:
    raise CorruptRecord(f"manifest keep_versions: {error}") from error


def utc_now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
