"""Creating a run on storage: ``create``'s checks, its manifest and version 0.

``gmjax.mail.create`` (in ``gmjax.mail.run``, next to the ``Run`` it returns) documents
the call and hands the work to ``write_run``, which lives here, apart from the run's
reading side, and imports nothing from ``gmjax.mail.run``.

``write_run`` refuses bad arguments before anything is written, then writes
``manifest.json`` exclusively, then version 0 of every fragment: the creator's
parameters (``DiLoCo.initial_state``: Θ at the schema dtype, zero momentum, an F32
master where one is kept) saved with Orbax like any version and committed by an
exclusive ``0.commit.json`` whose ``round`` is null. Creating again with the same
schema, configuration, plan and key opens the existing run (its version 0 stands);
anything else raises ``RunExists``.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, NamedTuple

import jax
import numpy as np

from gmjax.core.aggregator import DiLoCoAggregator
from gmjax.core.diloco import CUSTOM, DiLoCo
from gmjax.core.schedule import Estimates
from gmjax.core.schema import Schema
from gmjax.mail import layout
from gmjax.mail import retention
from gmjax.mail import signing
from gmjax.mail import states
from gmjax.mail.errors import RunExists
from gmjax.mail.manifest import Manifest, read_manifest, utc_now
from gmjax.mail.records import RoundRecord
from gmjax.mail.store import Store, open_store


class Created(NamedTuple):
  """The run ``write_run`` created, or found the same at its URL."""
  store: Store
  manifest: Manifest
  key: bytes | None


def write_run(url: str, params: Any, config: DiLoCo, *, key: bytes | str | None,
              keep_versions: int | None, storage_options: dict[str, Any] | None,
              retry_seconds: float = 30.0) -> Created:
  """Checks ``create``'s arguments and writes the run at ``url`` (its manifest and
  version 0 of every fragment), or finds the same run there.

  The arguments and the errors are ``gmjax.mail.create``'s (``gmjax.mail.run``).
  """
  if not isinstance(config, DiLoCo):
    raise TypeError(f"config must be a gmjax.DiLoCo, got {type(config).__name__}.")
  if config.outer == CUSTOM:
    raise ValueError(
        f"gmjax.mail.create: config.outer={CUSTOM!r} means the outer optimizer is given in"
        " code, but every learner and closer of a mail run builds the outer step from the"
        " configuration in the run's manifest; name an optax optimizer in config.outer"
        " (e.g. dataclasses.replace(config, outer='sgd'), or 'adam' with outer_options).")
  keep_versions = retention.check_keep_versions(keep_versions)
  key = signing.as_key(key)
  store = open_store(url, storage_options=storage_options, retry_seconds=retry_seconds)
  _check_folder(url, store.local_root)
  schema = config.cut(Schema.from_tree(params))
  config.check_parameters(schema)
  empty = [p for p in schema.parameters if p.size == 0]
  if empty:
    # Orbax, which stores every state, refuses arrays without elements; refuse them
    # here, before the manifest is written, rather than leave a half-created run.
    raise ValueError(
        f"gmjax.mail.create: params leaf {empty[0].name!r} has shape {empty[0].shape}, no"
        f" elements ({len(empty)} such leaf(s)); a run cannot store an empty array: leave"
        " it out of the parameters the run trains.")
  for name, leaf in Schema.from_tree(params).flatten(params).items():
    bad = int(np.size(leaf) - np.count_nonzero(np.isfinite(np.asarray(leaf, np.float32))))
    if bad:
      # Θ at version 0 would hold them, and so would every learner's first delta.
      raise ValueError(
          f"gmjax.mail.create: params leaf {name!r} holds {bad} NaN or Inf value(s); a"
          " run starts from finite parameters: initialize them again (or replace the"
          " non-finite values) before create.")
  manifest = Manifest.new(schema, config, key, keep_versions)
  if not store.create(layout.MANIFEST, manifest.dumps()):
    existing = read_manifest(store, url)
    if key is not None and existing.key_matches(key):
      existing.check_signature(key, url)
    differences = existing.same_run(manifest, key)
    if differences:
      raise RunExists(
          f"a run with another {', '.join(differences)} exists at {url!r}; open it with"
          " gmjax.mail.open(url) or create the new run at another URL.")
    manifest = existing
  flat = {n: jax.device_get(v) for n, v in schema.flatten(params).items()}
  for fragment, names in enumerate(manifest.plan):
    if states.committed_versions(store, fragment):
      continue
    state = DiLoCoAggregator(config, schema.subset(names)).initial_state(flat)
    nonce = uuid.uuid4().hex[:12]
    files = states.save_state(store, fragment, state, nonce)
    files = states.save_theta(store, files, state.theta)
    record = RoundRecord(
        round=None, fragment=fragment, version=0, step=0, participants=(), rejected=(),
        final=(), outer_step=False, cosine=None, estimates=Estimates(), live=(),
        closer="create", state=files.state, update=None, theta=files.theta,
        state_sha256=files.state_sha256, update_sha256=None,
        state_files=files.state_files, state_names=files.state_names,
        theta_sha256=states.theta_digest(state.theta), committed_at=utc_now())
    if not states.write_commit(store, record, signing.run_key(key, manifest.auth)):
      states.remove_state(store, files)
  return Created(store, manifest, key)


def _check_folder(url: str, root: str | None) -> None:
  """Raises a ValueError if the local folder ``root`` of a run (None: not local) is a
  file or lies under one (the run could then be neither written nor found)."""
  path = root
  while path:
    if os.path.lexists(path) and not os.path.isdir(path):
      raise ValueError(
          f"gmjax.mail.create: url {url!r}: {path} is a file; pass a folder for the run"
          " (made if missing), e.g. a new path beside it.")
    parent = os.path.dirname(path)
    path = None if parent == path else parent
