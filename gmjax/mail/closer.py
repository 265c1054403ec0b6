"""Closing rounds: collect and validate contributions, decide, aggregate, commit once.

Every learner watches the rounds it contributed to. For each it lists
``rounds/<r>/`` and decides as below. The designated closer reads and validates each new
contribution (``contributions.check``) as it appears; a follower only notes the names it
lists, counting each as a contribution that may be valid, and reads and validates them
when it is about to take over (and then decides again on what it validated):

* **closable** when every learner live for the round (``heartbeats.Roster``) has a
  contribution there (valid, or listed and not validated yet), or when ``quorum()`` valid
  ones are in and the grace period (``Estimates.timeout(poll_interval)``, counted from
  when this observer first saw the quorum) has passed. The estimates take the round's
  ``arrival_spread`` (a median over the aggregated contributions), never its wait, so
  learners that publish late, fewer than half, cannot lengthen the grace. A rejected file does not stand for
  its learner: anyone may have planted it at the learner's path before the learner wrote
  there, so the round waits for the learner as if it had none, and reads the file again
  when it changes (``Store.list_marked``); a valid contribution, once read, is kept;
* the **designated closer** is ``sorted(live)[fragment mod len(live)]``: deterministic
  from the round and the live set, and the same learner for every round of a fragment
  while the live set holds, so it keeps the fragment's state in memory;
* a **follower** closes the round itself once it has been closable for
  ``Estimates.timeout(poll_interval)`` without a commit, and at once when the designated
  closer has no contribution in the round: a learner watches only the rounds it
  contributed to, so a designated closer that sent nothing (dead before it could, or
  still starting) would never close it, and waiting for it would stack a second timeout
  on the grace period;
* before the run's first round commits (round 0, and every round of another fragment
  based on version 0) the grace period is the closer's start-up timeout
  (``Run.join(startup_timeout=...)``) instead: the run's timeout is only its floor of 30
  polls then, shorter than a learner that joined may need to compile its first step, and
  a round 0 closed without it would leave it out silently. A learner that dies still
  drops out of the live set after the liveness timeout, and the round closes then.

A survivor therefore waits for a round at most the grace period after the round
reached its quorum (plus a few polls to read the roster), or until every live learner
is in, whichever comes first; when the designated closer has contributed and died, the
follower takes over a timeout after the round became closable, or at once when the
dead learner drops out of the live set (its heartbeat unchanged for the liveness
timeout), whichever comes first. The round record carries the waits: ``wait_seconds``
(from the round's opening here to the close), ``grace_seconds`` (from the quorum to
closable: waiting past the quorum for the rest) and ``takeover_seconds`` (from closable
to the close: a follower waiting on the designated closer).

Closing first screens the round's valid contributions (``screen``): a delta whose norm
per step is an outlier (``gmjax.core.guards.outliers``: more than the run's
``outlier_factor`` times the lower median of the round's) is rejected, and tokens per
step above that factor times the kept ones' lower median are clamped (and recorded); with
``outlier_factor=None``, neither. It then runs the core
aggregator (weighted mean, outer step, publish); an outer step whose result is not finite
is skipped (recorded as ``skipped``: the version commits with Θ and the outer state
unchanged). It saves the new state with Orbax and the update file, and only then creates
the commit record exclusively: whoever races, one commit per version exists; a loser
deletes its files and adopts the winner's record.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from gmjax.core.aggregator import DiLoCoAggregator, padded_count
from gmjax.core.records import Contribution, FragmentState
from gmjax.core.schedule import Estimates
from gmjax.mail import contributions
from gmjax.mail import layout
from gmjax.mail import recovery
from gmjax.mail import retention
from gmjax.mail import states
from gmjax.mail.errors import ContributionRejected, CorruptRecord
from gmjax.mail.heartbeats import MIN_LIVENESS_SECONDS, Roster
from gmjax.mail.manifest import Manifest, utc_now
from gmjax.mail.records import Rejection, RoundRecord
from gmjax.mail.store import BadObject, Store
from gmjax.mail.watch import Watch, arrival_spread, round_waits, screen

log = logging.getLogger(__name__)

HEARTBEAT_POLLS = 5  # a learner rewrites its heartbeat every 5 poll intervals


class Closer:
  """Closes rounds for one learner (``name``) of a run.

  Attributes:
    states: the newest full ``FragmentState`` this closer holds, by fragment.
    estimates: the timing estimates of the newest round record seen.
  """

  def __init__(self, store: Store, manifest: Manifest, key: bytes | None, name: str,
               poll_interval: float, startup_timeout: float | None = None):
    self.store = store
    self.manifest = manifest
    self.key = key
    self.name = name
    self.poll_interval = poll_interval
    self.startup_timeout = startup_timeout
    self.schedule = manifest.schedule
    self.states: dict[int, FragmentState] = {}
    self.estimates = Estimates()
    self._estimates_round = -1
    self.capacity = 0  # contributions the close is compiled for (see grow)
    self._compactor = retention.Compactor(store)
    self._aggregators = {}
    self._schemas = {}
    self._max_bytes = {}
    for fragment, names in enumerate(manifest.plan):
      self._aggregators[fragment] = DiLoCoAggregator(manifest.config,
                                                     manifest.schema.subset(names))
      self._schemas[fragment] = manifest.schema.subset(names)
      self._max_bytes[fragment] = contributions.max_bytes(
          manifest.config.delta_layout(self._schemas[fragment]))

  def timeout(self) -> float:
    return self.estimates.timeout(self.poll_interval)

  def grace(self) -> float:
    """How long a round waits past its quorum for the learners live for it: the run's
    timeout, or the start-up timeout while no round of the run has been seen committed
    (see the module docstring)."""
    if not self.observed_round and self.startup_timeout is not None:
      return max(self.timeout(), self.startup_timeout)
    return self.timeout()

  def liveness_timeout(self) -> float:
    """How long a heartbeat may stay unchanged before its learner is presumed dead.

    The run's timeout, but never less than ten heartbeat intervals nor 2 s: a busy
    process can delay its heartbeat thread, and dropping a live learner from the live
    set would close rounds without it.
    """
    return max(self.timeout(), 10 * HEARTBEAT_POLLS * self.poll_interval, MIN_LIVENESS_SECONDS)

  def grow(self, learners: int) -> None:
    """Compiles the close of every fragment for ``learners`` contributions if it is not
    compiled for that many yet (to the next power of two: a run compiles it once, and
    again only when its live learners double)."""
    capacity = padded_count(learners)
    if capacity <= self.capacity:
      return
    for aggregator in self._aggregators.values():
      aggregator.warm(capacity)
    self.capacity = capacity

  @property
  def observed_round(self) -> bool:
    """Whether a round's record (hence the run's timings) has been seen."""
    return self._estimates_round >= 0

  def observe(self, record: RoundRecord) -> None:
    """Carries the estimates of a newer round record forward."""
    if record.round is not None and record.round > self._estimates_round:
      self._estimates_round = record.round
      self.estimates = record.estimates

  def watch(self, round_: int) -> Watch:
    return Watch(round_, self.schedule.fragment_of(round_), self.schedule.version_after(round_))

  def scan(self, watch: Watch, known: set[str], *, validate: bool = True) -> None:
    """Notes contributions that appeared since the last scan.

    Args:
      watch: the round.
      known: learner names with a heartbeat (a contribution from anyone else is rejected).
      validate: read and validate every contribution not validated yet; with False only
        list them (``watch.listed``), as a follower does.
    """
    # Listed before reading: a file replaced after this listing shows a new marker at
    # the next scan, and is read again then.
    listing = self.store.list_marked(layout.round_dir(watch.round))
    now = time.monotonic()
    for entry in listing:
      watch.arrived.setdefault(entry, now)
    entries = watch.to_read(listing, known)
    if entries and watch.opened is None:
      watch.opened, watch.opened_at = time.monotonic(), utc_now()
    if not validate:
      watch.listed.update(entries)
      return
    for entry in entries:
      watch.listed.discard(entry)
      try:
        found = self._validate(watch, entry, known)
      except FileNotFoundError:
        continue  # gone since the listing (or a prefix, not an object, on object stores)
      except ContributionRejected as rejected:
        if str(watch.found.get(entry)) != str(rejected):  # once, not once per change
          log.warning("round %d: %s", watch.round, rejected)
        found = rejected
      watch.found[entry] = found
      watch.markers[entry] = listing[entry]

  def _validate(self, watch: Watch, entry: str, known: set[str]) -> Contribution:
    """Reads (within the size the layout implies) and checks one contribution."""
    name = contributions.check_name(entry, known)
    try:
      data = self.store.read(f"{layout.round_dir(watch.round)}/{entry}",
                             self._max_bytes[watch.fragment])
    except BadObject as error:
      raise ContributionRejected(name, f"unreadable file: {error.reason}") from None
    checked = contributions.check(
        data, file_name=entry, round_=watch.round, fragment=watch.fragment,
        base_version=watch.version - 1, schema=self._schemas[watch.fragment],
        wire=self.manifest.config.delta_wire, known=known, key=self.key,
        max_steps=self.schedule.sync_every, base_lag=self.manifest.config.outer_delay)
    watch.norms[checked.contribution.learner] = checked.norm_per_step
    watch.clamped.extend(checked.clamped)
    return checked.contribution

  def screen(self, watch: Watch) -> tuple[list[Contribution], list[ContributionRejected],
                                          list[dict[str, Any]]]:
    """The round's contributions as they are aggregated (``gmjax.mail.watch.screen``)."""
    return screen(watch, self.manifest.config.outlier_factor)

  def designated(self, watch: Watch, roster: Roster) -> bool:
    """Whether this observer is the designated closer of ``watch`` for the live set now."""
    live = roster.live_for(watch.round, self.liveness_timeout())
    candidates = sorted(live | {self.name})
    return candidates[watch.fragment % len(candidates)] == self.name

  def decide(self, watch: Watch, roster: Roster) -> bool:
    """Whether this observer closes ``watch`` now (as designated closer or follower)."""
    now = time.monotonic()
    timeout = self.timeout()
    live = roster.live_for(watch.round, self.liveness_timeout())
    contributors = watch.contributors
    if not watch.found and not watch.listed:
      return False
    # Listed contributions may turn out invalid once validated, taking the quorum back.
    possible = len(watch.valid) + len(watch.listed)
    if possible < self.manifest.config.quorum():
      watch.quorum_seen = None
    elif watch.quorum_seen is None:
      watch.quorum_seen = now
    complete = live <= contributors
    if complete and watch.complete_since is None:
      watch.complete_since = now
    closable = complete or (
        watch.quorum_seen is not None and now - watch.quorum_seen >= self.grace())
    if not closable:
      watch.closable_since = None
      return False
    if watch.closable_since is None:
      watch.closable_since = now
    candidates = sorted(live | {self.name})
    designated = candidates[watch.fragment % len(candidates)]
    if designated == self.name or designated not in contributors:
      # A learner without a contribution here does not watch the round: it never closes it.
      return True
    return now - watch.closable_since >= timeout

  def base_state(self, fragment: int, version: int) -> FragmentState | None:
    """The full state of ``version`` (from memory, or verified from storage); None if
    that version is not committed yet."""
    held = self.states.get(fragment)
    if held is not None and held.version == version:
      return held
    try:
      record = states.read_commit(self.store, fragment, version, self.key)
      state = states.load_state(self.store, record, states.max_file_bytes(
          self.manifest.schema, self.manifest.config))
    except (states.DamagedCommit, CorruptRecord) as error:
      try:
        _, state = recovery.repair(self.store, self.manifest, fragment, version, self.key,
                                   repr(error))
      except retention.Pruned:
        return None  # committed on since and pruned: the round is closed
    except FileNotFoundError:
      if version == 0:
        states.version_zero_gone(self.store, fragment)
      return None
    self.states[fragment] = state
    return state

  def close(self, watch: Watch, roster: Roster) -> RoundRecord | None:
    """Aggregates, saves and commits ``watch``; returns the round's commit record (this
    closer's or a racing winner's), or None while the base version is not committed.

    Only validated contributions are aggregated: scan with ``validate=True`` first.
    """
    started = time.monotonic()
    # Who was live when the round closed: after the save, which can take longer than
    # the liveness timeout while the roster waits, nobody might look live.
    live = tuple(sorted(roster.live_for(watch.round, self.liveness_timeout())))
    state = self.base_state(watch.fragment, watch.version - 1)
    if state is None:
      return None
    valid, rejected, clamped = self.screen(watch)
    aggregator = self._aggregators[watch.fragment]
    result = aggregator.close_round(state, valid, capacity=self.capacity)
    participants = result.participants
    skipped = None
    if result.skipped:
      # Finite deltas can still overflow the outer step (a sum near the F32 maximum): the
      # version commits with the fragment unchanged, so the run goes on.
      skipped = "the outer step's result is not finite: Θ and the outer state are unchanged"
      log.warning("round %d: %s", watch.round, skipped)
    nonce = uuid.uuid4().hex[:12]
    files = states.save_state(self.store, watch.fragment, result.state, nonce)
    if result.update is not None:
      # Learners rebuild Θ from the update; only joins read Θ, from the checkpoint.
      files = states.save_update(self.store, files, result.update)
    else:
      files = states.save_theta(self.store, files, result.state.theta)
    sync_seconds = time.monotonic() - started
    quorum_seconds = None
    # The time until the contributions that close the round were in: every live
    # learner's, or the quorum's. Never the grace period after the quorum, which is a
    # multiple of the timeout these estimates set: counting it would grow the timeout
    # round over round.
    reached = watch.complete_since if watch.complete_since is not None else watch.quorum_seen
    if watch.opened is not None and reached is not None:
      quorum_seconds = max(0.0, reached - watch.opened)
    waits = round_waits(watch, started)
    # The lower median: one learner's report cannot move the run's timeouts.
    step_seconds = sorted(c.step_seconds for c in valid if c.step_seconds > 0)
    estimates = self.estimates.updated(
        step=step_seconds[(len(step_seconds) - 1) // 2] if step_seconds else None,
        quorum=arrival_spread(watch, valid), sync=sync_seconds)
    extra = {}
    listed, unlisted = retention.listed_rejections(rejected, roster.known)
    if unlisted:
      extra["unlisted_rejections"] = unlisted
    if skipped is not None:
      extra["skipped"] = skipped
    if clamped:
      extra["clamped"] = clamped
    if result.aggregation is not None:
      extra["aggregation"] = result.aggregation.to_json()
    record = RoundRecord(
        round=watch.round,
        fragment=watch.fragment,
        version=result.state.version,
        step=self.schedule.step_of(watch.round),
        participants=tuple(participants),
        rejected=tuple(Rejection(r.learner, r.reason) for r in listed),
        final=tuple(sorted(c.learner for c in valid if c.final)),
        outer_step=bool(valid) and skipped is None,
        cosine=result.cosine,
        estimates=estimates,
        live=live,
        closer=self.name,
        state=files.state,
        update=files.update,
        theta=files.theta,
        state_sha256=files.state_sha256,
        update_sha256=files.update_sha256,
        state_files=files.state_files,
        state_names=files.state_names,
        theta_sha256=states.theta_digest(result.state.theta),
        opened_at=watch.opened_at,
        quorum_seconds=quorum_seconds,
        sync_seconds=sync_seconds,
        **waits,
        committed_at=utc_now(),
        note=None if valid else "no valid contribution: no outer step, the fragment is unchanged",
        extra=extra,
    )
    if states.write_commit(self.store, record, self.key,
                           keep_versions=self.manifest.keep_versions):
      self.states[watch.fragment] = result.state
      self.observe(record)
      log.info("round %d committed version %d of fragment %d by %s", watch.round,
               record.version, watch.fragment, self.name)
      return record
    states.remove_state(self.store, files)
    try:
      return states.read_commit(self.store, watch.fragment, watch.version, self.key)
    except FileNotFoundError:
      return None  # committed, and pruned since: the worker finds the newest

  def tidy(self, record: RoundRecord, roster: Roster) -> None:
    """After this closer's commit of ``record``: deletes the versions, rounds and dead
    learners' files the run no longer keeps (``gmjax.mail.retention``). A failure is
    logged and left to the next commit, which deletes everything below its own floor."""
    try:
      retention.prune(self.store, self.manifest, record.fragment, record.version)
      if self.manifest.keep_versions is not None:
        dead_after = retention.DEAD_TIMEOUTS * self.liveness_timeout()
        # The storage's clock now: the date of the commit record just written.
        clock = lambda: self.store.list_dated(f"fragments/{record.fragment}").get(
            f"{record.version}.commit.json")
        self._compactor.compact(roster, dead_after, interval=dead_after / 4,
                                storage_clock=clock)
    except Exception as error:  # pylint: disable=broad-except
      log.warning("pruning after version %d of fragment %d failed (the next commit"
                  " tries again): %r", record.version, record.fragment, error)
