"""What a ``gmjax train`` job finds in its output folder ``<out>``: a run in
``<out>/run``, an earlier job's outputs, learners of that run still running.

A new job deletes nothing it was not asked to (``--force``); ``--resume`` continues only
the run started with the same config.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import gmjax
from gmjax.app import config as config_lib
from gmjax.mail import heartbeats, layout


CONFIG = "config.json"
"""The config a run was started with, in ``<out>``: ``--resume`` must match it."""
STATE = "state"
"""``<out>/state/<learner>``: each learner's own ``state_dir`` (Adam state, data position)."""
_JOB_METRICS = re.compile(r"metrics(-baseline|-learner-[0-9]+)?\.jsonl")
# The other files a job writes in ``out``: its summary, plots and learners' logs.
_JOB_FILES = re.compile(r"summary\.json|(loss|bytes|cosine|goodput)\.png|learner-[0-9]+\.log")
_NOT_SETTINGS = ("name", "out", "source")  # where a config came from, not what it runs


def _settings(record: dict[str, Any]) -> dict[str, Any]:
  """``{"[table] key": value}`` of a ``TrainConfig.to_json()`` record."""
  flat = {}
  for key, value in record.items():
    if key in ("model", "diloco") and isinstance(value, dict):
      flat.update({f"[{key}] {k}": v for k, v in value.items() if k != "name"})
    elif key not in _NOT_SETTINGS:
      flat[f"[train] {key}"] = value
  return flat


def _differences(started: dict[str, Any], now: dict[str, Any]) -> list[str]:
  """``[table] key: started -> now`` for each setting that differs between two records."""
  before, after = _settings(started), _settings(now)
  unset = "(unset)"
  return [f"{key}: {before.get(key, unset)!r} -> {after.get(key, unset)!r}"
          for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]


def _alive(pid: int) -> bool:
  """Whether process ``pid`` of this host runs (an exited one not yet reaped does not)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # another user's process
  try:
    state = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return True  # no /proc to tell a zombie by
  return state != "Z"


def running(run) -> list[str]:
  """The run's learners whose heartbeat says live and whose process runs on this host."""
  return [f"{name} (pid {record.pid})" for name, record in sorted(run.learners().items())
          if record.status in (heartbeats.LIVE, heartbeats.CLOSING)
          and isinstance(record.pid, int) and record.host == socket.gethostname()
          and _alive(record.pid)]


def lock(out: Path) -> int | None:
  """Takes the folder ``out`` for this job: an exclusive ``flock`` on it, or ValueError if
  another job (or a learner it started) holds it. Returns the descriptor holding it (its
  learners inherit it, so a job killed while they run keeps the folder taken), or None,
  with a warning, where the filesystem cannot lock a folder (some network ones).

  Heartbeats say only which learners have joined: a job between creating its run and
  its learners' first beats, or training its baseline after they closed, has none.
  """
  fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise ValueError(
        f"another gmjax train job is running in {out} (it, or learners it started);"
        " wait for it to end or stop it first, or pass --out DIR to train elsewhere"
    ) from None
  except OSError as error:
    os.close(fd)
    print(f"gmjax train: warning: {out} cannot be locked ({error}); another job started"
          " into the same folder will not be stopped", file=sys.stderr)
    return None
  return fd


def check_out(out: Path) -> None:
  """Raises FileExistsError if ``out``, or a folder it would be made in, is a file or a
  link to nothing, or if ``out`` is a run itself (a job's run is ``<out>/run``)."""
  if (out / layout.MANIFEST).is_file():
    raise FileExistsError(
        f"the output folder {out} (--out, or the config's [train] out) is a run itself;"
        f" a job keeps its run in <out>/run: pass --out {out.parent} to continue this job's"
        " run (with --resume), or another folder to train anew")
  for place in (out, *out.parents):
    if place.is_symlink() and not place.exists():
      raise FileExistsError(
          f"the output folder {out} (--out, or the config's [train] out): {place} is a"
          f" link to {os.readlink(place)}, which does not exist; pass a folder for the"
          " run and its metrics (a missing one is created)")
    if place.exists():
      if place.is_dir():
        return
      raise FileExistsError(
          f"the output folder {out} (--out, or the config's [train] out): {place} is a"
          " file; pass a folder for the run and its metrics (a missing one is created)")


