"""Committed fragment states: Orbax checkpoints, update files and commit records.

A ``FragmentState`` is saved with Orbax (``PyTreeCheckpointer``) as the tree
``{"theta": {...}, "outer": {...}}`` of numpy arrays. Orbax keys are positions
(``00000``, ``00001``, ...) because leaf names contain ``/`` and ``.``; the names they stand
for are listed in the commit record (``state_names``). On a local store Orbax writes the
checkpoint straight into ``<run>/fragments/<f>/<v>-<nonce>/``; on any other fsspec URL it
writes into a local temporary directory whose files are then uploaded through the store.
The commit record lists the sha256 of every file of the checkpoint (``state_files``) and
of the update file, and nothing is restored or decoded before those digests match (each
file is hashed as it is read). No file is read past ``max_file_bytes``, a bound on the
run's honest files: an object planted in a file's place is refused before it is read.

The checkpoint is the state of record, read by closers (a takeover, a new closer).
Learners need only Θ. With a commit precision a learner holding the previous Θ reads
only the update file and rebuilds Θ, checked bit for bit against the record's
``theta_sha256``. Without one, the state's directory also holds Θ as a safetensors
payload (``<v>-<nonce>/theta.safetensors``, beside Orbax's files and not one of them),
which a learner parses (strictly, as it parses contributions) and checks against
``theta_sha256``, without Orbax and without the outer state; a missing or damaged copy
sends it to the checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gmjax.core import payload
from gmjax.core.diloco import DiLoCo
from gmjax.core.records import FragmentState
from gmjax.core.schema import Schema
from gmjax.mail import layout
from gmjax.mail.errors import CorruptRecord
from gmjax.mail.records import RoundRecord
from gmjax.mail.store import BadObject, LocalStore, Store, fsync_dir
# The commit records, here for the modules that read states and commits together.
from gmjax.mail.commits import DamagedCommit as DamagedCommit  # pylint: disable=g-bad-import-order
from gmjax.mail.commits import commit_slots as commit_slots
from gmjax.mail.commits import committed_versions as committed_versions
from gmjax.mail.commits import is_committed as is_committed
from gmjax.mail.commits import read_commit as read_commit
from gmjax.mail.commits import record_problem as record_problem
from gmjax.mail.commits import remove_orphans as remove_orphans
from gmjax.mail.commits import version_zero_gone as version_zero_gone
from gmjax.mail.commits import write_commit as write_commit

log = logging.getLogger(__name__)

# Orbax's synchronous checkpointer is not documented as thread-safe; learners that share a
# process (threads) take turns.
_ORBAX_LOCK = threading.Lock()
_CHUNK = 4 << 20


def _this_process_only():
  """Orbax options for a checkpoint this process saves or restores alone.

  Learners save and read states on their own, also when a learner is a multi-process
  JAX job (only its process 0 closes rounds): Orbax must not wait for the others.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  index = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=index, active_processes={index})


def _checkpointer():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  alone = _this_process_only()
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=alone),
                          multiprocessing_options=alone)


def _saver():
  """The checkpointer that saves states, tuned for the closer's commit latency.

  Its save is synchronous and nothing writes the state's arrays while it runs, so
  Orbax's defensive copy of every host array is skipped; and without zstd, whose CPU time
  buys little on float parameters and moments (they shrink by under a tenth). Restoring
  needs neither setting: Orbax reads them from the checkpoint's metadata.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  options = {"use_compression": False}
  try:
    options["type_handler_registry"] = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()))  # unused: states hold numpy
  except (AttributeError, TypeError) as error:  # an Orbax without the option: copy
    log.debug("Orbax keeps copying host arrays on save: %r", error)
  alone = _this_process_only()
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=alone, **options),
                          multiprocessing_options=alone)


@functools.lru_cache(maxsize=16)
def max_file_bytes(schema: Schema, config: DiLoCo) -> int:
  """The most bytes an honest file of a run's fragment states holds: twice Θ, the master
  copy and the outer optimizer's state of every parameter at 4 bytes a value or more,
  plus 64 MiB for Orbax's metadata.

  A reader of a checkpoint file, Θ or an update reads at most this many bytes: an object
  planted in its place (a huge one, on a store that lets learners write) is refused
  before it is downloaded, not read whole into memory. The bound is loose (per run, not
  per fragment or file) so that no honest file comes near it.
  """
  params = {spec.name: jax.ShapeDtypeStruct(spec.shape, jnp.float32)
            for spec in schema.parameters}
  outer_state = jax.eval_shape(config.outer_transform().init, params)
  values = [leaf.size * max(leaf.dtype.itemsize, 4) for leaf in jax.tree.leaves(outer_state)]
  values += [spec.size * max(spec.nbytes // max(spec.size, 1), 4)
             for spec in schema.parameters] * 2
  return 2 * sum(values) + (64 << 20)


def sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def theta_digest(theta: Mapping[str, Any]) -> str:
  """sha256 over Θ's names, dtypes, shapes and bytes: checks a rebuilt Θ is bit-identical."""
  digest = hashlib.sha256()
  for name in sorted(theta):
    array = np.asarray(theta[name])
    digest.update(json.dumps([name, str(array.dtype), list(array.shape)]).encode())
    # The bytes in C order, as tobytes() gives them, without copying a contiguous array.
    digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
  return digest.hexdigest()


