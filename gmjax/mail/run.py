"""A run: its manifest and records on storage, ``create``/``open``, and what it reports.

``create`` returns the ``Run``; its checks and writes (``manifest.json`` exclusively, then
version 0 of every fragment) are ``gmjax.mail.run_create``'s, which imports nothing from
here. Creating again with the same schema, configuration, plan and key opens the
existing run (its version 0 stands); anything else raises ``RunExists``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from gmjax.core import guards
from gmjax.core.diloco import DiLoCo
from gmjax.core.schema import Schema
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import run_create
from gmjax.mail import signing
from gmjax.mail import states
from gmjax.mail.commits import NOT_SIGNED, DamagedCommit, commit_slots
from gmjax.mail.errors import AuthenticationError, CorruptRecord, RunNotFound
from gmjax.mail.manifest import Manifest, read_manifest
from gmjax.mail.heartbeats import Heartbeat
from gmjax.mail.records import RoundRecord
from gmjax.mail.store import Store, open_store


class Run:
  """A run on storage. Use ``gmjax.mail.create`` or ``gmjax.mail.open`` to get one.

  Attributes:
    url: where the run lives.
    store: its storage.
    manifest: schema, configuration, plan and auth.
    key: the HMAC key (bytes) or None.
    signing_key: the key this run's objects are signed with (``signing.run_key``: the
      key bound to the run's salt), or None.
  """

  def __init__(self, url: str, store: Store, manifest: Manifest, key: bytes | None):
    self.url = url
    self.store = store
    self.manifest = manifest
    self.key = key
    self.signing_key = signing.run_key(key, manifest.auth)

  @property
  def config(self) -> DiLoCo:
    return self.manifest.config

  @property
  def schema(self) -> Schema:
    return self.manifest.schema

  @property
  def plan(self) -> tuple[tuple[str, ...], ...]:
    return self.manifest.plan

  def join(self, name: str, *, poll_interval: float = 0.05,
           wait_timeout: float | None = None, startup_timeout: float = 60.0,
           process_index: int | None = None, process_count: int | None = None,
           state_dir: Any = None):
    """Joins the run as learner ``name``.

    Args:
      name: ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``, unique among the run's live learners.
      poll_interval: seconds between storage polls; also sets the run's timeout floor
        (``30·poll_interval``).
      wait_timeout: the longest a ``step`` waits for a commit before raising
        ``RoundTimeout``; None is ``max(120 s, 10·timeout)``.
      startup_timeout: how long transient storage errors are retried until the
        learner's first round commits (the run's timeout is only a few polls then);
        afterwards the run's timeout bounds them. It is also how long this learner,
        as a closer, waits past the quorum for the other live learners in the rounds
        before the run's first commit (round 0): a learner that joined but is slow to
        start is waited for, not left out.
      process_index: this process's index in a multi-process JAX job that is one
        learner (default ``jax.process_index()``): process 0 claims the name, beats,
        publishes and closes rounds; every process reads the commits and gets Θ.
      process_count: the job's number of processes (default ``jax.process_count()``).
      state_dir: None, or the learner's own directory (local path or ``gs://``) where it
        keeps the state handed to ``step(..., state=, position=)`` at each commit it
        applies (``gmjax.mail.learner_state``); after ``pull``, ``restore`` gets it back.

    Returns:
      A ``Learner``: call ``pull(params)`` first.

    Raises:
      ValueError/TypeError: a bad name, poll interval (positive, finite seconds),
        timeout (positive seconds), process index or count (the JAX job's), or state_dir.
      NameTaken: a live learner of the run has this name.
      StateDirMismatch: ``state_dir`` holds another run's or another learner's state.

    Example:
      >>> import tempfile
      >>> import numpy as np
      >>> import gmjax
      >>> params = {"w": np.ones((4, 2), np.float32)}
      >>> run = gmjax.mail.create(tempfile.mkdtemp(), params, gmjax.DiLoCo(sync_every=2))
      >>> learner = run.join("worker-0", poll_interval=0.01)
      >>> params = learner.pull(params)  # the newest committed parameters
      >>> for _ in range(4):
      ...   params = learner.step({"w": params["w"] - 0.1}, tokens=8)  # publishes every 2
      >>> params = learner.close(params)
      >>> [(r.round, r.version) for r in run.rounds()]
      [(0, 1), (1, 2)]
    """
    from gmjax.mail.learner import Learner  # pylint: disable=g-import-not-at-top

    layout.check_name(name)
    if self.key is not None:
      # The manifest may have changed on storage since this run was opened.
      stored = read_manifest(self.store, self.url)
      stored.check_key(self.key, self.url)
      if stored != self.manifest:
        raise AuthenticationError(
            f"the manifest of run {self.url!r} changed since it was opened; open the"
            " run again.")
    return Learner(self, name, poll_interval=poll_interval, wait_timeout=wait_timeout,
                   startup_timeout=startup_timeout, process_index=process_index,
                   process_count=process_count, state_dir=state_dir)

  def newest_versions(self) -> dict[int, int]:
    """The newest committed version of each fragment."""
    newest = {}
    for fragment in range(len(self.plan)):
      versions = states.committed_versions(self.store, fragment)
      if not versions:
        raise RunNotFound(f"run {self.url!r} has no version 0 of fragment {fragment};"
                          " it was not created completely: create it again.")
      # The newest version with an intact record; a version whose records are all
      # damaged counts as not committed (its round is closed again, see recovery).
      for version in reversed(versions):
        if states.is_committed(self.store, fragment, version, self.signing_key):
          newest[fragment] = version
          break
      else:
        raise CorruptRecord(f"run {self.url!r}: every commit of fragment {fragment} is"
                            " damaged; create the run again.")
    return newest

  def start_step(self, newest: dict[int, int] | None = None) -> int:
    """The global step a learner that joins now starts at (``newest``: the newest
    committed versions, read if None): the newest committed round's, or the step before
    the first round not committed if that comes before it, so that the learner
    contributes to that round and the run closes it. A round whose every record was
    damaged or deleted after a newer round committed would otherwise never be closed
    again: learners that joined after it waited for its version until they timed out.
    """
    newest = self.newest_versions() if newest is None else newest
    step = max((self.commit_step(f, v) for f, v in newest.items()), default=0)
    first_open = min(v * len(self.plan) + f for f, v in newest.items())
    return min(step, self.manifest.schedule.step_of(first_open) - 1)

  def commit_step(self, fragment: int, version: int) -> int:
    """The global step of the round that committed ``version`` of ``fragment`` (0 for
    version 0), whether or not it is committed yet.

    Raises:
      TypeError: ``fragment`` or ``version`` is not an int.
      ValueError: ``fragment`` is not one of the run's, or ``version`` is negative.
    """
    fragment, version = self._fragment_version(fragment, version)
    if version == 0:
      return 0
    return self.manifest.schedule.step_of((version - 1) * len(self.plan) + fragment)

  def commit(self, fragment: int, version: int) -> RoundRecord:
    """The verified, typed commit record of ``version`` of ``fragment`` (its signature,
    in a keyed run, stays in ``extra``).

    Raises:
      FileNotFoundError: the version is not committed, or was pruned (the message
        names the versions kept); ``DamagedCommit``: its records are all damaged.
      CorruptRecord: the record lacks a field or holds one of the wrong type.
      TypeError: ``fragment`` or ``version`` is not an int.
      ValueError: ``fragment`` is not one of the run's, or ``version`` is negative.
    """
    fragment, version = self._fragment_version(fragment, version)
    try:
      return states.read_commit(self.store, fragment, version, self.signing_key)
    except FileNotFoundError as error:
      if isinstance(error, DamagedCommit):  # there, but every record of it is damaged
        raise
      raise self._not_committed(fragment, version) from error

  def _fragment_version(self, fragment: Any, version: Any) -> tuple[int, int]:
    """``(fragment, version)`` as ints, checked against the run."""
    fragment, version = _integer("fragment", fragment), _integer("version", version)
    if not 0 <= fragment < len(self.plan):
      raise ValueError(
          f"fragment={fragment} is not a fragment of run {self.url!r}: it has"
          f" {len(self.plan)} fragment(s), 0 to {len(self.plan) - 1}.")
    if version < 0:
      raise ValueError(f"version={version} is not a version: versions are non-negative"
                       " ints, from 0 (the run's start).")
    return fragment, version

  def _not_committed(self, fragment: int, version: int) -> FileNotFoundError:
    """The error for a ``version`` of ``fragment`` not on storage, naming those kept."""
    versions = states.committed_versions(self.store, fragment)
    kept = (f"{versions[0]} to {versions[-1]}" if len(versions) > 1
            else str(versions[0]) if versions else "none")
    if versions and version < versions[0]:
      why = (f"versions below {versions[0]} were pruned (keep_versions="
             f"{self.manifest.keep_versions})")
    else:
      why = f"the newest is {versions[-1] if versions else None}"
    return FileNotFoundError(
        f"run {self.url!r}: version {version} of fragment {fragment} is not committed"
        f" (versions on storage: {kept}; {why}); ask for one of those, e.g. the"
        f" newest, run.newest_versions()[{fragment}].")

  def rounds(self) -> list[RoundRecord]:
    """The committed rounds' typed records (``gmjax.mail.RoundRecord``, without their
    signatures; ``to_json()`` gives the JSON), ordered by round (version 0 is not a
    round).

    Raises:
      CorruptRecord: a commit record does not parse or lacks a field.
    """
    records = []
    for fragment in range(len(self.plan)):
      for version in states.committed_versions(self.store, fragment):
        if version > 0:
          try:
            record = states.read_commit(self.store, fragment, version, self.signing_key)
          except FileNotFoundError:
            continue  # damaged (logged): not a committed round until superseded
          if signing.SIGNATURE in record.extra:
            record = dataclasses.replace(record, extra={
                k: v for k, v in record.extra.items() if k != signing.SIGNATURE})
          records.append(record)
    return sorted(records, key=lambda r: r.round)

  def learners(self) -> dict[str, Heartbeat]:
    """Every learner's latest valid heartbeat (``gmjax.mail.Heartbeat``; ``to_json()``
    gives the JSON), by name."""
    return {name: Heartbeat.from_json(record) for name, record in
            heartbeats.read_all(self.store, self.signing_key).items()}

  def status(self) -> dict[str, Any]:
    """A summary: fragments and their versions, rounds, estimates and learners (each
    with its heartbeat's fields and its pace: ``gmjax.mail.status.pace``).

    ``rounds`` counts the rounds committed (each fragment's versions from 1 to its
    newest), ``rounds_kept`` those whose records storage still holds (``keep_versions``
    prunes the oldest).
    """
    rounds = self.rounds()
    versions = self.newest_versions()
    estimates = rounds[-1].estimates.to_json() if rounds else {}
    from gmjax.core.schedule import Estimates  # pylint: disable=g-import-not-at-top
    from gmjax.mail.status import learner_rows  # pylint: disable=g-import-not-at-top

    timeout = Estimates.from_json(estimates).timeout(0.0) or None
    found = heartbeats.scan(self.store, self.signing_key)
    learners = learner_rows(found.records, self.store.list_dated("learners"), rounds,
                            len(self.plan), timeout)
    schedule = self.manifest.schedule
    return {
        "run": self.url,
        "format": layout.FORMAT,
        "created_at": self.manifest.created_at,
        "parameters": sum(p.size for p in self.schema.parameters),
        "leaves": len(self.schema.parameters),
        "fragments": len(self.plan),
        "sync_every": schedule.sync_every,
        "signed": self.manifest.auth is not None,
        "keep_versions": self.manifest.keep_versions,
        "versions": versions,
        "rounds": sum(versions.values()),
        "rounds_kept": len(rounds),
        "latest_round": rounds[-1].round if rounds else None,
        "latest_step": rounds[-1].step if rounds else 0,
        "estimates": estimates,
        "timeout_seconds": timeout,
        "learners": learners,
        "bad_heartbeats": [{"learner": n, "reason": r} for n, r in sorted(found.bad.items())],
    }

  def __repr__(self) -> str:
    return f"Run({self.url!r}, fragments={len(self.plan)})"


def _integer(argument: str, value: Any) -> int:
  """``value`` as an int (numpy integers included); a TypeError naming ``argument``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{argument} must be an int, got {type(value).__name__}"
                    f" {guards.quote(value)}.")
  return int(value)