def learner_states(out: Path) -> list[Path]:
  """The learners' ``state_dir`` entries of a job in ``out`` (``<out>/state/learner-<i>``,
  ``state`` a folder or a link to one); nothing else in ``<out>/state`` is the job's."""
  folder = out / STATE
  if not folder.is_dir():
    return []
  return sorted(p for p in folder.iterdir()
                if p.name.startswith("learner-") and p.name[len("learner-"):].isdigit())


def delete_learner_state(path: Path) -> None:
  """Deletes one of ``learner_states``: a folder with what it holds, a file or a link
  (not what the link points to)."""
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path)
  else:
    path.unlink()


def job_config(path: Path) -> bool:
  """Whether ``path`` holds a config that a job wrote (``TrainConfig.to_json``)."""
  try:
    record = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return False
  return isinstance(record, dict) and {"name", "out", "model", "diloco"} <= record.keys()


def job_metrics(out: Path) -> list[Path]:
  """The metrics files a job writes in ``out`` (``metrics.jsonl``, ``metrics-baseline.jsonl``,
  ``metrics-learner-<i>.jsonl``), sorted; no other file, whatever its name."""
  if not out.is_dir():
    return []
  return sorted(p for p in out.glob("metrics*.jsonl") if _JOB_METRICS.fullmatch(p.name))


def job_files(out: Path) -> list[Path]:
  """The metrics, summary, plots and learners' logs a job writes in ``out`` (files or
  links by those names), sorted."""
  if not out.is_dir():
    return []
  return sorted([*job_metrics(out), *(p for p in out.iterdir() if _JOB_FILES.fullmatch(p.name)
                                      and (p.is_file() or p.is_symlink()))])


def earlier_outputs(out: Path) -> list[str]:
  """An earlier job's metrics, summary, plots, logs, learners' states and config in
  ``out``, which a new job would delete or overwrite."""
  found = [p.name for p in job_files(out)]
  found += [f"{STATE}/{p.name}/" for p in learner_states(out)]
  return found + [CONFIG] * (out / CONFIG).exists()


def resumable(cfg: config_lib.TrainConfig, out: Path) -> bool:
  """Whether ``<out>/run`` is a run that ``--resume`` with ``cfg`` continues: it has a
  manifest and ``<out>``'s config records ``cfg``'s settings (an older run that a
  stopped ``--force`` had not deleted yet is not this job's)."""
  saved = out / CONFIG
  try:
    return ((out / "run" / layout.MANIFEST).is_file() and job_config(saved)
            and not _differences(json.loads(saved.read_text(encoding="utf-8")),
                                 cfg.to_json()))
  except (OSError, ValueError):
    return False


def resume_point(cfg: config_lib.TrainConfig, out: Path, run_dir: Path,
                  schema: gmjax.Schema) -> int:
  """The global step the run in ``run_dir`` reached (its newest committed round's), once
  ``cfg`` is checked to be the config it was started with.

  Raises:
    FileNotFoundError: there is no run to continue.
    ValueError: ``cfg`` differs from the config the run was started with (the settings
      named), or the run's learners are still running.
  """
  if not (run_dir / layout.MANIFEST).is_file():
    raise FileNotFoundError(
        f"--resume: there is no run to continue in {run_dir}, but {out} holds an earlier"
        f" job's outputs ({', '.join(earlier_outputs(out))}); pass --force instead of"
        " --resume to delete them and train anew, or --out DIR to train elsewhere"
        if not run_dir.exists() and earlier_outputs(out) else
        f"--resume: there is no run to continue in {run_dir}; drop --resume to start one"
        " there" if not run_dir.exists() else
        f"--resume: {run_dir} holds no run to continue (no {layout.MANIFEST}: its creation"
        " was stopped, or it is another folder); pass --force instead of --resume to"
        " delete it and train anew, or --out DIR to train elsewhere")
  saved = out / CONFIG
  if not saved.is_file():
    raise ValueError(
        f"--resume: {saved}, the config the run in {run_dir} was started with, is"
        " missing, so its [train] settings cannot be checked against this config's; put"
        " it back, or pass --force instead of --resume to delete the run and train anew")
  if not job_config(saved):
    raise ValueError(
        f"--resume: {saved}, the config the run in {run_dir} was started with, is"
        " damaged (not a config that a gmjax train job wrote), so its [train] settings"
        " cannot be checked against this config's; put it back, or move it away and pass"
        " --force instead of --resume to delete the run and train anew (a job does not"
        " delete a config.json it cannot tell its own)")
  try:
    run = gmjax.mail.open(str(run_dir))
    newest = run.newest_versions()
  except (ValueError, PermissionError, FileNotFoundError) as error:  # damaged, half made
    raise ValueError(
        f"--resume: the run in {run_dir} cannot be continued ({error}); pass --force"
        " instead of --resume to delete it and train anew, or --out DIR to train"
        " elsewhere") from None
  differences = _differences(json.loads(saved.read_text(encoding="utf-8")), cfg.to_json())
  if run.config != cfg.diloco:
    differences += [d for d in _differences({"diloco": run.config.to_json()},
                                            {"diloco": cfg.diloco.to_json()})
                    if d not in differences]
  if run.schema != schema:
    differences.append("[model]: the parameters' shapes differ from the run's")
  if differences:
    raise ValueError(
        f"--resume: {cfg.source or 'the config'} differs from the config the run in"
        f" {run_dir} was started with ({saved}): {'; '.join(differences)}; resume with"
        " that config, or train anew with --out DIR (or --force to delete the run)")
  live = running(run)
  if live:
    raise ValueError(
        f"--resume: learners of the run in {run_dir} are still running:"
        f" {', '.join(live)}; stop that gmjax train first")
  return max((run.commit_step(f, v) for f, v in newest.items()), default=0)