def _tree(state: FragmentState) -> tuple[dict[str, Any], dict[str, list[str]]]:
  names = {"theta": sorted(state.theta), "outer": sorted(state.outer)}
  tree = {
      part: {f"{i:05d}": np.asarray(values[n]) for i, n in enumerate(names[part])}
      for part, values in (("theta", state.theta), ("outer", state.outer))
  }
  return tree, names


def _file_digests(directory: str) -> dict[str, str]:
  digests = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      digest = hashlib.sha256()
      with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
          digest.update(chunk)
      digests[os.path.relpath(path, directory).replace(os.sep, "/")] = digest.hexdigest()
  return dict(sorted(digests.items()))


def _fsync_tree(directory: str) -> None:
  """fsyncs every file and directory under ``directory``, then its parent: a file's
  data, and the directory entries that name it, are on disk before the commit is."""
  for root, _, files in os.walk(directory, topdown=False):
    for name in files:
      with open(os.path.join(root, name), "rb") as f:
        os.fsync(f.fileno())
    fsync_dir(root)
  fsync_dir(os.path.dirname(directory))


@dataclasses.dataclass(frozen=True)
class StoredState:
  """The files a closer (or ``create``, or a repair) wrote for one version, before its
  commit: what the commit record will name, and what ``remove_state`` deletes when the
  commit goes to another closer.

  Attributes:
    fragment: the fragment.
    version: the version the files hold.
    nonce: the suffix that keeps racing closers' files of one version apart.
    state: the Orbax checkpoint's directory (``layout.state_dir``).
    state_files: sha256 of each file of the checkpoint, by relative path.
    state_names: the parameter names behind Orbax's positional keys, per part.
    state_sha256: sha256 of ``state_files``.
    theta: the Θ file's path, or None (not written).
    update: the update file's path, or None (not written).
    update_sha256: sha256 of the update file, or None.
  """

  fragment: int
  version: int
  nonce: str
  state: str
  state_files: Mapping[str, str]
  state_names: Mapping[str, tuple[str, ...]]
  state_sha256: str
  theta: str | None = None
  update: str | None = None
  update_sha256: str | None = None


def save_state(store: Store, fragment: int, state: FragmentState, nonce: str
               ) -> StoredState:
  """Saves ``state`` durably with Orbax; returns what the commit record names of it."""
  rel = layout.state_dir(fragment, state.version, nonce)
  tree, names = _tree(state)
  if store.local_root is not None:
    # Made as the local store makes folders: a link planted on the way is not followed.
    folder, name = rel.rsplit("/", 1)
    target = os.path.join(LocalStore(store.local_root).folder(folder), name)
    with _ORBAX_LOCK:
      _saver().save(target, tree)
    _fsync_tree(target)
    files = _file_digests(target)
  else:
    with tempfile.TemporaryDirectory(prefix="gmjax-state-") as scratch:
      target = os.path.join(scratch, "state")
      with _ORBAX_LOCK:
        _saver().save(target, tree)
      files = _file_digests(target)
      for relfile in files:
        with open(os.path.join(target, *relfile.split("/")), "rb") as f:
          store.put(f"{rel}/{relfile}", f.read())
  return StoredState(
      fragment=fragment, version=state.version, nonce=nonce, state=rel, state_files=files,
      state_names={part: tuple(n) for part, n in names.items()},
      state_sha256=sha256(json.dumps(files, sort_keys=True).encode()))


def load_state(store: Store, record: RoundRecord, max_bytes: int) -> FragmentState:
  """The state a commit record names, after checking every file against its sha256.

  Args:
    store: the run's store.
    record: the commit record.
    max_bytes: the most bytes a file may hold (``max_file_bytes``).

  Raises:
    CorruptRecord: a file is missing, larger than ``max_bytes``, not a regular file, or
      its sha256 differs from the record's.
  """
  rel, files = record.state, dict(record.state_files)
  if sha256(json.dumps(files, sort_keys=True).encode()) != record.state_sha256:
    raise CorruptRecord(f"commit of {rel}: state_files do not match state_sha256")
  # Restored from a private copy of the verified bytes, on a local store too: Orbax,
  # restoring the run's own folder, would read files the record does not list, and files
  # changed between the check and the restore.
  with tempfile.TemporaryDirectory(prefix="gmjax-state-") as scratch:
    target = os.path.join(scratch, "state")
    for relfile, digest in files.items():
      data = _verified_file(store, rel, relfile, digest, max_bytes)
      path = os.path.join(target, *relfile.split("/"))
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "wb") as f:
        f.write(data)
    with _ORBAX_LOCK:
      tree = _checkpointer().restore(target)
  return _state_from_tree(tree, record)


