"""A learner that joins a run again: ``pull`` and ``restore``.

What a learner that restarts gets back: ``pull`` gives the newest committed Θ and sets
``step_count`` to its step; nothing of the learner's own survives (its optimizer state,
data position, residuals, delayed phase starts, steps past that commit). With
``join(name, state_dir=...)`` it saves, at each ``step`` that applies a commit, the
``state`` and ``position`` handed to ``step`` with its counters, versions and residuals
(``gmjax.mail.learner_state``), and ``restore`` gives them back after ``pull`` (with
``overlap_steps = None`` and ``mixing = 0`` the steps and tokens since each fragment's
round stay zero: ``pull`` replaced every fragment by Θ).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gmjax.core.guards import quote
from gmjax.core.schema import Schema
from gmjax.mail import delayed
from gmjax.mail import learner_args
from gmjax.mail import learner_state
from gmjax.mail import placement

# The learner's own logger: these warnings are a learner's, as its other ones.
log = logging.getLogger("gmjax.mail.learner")
# Where a user finds the run's parameters' shapes.
_WHERE = ("run.schema; with layer_axis, run.schema.source holds the stacked leaves, and"
          " run.schema their blocks")


class Resuming:
  """``Learner``'s start: the newest Θ (``pull``) and its own saved state (``restore``).

  A mixin of ``gmjax.mail.learner.Learner``, whose constructor sets the attributes these
  methods read.
  """

  @learner_args.one_call_at_a_time
  def pull(self, like: Any) -> Any:
    """The newest committed Θ of every fragment, shaped like ``like``.

    Args:
      like: a pytree shaped like the run's parameters (its values are not used).

    Returns:
      A tree like ``like``: numpy leaves stay numpy; ``jax.Array`` leaves come back with
      the sharding of ``like``'s leaf (in a multi-process job, as global arrays); others
      become jax arrays.

    Raises:
      ValueError: ``like`` does not match the run's schema, or ``step`` was already called.
    """
    self._check_open("pull")
    if self.local_step:
      raise ValueError(f"learner {self.name!r}: pull() must come before the first step()"
                       " (or a restore(), which goes on from a saved step).")
    try:
      schema = self.config.cut(Schema.from_tree(like))
    except ValueError as error:  # None, or no arrays: the message named neither pull nor like
      raise ValueError(f"pull(like): {error} Pass parameters shaped like those the run was"
                       f" created with ({_WHERE}).") from None
    if schema != self.manifest.schema:
      raise ValueError(
          "pull(like): like does not match the run's parameters:"
          f" {learner_args.schema_differences(schema, self.manifest.schema)}; pass parameters shaped"
          f" like those the run was created with ({_WHERE}).")
    self._tree_schema = schema
    flat = schema.flatten(like)  # with layer blocks, pieces sliced only when read
    deadline = time.monotonic() + max(self.startup_timeout, self._deadline() - time.monotonic())
    while True:
      # Every process of a learner starts from process 0's versions: each reading the
      # store on its own (seconds apart) could take another, and their parameters would
      # be one global array of two versions. A version pruned before a process read it
      # comes as a newer one: then they read again.
      newest = delayed.every_process(self.run.newest_versions(), self.process_count)[0]
      commits = self._pull_versions(newest, deadline)
      loaded = {f: commit.record.version for f, commit in commits.items()}
      seen = delayed.every_process(loaded, self.process_count)
      if all(versions == seen[0] for versions in seen):
        break
      log.info("learner %r: its processes loaded versions %s: pulling again", self.name, seen)
    self.step_count = self.run.start_step(newest)
    self.first_round = self.schedule.first_round_after(self.step_count)
    for fragment, commit in commits.items():
      theta = commit.theta
      for n in self.manifest.plan[fragment]:
        flat[n] = placement.like(theta[n], flat[n])
      self._anchors[fragment] = theta
      self._versions[fragment] = commit.record.version
      self._pulled_records[fragment] = commit.record
      if self._delay is not None:
        self._delay.begin(fragment, theta)
    # Loading the start is not idling in step() or close().
    self.idle_seconds, self._resumed = 0.0, None
    if self._pacer is not None:
      self._pacer.start(self.first_round, time.monotonic())
    self._beat(step=self.step_count, first_round=self.first_round)
    if self._beats is not None:
      self._beats.write().result()
    self._pulled = True
    self._last_flat = flat
    return schema.unflatten(flat)

  def _pull_versions(self, versions: dict[int, int], deadline: float) -> dict[int, Any]:
    """The commits of ``versions`` (fragment -> version), each with its Θ."""
    futures = {f: self._worker.request(f, v) for f, v in versions.items()}
    commits = {}
    for fragment, version in versions.items():
      self._futures[(fragment, version)] = futures[fragment]
      commits[fragment] = self._wait(fragment, version, deadline)
      del self._futures[(fragment, version)]
    return commits

  @learner_args.one_call_at_a_time
  def restore(self, like: Any) -> learner_state.Restored | None:
    """The state this learner saved in its ``state_dir``, and its counters back.

    Call it after ``pull`` and before the first ``step``. The learner's ``local_step``,
    and (when the run has not moved past the versions it held at the save, and none of
    its rounds was in flight then) its ``step_count``, its steps and tokens since each
    fragment's last round (with ``overlap_steps=None`` and ``mixing=0`` these stay zero:
    ``pull`` replaced every fragment by Θ) and its error-feedback residuals continue from
    the save.
    Otherwise ``pull`` gave the newer Θ, ``step_count`` stays at the run's step, and the
    saved state comes back anyway (``exact=False``, logged as a warning): its moments
    are still closer than zeros.

    Args:
      like: a pytree shaped like the state handed to ``step(..., state=...)`` (e.g.
        ``optimizer.init(params)``); its leaves' shardings place the restored ones.

    Returns:
      ``Restored(state, position, exact)``, or None when the state_dir holds nothing.

    Raises:
      ValueError: no ``state_dir`` was given to ``join``, ``pull`` was not called, or
        ``step`` was; or ``like``'s leaves (paths, shapes, dtypes) are not the save's.
      StateDirMismatch: the state_dir's state is another run's or learner's.

    Example:
      >>> import tempfile
      >>> import numpy as np
      >>> import gmjax
      >>> params = {"w": np.ones((4, 2), np.float32)}
      >>> run = gmjax.mail.create(tempfile.mkdtemp(), params, gmjax.DiLoCo(sync_every=2))
      >>> state_dir = tempfile.mkdtemp()  # the learner's own, e.g. on its local disk
      >>> learner = run.join("worker-0", poll_interval=0.01, state_dir=state_dir)
      >>> params = learner.pull(params)
      >>> print(learner.restore({"m": np.zeros((4, 2), np.float32)}))  # nothing saved yet
      None
      >>> for position in range(1, 5):  # saves at steps 2 and 4, where it merges commits
      ...   state = {"m": params["w"] * position}  # e.g. the inner optimizer's state
      ...   params = learner.step({"w": params["w"] - 0.1}, state=state, position=position)
      >>> _ = learner.close(params)
      >>> learner = run.join("worker-0", poll_interval=0.01, state_dir=state_dir)  # restart
      >>> params = learner.pull(params)
      >>> restored = learner.restore({"m": np.zeros((4, 2), np.float32)})
      >>> restored.position, restored.exact, learner.step_count, learner.local_step
      (4, True, 4, 4)
      >>> _ = learner.close(params)
    """
    self._check_open("restore")
    if self._state_dir is None:
      raise ValueError(f"learner {self.name!r}: restore() needs join(..., state_dir=...).")
    if not self._pulled or self.local_step:
      raise ValueError(f"learner {self.name!r}: call restore(state) once, after pull() and"
                       " before the first step().")
    if self._state_dir.latest_step() is None:
      self._restore_checked = True
      return None
    # Steps stay locked until a restore succeeds: a refused like leaves the save to
    # restore (with the right one), not a learner that would save over it.
    counters, state, position, residuals = self._state_dir.restore(like, self._residuals)
    self._restore_checked = True
    exact = counters.versions == self._versions and not counters.outstanding
    self.local_step = counters.local_step
    if exact:
      self.step_count = counters.step_count
      self.first_round = self.schedule.first_round_after(self.step_count)
      if not self._merge_discards:
        # With overlap_steps=None and mixing 0 they stay zero: pull replaced every
        # fragment by Θ, and a delta holds only the steps after that.
        self._steps_since = list(counters.steps_since)
        self._tokens_since = list(counters.tokens_since)
      if residuals is not None:
        self._residuals = residuals
    elif counters.versions != self._versions:
      # Newer versions, or older ones where a damaged newest commit was closed again.
      log.warning(
          "learner %r: the run's versions are not those of its save (it held versions %s"
          " at its save, the run has %s): its saved state is restored next to the run's Θ",
          self.name, counters.versions, self._versions)
    else:
      log.warning("learner %r: %d round(s) of it were in flight at its save: its saved"
                  " state is restored, and it goes on from the run's step",
                  self.name, counters.outstanding)
    # The steps this join trains, for its heartbeat's ``trained``: those after the save,
    # and those of the save that its first contributions carry (each fragment's).
    carried = sum(self._steps_since) / max(1, len(self._steps_since))
    self._trained_from = self.local_step - round(carried)
    if exact:
      self._beat(step=self.step_count, first_round=self.first_round)
    return learner_state.Restored(state, position, exact)

  def _save(self, state: Any, position: Any) -> None:
    """Saves the learner's state at a step that applied a commit.

    A save that fails (a full disk, a storage error) is logged and the step goes on: it
    has merged the commit, which the caller must get back, and a restart restores the
    save before it. With adaptive steps the save's time does not count toward the
    round's period (``gmjax.mail.pace``).
    """
    started = time.monotonic()
    counters = learner_state.SavedCounters(
        step_count=self.step_count, local_step=self.local_step, versions=dict(self._versions),
        steps_since=tuple(self._steps_since), tokens_since=tuple(self._tokens_since),
        outstanding=len(self._outstanding) + len(self._unadopted))
    try:
      self._state_dir.save(self.local_step, counters, state, position, self._residuals)
    except Exception as error:  # pylint: disable=broad-except
      log.warning("learner %r: its state was not saved in state_dir=%r at local step %d"
                  " (%s); it trains on, and a restart would restore the save before it",
                  self.name, self._state_dir.path, self.local_step,
                  quote(repr(error), 300))
    if self._pacer is not None:
      self._pacer.clock.pause(time.monotonic() - started)
