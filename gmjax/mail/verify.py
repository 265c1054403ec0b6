"""``gmjax status RUN --verify``: re-read a whole run and list everything wrong with it.

``verify`` checks the manifest (and its signature with a key), every heartbeat (and its
signature with a key: one copied from another run fails), and for
each fragment: that versions run from 0 without a gap, that each version has exactly
one record in force (damaged records superseded by a later slot are fine, see
``recovery``), each record's fields against the schedule, and the sha256 of every file
it names: the checkpoint's files, the update, and Θ (its copy and the checkpoint's).

In a run that keeps only its newest ``keep_versions`` (``gmjax.mail.retention``) the
versions run without a gap from the oldest kept one instead of 0; versions older than
the newest ``keep_versions`` are pruned, not missing, and a record of one that a prune
has not reached yet is checked but not its files (they may be deleted first).
"""

from __future__ import annotations

import math
from typing import Any

from gmjax.core import guards, payload
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import retention
from gmjax.mail import states
from gmjax.mail.errors import AuthenticationError, CorruptRecord, RunNotFound
from gmjax.mail.records import RoundRecord
from gmjax.mail.store import BadObject


def verify(url: Any, key: bytes | str | None = None, *,
           storage_options: dict[str, Any] | None = None, deep: bool = True) -> list[str]:
  """Everything wrong with the run at ``url``; an empty list for a healthy run.

  Args:
    url: the run's URL, or a ``gmjax.mail.Run``.
    key: the run's key, to check signatures (None for an unkeyed run).
    storage_options: options for the fsspec filesystem.
    deep: False checks the records and only the newest version's files of each fragment
      (what plain ``gmjax status`` shows); True reads every file of every version.

  Returns:
    One line per problem, naming the record and what is wrong.

  Raises:
    TypeError: ``deep`` is not a bool.
  """
  from gmjax.mail import run as run_lib  # pylint: disable=g-import-not-at-top

  if not isinstance(deep, bool):  # "no" would be true
    raise TypeError(f"gmjax.mail.verify: deep={guards.quote(deep)} must be a bool (False"
                    " checks the records and each fragment's newest files, True every file).")
  if isinstance(url, run_lib.Run):
    run = url
  else:
    try:
      run = run_lib.open(url, key=key, storage_options=storage_options)
    except (RunNotFound, AuthenticationError, CorruptRecord) as error:
      return [f"{layout.MANIFEST}: {error}"]
  problems = _heartbeats(run)
  for fragment in range(len(run.plan)):
    problems += _fragment(run, fragment, deep)
  return problems


def _heartbeats(run) -> list[str]:
  problems = []
  for entry in run.store.list("learners"):
    path = f"learners/{entry}"
    try:
      data = run.store.read(path, heartbeats.MAX_HEARTBEAT_BYTES)
    except FileNotFoundError:
      continue  # gone since the listing (or, on object stores, a prefix: claims)
    except BadObject as error:  # a link, a FIFO, a huge object: planted
      if not (entry.endswith(".claims") and error.reason.startswith("is not a regular")
              and _a_folder(run, path)):
        problems.append(f"{path}: {error.reason}")
      continue
    if not entry.endswith(".json"):
      problems.append(f"{path}: not a heartbeat (no .json name)")
      continue
    try:  # every field as readers check it: one they would ignore is named here
      heartbeats.parse(entry[:-len(".json")], data, run.signing_key)
    except heartbeats.BadHeartbeat as error:
      problems.append(f"{path}: {error.reason}")
  return problems


def _a_folder(run, path: str) -> bool:
  """Whether ``path``, no regular file, is a folder the store made (a name's claims)
  rather than a link or a FIFO planted there: getting a folder finds no object."""
  try:
    run.store.get(path)
  except FileNotFoundError:
    return True
  except BadObject:
    return False
  return False


def _fragment(run, fragment: int, deep: bool) -> list[str]:
  problems = []
  versions = states.committed_versions(run.store, fragment)
  if not versions:
    return [f"fragments/{fragment}: no version 0"]
  keep = run.manifest.keep_versions
  oldest = 0 if keep is None else versions[0]
  pruned_below = retention.floor(versions[-1], keep)
  if oldest > pruned_below:
    problems.append(f"fragments/{fragment}: versions below {oldest} are gone, but the run"
                    f" keeps its newest {keep} (from {pruned_below})")
  # The gaps between the versions found, as spans: a planted version 10**12 is one
  # span, not a set of a trillion numbers.
  missing, expected = [], oldest
  for version in versions:
    if version > expected:
      missing.append(str(expected) if version == expected + 1 else
                     f"{expected}-{version - 1}")
    expected = max(expected, version + 1)
  if missing:
    problems.append(f"fragments/{fragment}: versions [{', '.join(missing)}] have no commit"
                    " record")
  for version in versions:
    record, found = _record_in_force(run, fragment, version)
    problems += found
    if record is None:
      continue
    problems += _fields(run, fragment, version, record)
    if (deep or version == versions[-1]) and version >= pruned_below:
      damaged = _files(run, record, layout.commit(fragment, version))
      if damaged and _pruned_since(run, fragment, version):
        continue  # pruned while it was read: a live run moved on, nothing is damaged
      problems += damaged
  return problems