def _verified_file(store: Store, rel: str, relfile: str, digest: str, max_bytes: int
                   ) -> bytes:
  try:
    return store.get_verified(f"{rel}/{relfile}", digest, max_bytes)
  except FileNotFoundError as error:
    raise CorruptRecord(f"state file {rel}/{relfile} named by a commit is missing") from error
  except BadObject as error:  # a FIFO, a link, a folder or a huge object planted there
    raise CorruptRecord(f"state file {rel}/{relfile}: {error}") from error
  except CorruptRecord as error:
    raise CorruptRecord(f"state file {rel}/{relfile} does not match its sha256") from error


def _state_from_tree(tree: Mapping[str, Any], record: RoundRecord) -> FragmentState:
  rel = record.state
  names = record.state_names
  parts = {}
  for part in ("theta", "outer"):
    if part not in names:
      raise CorruptRecord(f"state {rel}: the record's state_names lack {part!r}")
    values = tree.get(part, {}) or {}
    if len(values) != len(names[part]):
      raise CorruptRecord(f"state {rel}: {part} holds {len(values)} arrays, the record names"
                          f" {len(names[part])}")
    parts[part] = {n: np.asarray(values[f"{i:05d}"]) for i, n in enumerate(names[part])}
  return FragmentState(record.version, parts["theta"], parts["outer"])


def save_theta(store: Store, stored: StoredState, theta: Mapping[str, Any]) -> StoredState:
  """Writes Θ of ``stored``'s version beside its checkpoint; returns ``stored`` naming it.

  Not synced to disk: Θ is a copy of the checkpoint's, checked against the record's
  ``theta_sha256`` when read, and read from the checkpoint if it was lost.
  """
  rel = layout.theta_file(stored.fragment, stored.version, stored.nonce)
  store.put(rel, payload.dumps(theta, {"fragment": stored.fragment,
                                       "version": stored.version}), durable=False)
  return dataclasses.replace(stored, theta=rel)


def load_theta(store: Store, record: RoundRecord, max_bytes: int) -> dict[str, np.ndarray]:
  """Θ of the version a commit record names, verified, without the outer state when it
  can: from the record's Θ file, else (no such file, or it does not verify) restored from
  the checkpoint. Either way it must match the record's ``theta_sha256``.

  Args:
    store: the run's store.
    record: the commit record.
    max_bytes: the most bytes a file may hold (``max_file_bytes``).

  Returns:
    Θ by parameter name.

  Raises:
    CorruptRecord: the checkpoint is missing, corrupt, or its Θ differs from the record's.
  """
  rel = record.theta
  if rel:
    try:
      entries, _ = payload.loads(store.read(rel, max_bytes))
      names = record.state_names.get("theta")
      if names is not None and sorted(entries) == sorted(names) and theta_digest(
          entries) == record.theta_sha256:
        return entries
      log.warning("Θ file %s does not match its commit's theta_sha256; reading the"
                  " checkpoint instead", rel)
    except (FileNotFoundError, BadObject, payload.PayloadError) as error:
      log.warning("Θ file %s is unreadable (%r); reading the checkpoint instead", rel, error)
  state = load_state(store, record, max_bytes)
  if theta_digest(state.theta) != record.theta_sha256:
    raise CorruptRecord(f"state {record.state} does not match the commit's theta_sha256")
  return dict(state.theta)


def save_update(store: Store, stored: StoredState, update: Mapping[str, Any]
                ) -> StoredState:
  """Writes the update that made ``stored``'s version, durably; returns ``stored``
  naming it and its sha256."""
  rel = layout.update_file(stored.fragment, stored.version, stored.nonce)
  data = payload.dumps(update, {"fragment": stored.fragment, "version": stored.version})
  store.put(rel, data)
  return dataclasses.replace(stored, update=rel, update_sha256=sha256(data))


def load_update(store: Store, record: RoundRecord, max_bytes: int
                ) -> dict[str, np.ndarray]:
  """The update a commit record names, verified against its sha256.

  Raises:
    FileNotFoundError: the record names no update, or its file is missing.
    CorruptRecord: the file does not match the record's sha256, holds more than
      ``max_bytes`` (``max_file_bytes``) or is not a regular file.
  """
  if record.update is None:
    raise FileNotFoundError(f"the commit of {record.state} names no update file")
  try:
    data = store.get_verified(record.update, record.update_sha256 or "", max_bytes)
  except BadObject as error:
    raise CorruptRecord(f"update file {record.update}: {error}") from error
  entries, _ = payload.loads(data)
  return entries


def remove_state(store: Store, stored: StoredState) -> None:
  """Deletes the files of a state, Θ and update that lost the commit race."""
  for rel in (stored.state, stored.theta, stored.update):
    if rel:
      store.delete(rel)