def check_new_run(out: Path, run_dir: Path, force: bool) -> None:
  """Makes way for a new run in ``run_dir``: with ``force``, deletes the run there and an
  earlier job's outputs in ``out``; without, raises ``FileExistsError`` naming them.

  Raises:
    FileExistsError: without ``force``, ``run_dir`` holds a run, or anything else, or
      ``out`` an earlier job's outputs.
    ValueError: with ``force``, the run's learners still run on this host.
  """
  if (out / CONFIG).exists() and not job_config(out / CONFIG):
    raise FileExistsError(
        f"{out / CONFIG} is not a config that a gmjax train job wrote (or it is damaged),"
        " and a job writes its own there; move it, or pass --out DIR to train elsewhere")
  if run_dir.is_symlink():
    raise FileExistsError(
        f"{run_dir} is a link to {os.readlink(run_dir)}; a job keeps its run in a folder"
        f" of its own there: remove the link (nothing it points to is deleted), or pass"
        " --out DIR to train elsewhere")
  if run_dir.exists() and not (run_dir.is_dir() and not any(run_dir.iterdir())):
    if not force:
      if (run_dir / layout.MANIFEST).is_file():
        raise FileExistsError(
            f"{run_dir} holds a run already; pass --resume to continue it, --out DIR to"
            " train elsewhere, or --force to delete that run and train anew")
      raise FileExistsError(
          f"{run_dir} exists but holds no run (no {layout.MANIFEST}: its creation was"
          " stopped, or it is another folder); pass --force to delete it and train anew,"
          " or --out DIR to train elsewhere")
    # Deleted under live learners, the run would be recreated around them: they
    # would write into the new run and the new learners could not join under their
    # names. Those of a gmjax train job hold ``out`` (``lock``); others say so in their
    # heartbeats, if the manifest can be read at all (a damaged one is deleted too).
    try:
      live = running(gmjax.mail.open(str(run_dir))) if (
          run_dir / layout.MANIFEST).is_file() else []
    except (ValueError, PermissionError, FileNotFoundError) as error:
      print(f"gmjax train: --force: the run in {run_dir} cannot be opened ({error})")
      live = []
    if live:
      raise ValueError(
          f"--force: learners of the run in {run_dir} are still running:"
          f" {', '.join(live)}; stop that gmjax train first")
    print(f"gmjax train: --force: deleting the previous run in {run_dir}")
    if run_dir.is_dir():
      shutil.rmtree(run_dir)
    else:
      run_dir.unlink()
  earlier = earlier_outputs(out)  # they outlive a run deleted by hand: kept unless forced
  if earlier and not force:
    raise FileExistsError(
        f"{out} holds an earlier job's outputs ({', '.join(earlier)}) but no run; pass"
        " --out DIR to train elsewhere, or --force to delete them and train anew")
  if earlier:
    print(f"gmjax train: --force: deleting {', '.join(earlier)} in {out}")
    for old in job_files(out):
      old.unlink()
    for state in learner_states(out):  # nothing else in <out>/state is the job's
      delete_learner_state(state)
