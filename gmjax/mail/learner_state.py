"""A learner's own state, kept across restarts in its ``state_dir`` with Orbax.

``Run.join(name, state_dir=...)`` gives a learner a directory of its own (local, or
``gs://`` through Orbax). At every ``step`` that applies a commit (merges Θ of a round,
or starts a delayed phase from one) the learner saves, synchronously and before
``step`` returns:

* ``state``: the pytree handed to ``step(..., state=...)`` (the inner optimizer's
  state, its count included, so schedules continue),
* ``position``: the JSON value handed to ``step(..., position=...)`` (where the data
  stream is),
* the learner's counters and the versions it holds (``SavedCounters``), and its
  error-feedback residuals when the run has ``error_feedback``,
* ``run`` (a digest of the run's manifest) and ``name``, checked on every later join.

Each save is an Orbax checkpoint that completes atomically (locally a temporary directory
renamed into place; on ``gs://`` a commit marker written last), so a process killed
during a save leaves the previous one restorable; the newest two are kept. After
``pull``, ``Learner.restore(like)`` reads the newest one back; one damaged after it was
saved (a torn file, a bad disk) is passed over, with a warning, for the one before it.
A save that fails (a full disk) is logged and the step goes on: a restart restores the
save before it.

A learner of several processes (``jax.distributed``) saves with all of them (Orbax's
multi-process save: every process calls ``step`` in lockstep and passes the same
``state_dir``, which must then be storage all of them see; ``state`` may hold global
``jax.Array``s).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

from gmjax.core.guards import quote
from gmjax.mail import store
from gmjax.mail.errors import CorruptRecord, StateDirMismatch

log = logging.getLogger(__name__)

# A learner's checkpoints are its own, but Orbax is not documented as thread-safe and
# learners may share a process: they take turns.
_LOCK = threading.Lock()
_MAX_TO_KEEP = 2


class Restored(NamedTuple):
  """What ``Learner.restore`` gives back.

  Attributes:
    state: the state last handed to ``step(..., state=...)`` before a save, shaped like
      the tree given to ``restore``.
    position: the ``position`` saved with it (JSON: tuples come back as lists).
    exact: True when the run had not moved past the versions the learner held at the
      save and no round of the learner was in flight then, so the learner goes on where
      it was; False otherwise (the state is restored anyway, next to the Θ ``pull``
      gave).
  """

  state: Any
  position: Any
  exact: bool


@dataclasses.dataclass(frozen=True)
class SavedCounters:
  """The learner's counters at a save.

  Attributes:
    step_count: the global step the learner had reached.
    local_step: the steps it had trained since it first joined with this state_dir.
    versions: fragment -> the committed version it held.
    steps_since: per fragment, the steps its next contribution to that fragment counts:
      since it last published it (with ``overlap_steps=None`` and ``mixing=0``, or
      since it last merged it if that came later; ``gmjax.mail.learner_rounds``).
    tokens_since: per fragment, the tokens of those steps.
    outstanding: rounds it had published and not merged yet (with ``outer_delay``, also
      those no phase had started from): a restart does not wait for them as it would
      have, so a restore from such a save is not exact.
  """

  step_count: int
  local_step: int
  versions: dict[int, int]
  steps_since: tuple[int, ...]
  tokens_since: tuple[int, ...]
  outstanding: int

  def to_json(self) -> dict[str, Any]:
    return {"step_count": self.step_count, "local_step": self.local_step,
            "versions": {str(f): v for f, v in self.versions.items()},
            "steps_since": list(self.steps_since), "tokens_since": list(self.tokens_since),
            "outstanding": self.outstanding}

  @classmethod
  def from_json(cls, record: dict[str, Any]) -> SavedCounters:
    return cls(step_count=int(record["step_count"]), local_step=int(record["local_step"]),
               versions={int(f): int(v) for f, v in record["versions"].items()},
               steps_since=tuple(int(s) for s in record["steps_since"]),
               tokens_since=tuple(int(t) for t in record["tokens_since"]),
               outstanding=int(record["outstanding"]))


def run_id(manifest_json: dict[str, Any]) -> str:
  """A run's identity: sha256 of its manifest as stored (salt and creation time included),
  so a run created again at the same URL is another run."""
  return hashlib.sha256(json.dumps(manifest_json, sort_keys=True).encode()).hexdigest()[:32]


def check_state_dir(state_dir: Any) -> str:
  """``state_dir`` as a string, or a ``ValueError``/``TypeError`` naming the fix.

  Raises:
    TypeError: not a string or path.
    ValueError: empty, a protocol Orbax does not write here, or an existing file.
  """
  if not isinstance(state_dir, (str, os.PathLike)):
    raise TypeError(f"state_dir must be a directory path or a gs:// URL, got"
                    f" {type(state_dir).__name__} {state_dir!r}.")
  path = os.fspath(state_dir)
  if not isinstance(path, str) or not path.strip():
    raise ValueError(f"state_dir must be a non-empty directory path or gs:// URL, got"
                     f" {state_dir!r}.")
  if store.meant(path):  # "gs:/x" would be a local folder named "gs:"
    raise ValueError(f"state_dir={path!r} is not a URL: did you mean {store.meant(path)}?")
  if "://" in path:
    protocol = path.split("://", 1)[0]
    if protocol != "gs":
      raise ValueError(
          f"state_dir={path!r}: Orbax saves a learner's state to a local directory or"
          f" gs://, not {protocol}://; pass a local path (e.g. on the learner's disk) or a"
          " gs:// URL.")
    return path
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"state_dir={path!r} is a file; pass a directory (it is created if"
                     " missing).")
  return path


def _check_apart(path: str, run_url: str) -> None:
  """Raises a ValueError if ``path`` lies in the run's storage: Orbax would write its
  saves among the run's records and delete them as its own old saves."""
  def where(url: str) -> str:  # comparable: resolved if local, gcs:// as gs://
    local = url.removeprefix("file://")
    return os.path.realpath(local) if "://" not in local else url.replace("gcs://", "gs://", 1)
  state, run = where(path), where(run_url)
  if state == run or state.startswith(run.rstrip("/") + "/"):
    raise ValueError(
        f"state_dir={path!r} lies inside the run's storage {run_url!r}, where Orbax's"
        " saves would mix with the run's records; keep each learner's state_dir outside"
        " the run, e.g. on the learner's own disk.")


