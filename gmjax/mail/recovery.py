"""Recovery from a damaged newest version: supersede it with the newest intact one.

A version is damaged when every record of it is (torn, zeroed, edited, or unsigned in
a keyed run), or when its record is intact but the state it names is not (a file
missing, or not matching its sha256). Readers never stop on one:

* a version whose records are all damaged counts as not committed
  (``states.DamagedCommit``, a ``FileNotFoundError``): the newest versions a learner
  pulls are the newest intact ones, and a round still open is simply closed again; its
  closer's record takes the next slot, ``<v>.commit-<k>.json``, and lists the damaged
  records it ``supersedes``;
* a version needed as a base (by the next closer, or by ``pull``) whose state is damaged
  is **repaired**: the newest intact older version ``u`` is saved again as version ``v``
  (Θ and outer state unchanged, no outer step) and committed in the next slot with
  ``repair: {reason, from_version: u}``. Each slot is created exclusively, so of racing
  repairers one commits and the others adopt its record; the round of ``v`` is lost, no
  commit is duplicated, and every reader then agrees on the last intact record.

Version 0 (the creator's parameters) has nothing older to fall back to; its damage is
reported (``CorruptRecord``) and the run must be created again.

In a run that keeps only its newest versions (``gmjax.mail.retention``) a repair falls
back only to a version that is kept, and says so when none is intact; a version that
was pruned is not damaged, and is never committed again (``retention.Pruned``).
"""

from __future__ import annotations

import logging
import uuid

from gmjax.core.records import FragmentState
from gmjax.mail import retention
from gmjax.mail import states
from gmjax.mail.errors import CorruptRecord
from gmjax.mail.manifest import Manifest, utc_now
from gmjax.mail.records import RoundRecord
from gmjax.mail.store import Store

log = logging.getLogger(__name__)


def newest_intact_state(store: Store, fragment: int, below: int, key: bytes | None,
                        max_bytes: int) -> tuple[RoundRecord, FragmentState]:
  """The record and verified state of the newest version ``< below`` that loads (its files
  at most ``max_bytes`` each: ``states.max_file_bytes``).

  Only versions with a commit record are tried: in a run that prunes, the kept ones.

  Raises:
    CorruptRecord: no version below ``below`` is intact.
  """
  versions = states.committed_versions(store, fragment)
  kept = [v for v in versions if v < below]
  for version in reversed(kept):
    try:
      record = states.read_commit(store, fragment, version, key)
      return record, states.load_state(store, record, max_bytes)
    except (FileNotFoundError, CorruptRecord) as error:
      log.warning("version %d of fragment %d is damaged (%s); trying the one before",
                  version, fragment, error)
  if versions and versions[0] > 0:
    raise CorruptRecord(
        f"no intact version of fragment {fragment} below {below} among those kept"
        f" (from {versions[0]}; older ones were pruned, see keep_versions): nothing to"
        " repair from; create the run again.")
  raise CorruptRecord(f"no intact version of fragment {fragment} below {below}: version 0"
                      " is damaged too; create the run again.")


def repair(store: Store, manifest: Manifest, fragment: int, version: int,
           key: bytes | None, reason: str) -> tuple[RoundRecord, FragmentState]:
  """Supersedes damaged ``version`` of ``fragment`` with the newest intact older state.

  Args:
    store: the run's store.
    manifest: the run's manifest (for the round and step of ``version``).
    fragment: the fragment.
    version: the damaged version (> 0).
    key: the run's key or None.
    reason: why ``version`` is damaged, recorded in the repair.

  Returns:
    The record now in force for ``version`` (this repair's, or a racing repairer's) and
    its state.

  Raises:
    CorruptRecord: ``version`` is 0, or nothing older is intact (among the versions
      kept).
    retention.Pruned: ``version`` is older than the versions the run keeps.
  """
  retention.check_kept(store, fragment, version, key, manifest.keep_versions)
  if version <= 0:
    raise CorruptRecord(f"version 0 of fragment {fragment} is damaged ({reason}); it holds"
                        " the creator's parameters: create the run again.")
  slots = len(states.commit_slots(store, fragment, version, key))
  max_bytes = states.max_file_bytes(manifest.schema, manifest.config)
  base, state = newest_intact_state(store, fragment, version, key, max_bytes)
  log.warning("repairing version %d of fragment %d (%s) with the state of version %d",
              version, fragment, reason, state.version)
  repaired = FragmentState(version, dict(state.theta), dict(state.outer))
  nonce = uuid.uuid4().hex[:12]
  files = states.save_state(store, fragment, repaired, nonce)
  files = states.save_theta(store, files, repaired.theta)
  round_ = (version - 1) * len(manifest.plan) + fragment
  record = RoundRecord(
      round=round_, fragment=fragment, version=version,
      step=manifest.schedule.step_of(round_), participants=(), rejected=(), final=(),
      outer_step=False, cosine=None, estimates=base.estimates, live=(), closer="repair",
      state=files.state, update=None, theta=files.theta,
      state_sha256=files.state_sha256, update_sha256=None,
      state_files=files.state_files, state_names=files.state_names,
      theta_sha256=states.theta_digest(repaired.theta), committed_at=utc_now(),
      note=f"version {version} was damaged; it repeats version {state.version}",
      extra={"repair": {"reason": str(reason)[:200], "from_version": state.version}})
  if states.write_commit(store, record, key, supersede=slots,
                         keep_versions=manifest.keep_versions):
    return record, repaired
  states.remove_state(store, files)
  record = states.read_commit(store, fragment, version, key)
  return record, states.load_state(store, record, max_bytes)