def create(url: str, params: Any, config: DiLoCo, *, key: bytes | str | None = None,
           keep_versions: int | None = 4,
           storage_options: dict[str, Any] | None = None,
           retry_seconds: float = 30.0) -> Run:
  """Creates a run at ``url`` whose version 0 is ``params``.

  Args:
    url: a directory, ``memory://name``, ``gs://bucket/prefix`` or another fsspec URL.
    params: the initial parameters, a pytree of F32/F16/BF16 arrays (float64 is taken
      as F32), each with at least one element.
    config: a ``gmjax.DiLoCo``.
    key: an HMAC-SHA256 key (bytes or str): contributions and commits are signed with it
      and unsigned ones are rejected. Every learner opens the run with the same key.
    keep_versions: how many of each fragment's newest versions stay on storage (at
      least 2); older states, Θ, updates, records and the rounds that closed them are
      deleted after each commit (``gmjax.mail.retention``). None keeps every version.
      Stored in the manifest.
    storage_options: options for the fsspec filesystem.
    retry_seconds: how long the creation's storage calls, and the run's reads after,
      retry a storage that does not answer (as ``open``'s).

  Returns:
    The run (the existing one if a run with the same configuration is there).

  Raises:
    RunExists: a run with another schema, configuration, plan or key is at ``url``.
    TypeError: ``config`` is not a ``gmjax.DiLoCo``, or ``keep_versions`` is not an
      int or None.
    ValueError: ``config`` does not fit ``params`` (``DiLoCo.check_parameters``), its
      ``outer`` is ``"custom"`` (learners build the outer step from the config),
      ``keep_versions`` is below 2, or a leaf of ``params`` has no elements or holds
      a NaN or Inf (refused before anything is written).
    ImportError: a ``gs://`` or ``s3://`` URL without gcsfs or s3fs installed (the
      message names the extra: ``pip install 'gmjax[gcs]'``, ``'gmjax[s3]'``).

  Example:
    >>> import tempfile
    >>> import numpy as np
    >>> import gmjax
    >>> params = {"w": np.ones((4, 2), np.float32), "b": np.zeros(2, np.float32)}
    >>> config = gmjax.DiLoCo(sync_every=4, fragments=2)
    >>> url = tempfile.mkdtemp()  # or "memory://exp1", "gs://bucket/runs/exp1"
    >>> run = gmjax.mail.create(url, params, config)
    >>> run.plan, run.rounds()  # version 0 of each fragment is committed; no rounds yet
    ((('b',), ('w',)), [])
    >>> gmjax.mail.create(url, params, config).plan  # the same run again: it is opened
    (('b',), ('w',))
  """
  created = run_create.write_run(url, params, config, key=key, keep_versions=keep_versions,
                                 storage_options=storage_options,
                                 retry_seconds=retry_seconds)
  return Run(created.store.url, created.store, created.manifest, created.key)  # str, a Path too