def open_state_dir(state_dir: Any, run: tuple[str, str], name: str) -> StateDir | None:
  """The ``StateDir`` a learner joins with (None without a ``state_dir``); a learner of
  several processes saves with all of them, the processes of its ``jax.distributed`` job.

  Args:
    state_dir: ``join``'s ``state_dir``: None, a local path or a ``gs://`` URL.
    run: ``(run_id(manifest), url)`` of the run joined.
    name: the learner's name.

  Raises:
    ValueError/TypeError: a bad ``state_dir`` (``check_state_dir``), or one inside the
      run's storage.
    StateDirMismatch: ``state_dir`` holds another run's or another learner's state.
  """
  if state_dir is None:
    return None
  path = check_state_dir(state_dir)
  _check_apart(path, run[1])
  return StateDir(path, run, name)


class StateDir:
  """The Orbax checkpoints of one learner's state in its ``state_dir``.

  Args:
    path: the checked directory (``check_state_dir``).
    run: the run's identity (``run_id``) and url, to check and to name in errors.
    name: the learner's name.
  """

  def __init__(self, path: str, run: tuple[str, str], name: str):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    self.path = path
    self.run_id, self.run_url = run
    self.name = name
    options = ocp.CheckpointManagerOptions(max_to_keep=_MAX_TO_KEEP, create=True,
                                           enable_async_checkpointing=False)
    with _LOCK:
      self._manager = ocp.CheckpointManager(path, options=options)
    self._meta: dict[str, Any] | None = None
    self._last: int | None = None  # the step of this object's last save
    self._damaged: set[int] = set()  # steps of saves passed over (logged once)
    steps = self._steps()
    for step in steps:
      meta = self._intact_meta(step)
      if meta is not None:
        self._check_owner(meta, step)
        self._meta = meta
        break
    else:
      if steps:
        raise CorruptRecord(
            f"state_dir={self.path!r}: no save of learner {self.name!r} is intact (local"
            f" steps {steps}); delete the state_dir to start afresh.")

  def _steps(self) -> list[int]:
    """The local steps of the complete saves, newest first."""
    with _LOCK:
      self._manager.reload()
      return sorted(self._manager.all_steps(), reverse=True)

  def latest_step(self) -> int | None:
    """The local step of the newest complete save, or None."""
    steps = self._steps()
    return steps[0] if steps else None

  def _intact_meta(self, step: int) -> dict[str, Any] | None:
    """The record of the save at ``step``, or None (logged once) where it is damaged."""
    if step in self._damaged:
      return None
    try:
      return self._read_meta(step)
    # A torn JSON file is a ValueError; a missing item, Orbax's KeyError.
    except (ValueError, OSError, KeyError) as error:
      self._damaged.add(step)
      log.warning("learner %r: the save of state_dir=%r at local step %d is damaged (%s):"
                  " passed over", self.name, self.path, step, quote(repr(error), 300))
      return None

  @property
  def saved(self) -> bool:
    return self._meta is not None

  def _read_meta(self, step: int) -> dict[str, Any]:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    with _LOCK:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))
    return restored.meta

  def _check_owner(self, meta: dict[str, Any], step: int) -> None:
    if meta.get("run") != self.run_id or meta.get("name") != self.name:
      raise StateDirMismatch(
          f"state_dir={self.path!r} holds the state of learner {meta.get('name')!r} of run"
          f" {meta.get('url')!r} (id {meta.get('run')}, saved at local step {step}), not of"
          f" learner {self.name!r} of run {self.run_url!r} (id {self.run_id}); give each"
          " learner of each run its own state_dir, or delete this one to start afresh.")

  def save(self, step: int, counters: SavedCounters, state: Any, position: Any,
           residuals: dict[int, dict[str, np.ndarray]] | None) -> None:
    """Saves one checkpoint at local step ``step`` (synchronously, atomically)."""
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    meta = {"run": self.run_id, "url": self.run_url, "name": self.name,
            "counters": counters.to_json(), "position": position,
            "residuals": residuals is not None, "state_leaves": _leaf_shapes(state)}
    items = {"meta": ocp.args.JsonSave(meta)}
    if jax.tree.leaves(state):
      items["state"] = ocp.args.StandardSave(state)
    if residuals:
      items["residuals"] = ocp.args.StandardSave(_residual_tree(residuals))
    # Never over another learner's save (two given one empty state_dir at once); the
    # newest save being this learner's last one, it was checked when it was made.
    steps = self._steps()
    if steps and steps[0] != self._last and (newest := self._intact_meta(steps[0])):
      self._check_owner(newest, steps[0])
    with _LOCK:
      if step in self._manager.all_steps():
        # A save passed over as damaged (``restore``): the learner went back to the one
        # before it and has come to its step again. Orbax does not save over a step.
        self._manager.delete(step)
        self._damaged.discard(step)
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
      self._manager.wait_until_finished()
    self._meta, self._last = meta, step

  def restore(self, like: Any, residuals_like: dict[int, dict[str, np.ndarray]] | None
              ) -> tuple[SavedCounters, Any, Any, dict[int, dict[str, np.ndarray]] | None]:
    """``(counters, state, position, residuals)`` of the newest intact save.

    Raises:
      CorruptRecord: no save restores (each is damaged).
    """
    for step in self._steps():
      meta = self._intact_meta(step)
      if meta is None:
        continue
      self._check_owner(meta, step)
      if "state_leaves" in meta:  # saves before it was recorded are not checked
        self._check_like(like, meta["state_leaves"], step)
      try:
        return self._restore(step, meta, like, residuals_like)
      except (ValueError, OSError, KeyError) as error:  # a damaged or missing item
        log.warning("learner %r: the save of state_dir=%r at local step %d does not restore"
                    " (%s): passed over", self.name, self.path, step, quote(repr(error), 300))
    raise CorruptRecord(
        f"state_dir={self.path!r}: no save of learner {self.name!r} restores (local steps"
        f" {self._steps()}); delete the state_dir to start afresh.")

  def _restore(self, step: int, meta: dict[str, Any], like: Any,
               residuals_like: dict[int, dict[str, np.ndarray]] | None
               ) -> tuple[SavedCounters, Any, Any, dict[int, dict[str, np.ndarray]] | None]:
    """``restore`` of the save at ``step``, whose record is ``meta``."""
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    items = {}
    if jax.tree.leaves(like):
      # Orbax restores onto arrays, not numpy scalars (np.int32(0)): 0-d arrays instead.
      items["state"] = ocp.args.StandardRestore(jax.tree.map(
          lambda x: np.asarray(x) if isinstance(x, np.generic) else x, like))
    keep_residuals = bool(meta.get("residuals")) and residuals_like is not None
    if keep_residuals:
      items["residuals"] = ocp.args.StandardRestore(_residual_tree(residuals_like))
    state, residuals = like, None
    if items:
      with _LOCK:
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
      if "state" in items:
        # Orbax gives containers back as plain tuples and dicts: rebuild like's types.
        state = jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(restored.state))
      if keep_residuals:
        residuals = {f: dict(zip(sorted(leaves), (np.asarray(a) for a in
                                                  restored.residuals[f"f{f}"])))
                     for f, leaves in residuals_like.items()}
    self._meta = meta
    return SavedCounters.from_json(meta["counters"]), state, meta["position"], residuals

  def _check_like(self, like: Any, saved: list[list[Any]], step: int) -> None:
    """Raises a ValueError when ``like``'s leaves are not the saved state's (paths,
    shapes, dtypes).

    Orbax would restore a numpy leaf at its saved shape whatever ``like`` says, put the
    saved leaves into ``like``'s tree in order whatever their names, and cast each to
    ``like``'s dtype.
    """
    given = _leaf_shapes(like)
    # Saves made before dtypes were recorded hold [path, shape]: their dtypes are not
    # checked.
    given = [g if len(s) > 2 else g[:2] for g, s in zip(given, saved)] + given[len(saved):]
    saved = [[path, list(shape), *rest] for path, shape, *rest in saved]
    if given == saved:
      return
    if [g[0] for g in given] != [s[0] for s in saved]:
      problem = (f"like has {len(given)} leaves {_paths(given)}; the save {len(saved)}"
                 f" {_paths(saved)}")
    else:
      problem = "; ".join(
          f"leaf {g[0]} of like has {_described(g)}, the save {_described(s)}"
          for g, s in zip(given, saved) if g != s)
    raise ValueError(
        f"learner {self.name!r}: restore(like): like is not shaped like the state saved in"
        f" state_dir={self.path!r} at local step {step}: {problem}. Pass a tree like the"
        " state given to step(..., state=...) (e.g. optimizer.init(params) of the same"
        " optimizer and parameters), or delete the state_dir to start afresh.")

  def close(self) -> None:
    with _LOCK:
      self._manager.close()


def _residual_tree(residuals: dict[int, dict[str, np.ndarray]]) -> dict[str, Any]:
  # Lists in name order: parameter names may hold "/" or ".", which Orbax reads as paths.
  return {f"f{f}": [leaves[n] for n in sorted(leaves)] for f, leaves in residuals.items()}


def _leaf_shapes(tree: Any) -> list[list[Any]]:
  """``[[path, shape, dtype], ...]`` of ``tree``'s leaves, in order (JSON, kept in a
  save)."""
  return [[jax.tree_util.keystr(path), list(np.shape(leaf)), _dtype(leaf)]
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _dtype(leaf: Any) -> str:
  dtype = getattr(leaf, "dtype", None)
  return np.dtype(dtype if dtype is not None else np.asarray(leaf).dtype).name


def _described(leaf: list[Any]) -> str:
  """A leaf's shape and, where recorded, its dtype: ``shape (4, 3) float32``."""
  return " ".join([f"shape {tuple(leaf[1])}", *leaf[2:]])


def _paths(leaves: list[list[Any]], limit: int = 8) -> str:
  shown = ", ".join(leaf[0] for leaf in leaves[:limit])
  return shown + (f", ... ({len(leaves) - limit} more)" if len(leaves) > limit else "")