def _pruned_since(run, fragment: int, version: int) -> bool:
  """Whether ``version``, kept when the versions were listed, is pruned now: its
  records gone, or a newer intact commit put it below the kept versions (a prune deletes
  a version's files first and its records last, so files go missing while the record
  still reads)."""
  keep = run.manifest.keep_versions
  if keep is None:
    return False
  if not states.commit_slots(run.store, fragment, version, run.signing_key):
    return True
  newest = retention.newest_record(run.store, fragment, run.signing_key, above=version)
  return newest is not None and version < retention.floor(newest.version, keep)


def _record_in_force(run, fragment: int, version: int) -> tuple[dict | None, list[str]]:
  slots = states.commit_slots(run.store, fragment, version, run.signing_key)
  intact = [(path, record) for path, record, _ in slots if record is not None]
  if not intact:
    return None, [f"{path}: {problem}" for path, _, problem in slots]
  last_path, last = intact[-1]
  superseded = set(last.get("supersedes") or [])
  problems, after = [], False
  for path, record, problem in slots:
    if path == last_path:
      after = True
    elif after:  # a writer creates a slot only past damaged ones: none follows the record
      problems.append(f"{path}: {problem}, after the record in force {last_path}")
    elif path not in superseded:
      problems.append(f"{path}: {problem or 'a second commit of the version'}, not"
                      f" superseded by {last_path}")
  return last, problems


def _fields(run, fragment: int, version: int, record: dict[str, Any]) -> list[str]:
  where = layout.commit(fragment, version)
  problems = []
  if version > 0:
    round_ = (version - 1) * len(run.plan) + fragment
    if record.get("round") != round_:
      problems.append(f"{where}: round {record.get('round')!r}, expected {round_}")
    elif record.get("step") != run.manifest.schedule.step_of(round_):
      problems.append(f"{where}: step {record.get('step')!r}, expected"
                      f" {run.manifest.schedule.step_of(round_)}")
  weights = []
  for participant in record["participants"]:
    if not (isinstance(participant, dict) and isinstance(participant.get("learner"), str)
            and isinstance(participant.get("weight"), (int, float))):
      problems.append(f"{where}: a participant without learner and weight")
      continue
    weights.append(float(participant["weight"]))
  if weights and not math.isclose(sum(weights), 1.0, rel_tol=1e-4):
    problems.append(f"{where}: participants' weights sum to {sum(weights)}, not 1")
  for rejected in record["rejected"]:
    if not (isinstance(rejected, dict) and "learner" in rejected and "reason" in rejected):
      problems.append(f"{where}: a rejected entry without learner and reason")
  names = record["state_names"]
  if not (isinstance(names.get("theta"), list) and isinstance(names.get("outer"), list)):
    problems.append(f"{where}: state_names lacks theta or outer")
  elif sorted(names["theta"]) != sorted(run.plan[fragment]):
    problems.append(f"{where}: state_names.theta is not the fragment's leaves")
  return problems


def _files(run, record: dict[str, Any], where: str) -> list[str]:
  try:
    record = RoundRecord.from_json(record, where=where)
  except CorruptRecord as error:
    return [str(error)]
  problems = []
  store = run.store
  max_bytes = states.max_file_bytes(run.manifest.schema, run.manifest.config)
  try:
    state = states.load_state(store, record, max_bytes)  # checks every file's sha256 first
    if states.theta_digest(state.theta) != record.theta_sha256:
      problems.append(f"{where}: the checkpoint's Θ does not match theta_sha256")
  except (CorruptRecord, FileNotFoundError, KeyError, TypeError, ValueError) as error:
    problems.append(f"{where}: state {record.state}: {error}")
  if record.theta:
    try:
      entries, _ = payload.loads(store.read(record.theta, max_bytes))
      if states.theta_digest(entries) != record.theta_sha256:
        problems.append(f"{where}: {record.theta} does not match theta_sha256")
    except (FileNotFoundError, payload.PayloadError, ValueError) as error:
      problems.append(f"{where}: {record.theta} is unreadable: {error!r}")
  if record.update:
    try:
      store.get_verified(record.update, record.update_sha256 or "", max_bytes)
    except (FileNotFoundError, CorruptRecord, BadObject) as error:
      problems.append(f"{where}: update {record.update}: {error!r}")
  return problems