def open(url: str, *, key: bytes | str | None = None,  # pylint: disable=redefined-builtin
         storage_options: dict[str, Any] | None = None,
         retry_seconds: float = 30.0) -> Run:
  """Opens the run at ``url``.

  Args:
    url: the run's URL.
    key: the run's signing key, if it has one.
    storage_options: passed to the fsspec filesystem.
    retry_seconds: how long the run's reads (``rounds()``, ``status()``, ...) retry
      transient storage errors and hung requests before ``StorageUnavailable``; a
      learner's calls retry for the run's timeout instead.

  Raises:
    RunNotFound: there is no ``manifest.json`` at ``url``.
    AuthenticationError: ``key`` is missing, wrong, or given for an unsigned run.
    StorageUnavailable: the storage did not answer within ``retry_seconds``.
  """
  key = signing.as_key(key)
  store = open_store(url, retry_seconds=retry_seconds, storage_options=storage_options)
  manifest = read_manifest(store, url)
  manifest.check_key(key, url)
  _check_manifest_signs_records(store, url, signing.run_key(key, manifest.auth))
  return Run(store.url, store, manifest, key)  # the URL as a str, for a Path too


def _check_manifest_signs_records(store: Store, url: str, signer: bytes | None) -> None:
  """Raises AuthenticationError if the records of fragment 0 are signed with the key but
  none for this manifest's run: the manifest was copied from another run with the same
  key. The versions are read newest first (the run's kept versions are its newest), up to
  the first with a record signed for the run, and none is left out: forged records
  planted at any versions, however many, cannot make a run refuse its own manifest."""
  if signer is None:
    return
  foreign = None
  for version in sorted(states.committed_versions(store, 0) or [0], reverse=True):
    problems = [problem for _, _, problem in commit_slots(store, 0, version, signer)]
    if problems and all(problem == NOT_SIGNED for problem in problems):
      foreign = version if foreign is None else foreign
    elif problems:
      return
  if foreign is not None:
    raise AuthenticationError(
        f"the manifest of run {url!r} does not sign the run's records (version {foreign}"
        " of fragment 0 is not signed for it): manifest.json was replaced, e.g. copied"
        " from another run with the same key; restore the run's own manifest.")

