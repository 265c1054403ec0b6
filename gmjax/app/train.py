"""``gmjax train``: M learners as separate processes over a local-directory run.

The job checks the config and the corpus, creates a run (and ``config.json``, the
config it was started with), starts one ``gmjax.app.worker`` process per learner, shows
their progress, trains the synchronous data-parallel baseline, and writes
``metrics.jsonl`` and the plots into the output folder.

``resume`` continues a stopped run instead: the same config, learners that rejoin it
under their names at the step of its newest committed round, metrics appended to.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

import gmjax
from gmjax.app import config as config_lib
from gmjax.app import model, outdir, plots, stops
from gmjax.app.stops import LearnersFailed
from gmjax.app.baseline import train_baseline
from gmjax.mail import contributions, layout


def _read_jsonl(path: Path, offset: int = 0) -> list[dict[str, Any]]:
  """The JSON records of ``path`` from byte ``offset`` on (lines not yet whole skipped)."""
  if not path.exists():
    return []
  records = []
  with path.open("rb") as f:
    f.seek(offset)
    text = f.read().decode("utf-8", errors="replace")
  for line in text.splitlines():
    if line.strip():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # a line being written as we read; the next poll sees it whole
  return records


def _payload_bytes(cfg: config_lib.TrainConfig, params: Any):
  """The run's schema (cut into layer blocks as the run cuts it), and the bytes of one
  delta payload of each of its fragments."""
  schema = cfg.diloco.cut(gmjax.Schema.from_tree(params))
  plan = cfg.diloco.plan(schema)
  return schema, [cfg.diloco.delta_layout(schema.subset(names)).nbytes for names in plan]


def _bytes_sent(cfg: config_lib.TrainConfig, params: Any, sent_rounds: list[tuple[int, str]],
                names: list[str]) -> dict[str, list[tuple[int, float]]]:
  """Cumulative bytes each learner sent against the step of the round they were for
  (``published``'s contributions, as ``bytes_by_learner`` counts them), and a
  data-parallel worker's per-step all-reduce."""
  schema, per_fragment = _payload_bytes(cfg, params)
  schedule = cfg.diloco.schedule(len(per_fragment))
  precision = cfg.diloco.delta_precision or "F32"
  series = {}
  for name in names:
    total, points = 0.0, []
    for round_ in sorted(r for r, learner in sent_rounds if learner == name):
      total += per_fragment[schedule.fragment_of(round_)]
      points.append((schedule.step_of(round_), total))
    series[f"{name}: DiLoCo, H={cfg.diloco.sync_every}, P={len(per_fragment)}, {precision}"] = points
  grad_bytes = sum(p.size * 4 for p in schema.parameters) * _ring(cfg.learners)
  if grad_bytes:  # one data-parallel worker sends nothing (no line on a log scale)
    series["data-parallel all-reduce (F32, ring)"] = [
        (s, s * grad_bytes) for s in range(1, cfg.steps + 1)]
  return series


def _ring(learners: int) -> float:
  """Bytes a ring all-reduce sends per byte reduced: none with one worker."""
  return 2 * (learners - 1) / learners


def published(run: Any) -> list[tuple[int, str]]:
  """``(round, learner)`` of each contribution in the run's round folders: those its
  rounds aggregated or rejected, and those that came after their round closed."""
  found = []
  for entry in run.store.list("rounds"):
    if entry.isdigit():
      found += [(int(entry), contributions.learner_of(name))
                for name in run.store.list(f"rounds/{entry}")
                if name.endswith(layout.CONTRIBUTION_SUFFIX)]
  return found


def bytes_by_learner(cfg: config_lib.TrainConfig, params: Any,
                     sent_rounds: list[tuple[int, str]], names: list[str]
                     ) -> dict[str, int]:
  """Bytes each learner published (its delta payloads: ``published``'s, late and
  rejected ones included), and the baseline's: a ring all-reduce of F32 gradients on
  every step, as data parallelism sends."""
  schema, per_fragment = _payload_bytes(cfg, params)
  schedule = cfg.diloco.schedule(len(per_fragment))
  sent = dict.fromkeys(names, 0)
  for round_, name in sent_rounds:
    if name in sent:
      sent[name] += per_fragment[schedule.fragment_of(round_)]
  sent["baseline"] = int(sum(p.size * 4 for p in schema.parameters) * _ring(cfg.learners)
                         * cfg.steps)
  return sent


def _earlier_seconds(out: Path) -> dict[str, float]:
  """The ``*_seconds`` of the ``summary.json`` an earlier attempt of the job wrote."""
  try:
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return {}
  return {k: v for k, v in summary.items() if k.endswith("_seconds")
          and type(v) in (int, float)} if isinstance(summary, dict) else {}


def _finished(path: Path, steps: int) -> bool:
  """Whether the metrics at ``path`` reach step ``steps``."""
  return any(r.get("event") == "step" and r.get("step") == steps for r in _read_jsonl(path))


def _latest(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each learner's newest record of each event and step: what a resumed learner trained
  again replaces what the stopped one had logged."""
  latest = {(r.get("learner"), r.get("event"), r.get("step")): r for r in metrics}
  return list(latest.values())


def final_losses(metrics: list[dict[str, Any]], names: list[str], steps: int
                 ) -> dict[str, float | None]:
  """Each name's held-out loss at step ``steps`` (its last such evaluation), or None: a
  learner that died before the end has none there, and its loss at an earlier step is
  not the trained model's."""
  def final(name):
    values = [r["val_loss"] for r in metrics if r.get("learner") == name
              and "val_loss" in r and r.get("step") == steps]
    return values[-1] if values else None
  return {name: final(name) for name in names}


def _train_learners(cfg: config_lib.TrainConfig, out: Path, run_dir: Path,
                    names: list[str], start: int, resume: bool, show_progress: bool,
                    held: int | None) -> None:
  """Starts one worker process per learner, shows their progress, waits for them all.

  With ``resume`` the learners' logs and metrics are appended to, from step ``start``.
  Each worker reads the config the job checked (``<out>/config.json``), not the file it
  came from, which may have changed since, and inherits ``held``, the job's hold on
  ``out`` (``outdir.lock``).

  Raises:
    LearnersFailed: a learner failed (its log's tail quoted).
  """
  # The workers wait for learners that joined after this moment, not for heartbeats a
  # stopped attempt left behind.
  since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
  offsets = {}
  processes, logs, bars = [], [], []
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  try:  # a stop while learners start stops those already started too
    for index, name in enumerate(names):
      metrics = out / f"metrics-{name}.jsonl"
      offsets[name] = metrics.stat().st_size if metrics.exists() else 0
      log = open(out / f"{name}.log", "a" if resume else "w",  # pylint: disable=consider-using-with
                 encoding="utf-8")
      logs.append(log)
      processes.append(subprocess.Popen(  # pylint: disable=consider-using-with
          [sys.executable, "-m", "gmjax.app.worker", "--config", str(out / outdir.CONFIG),
           "--run", str(run_dir), "--name", name, "--index", str(index), "--metrics",
           str(metrics), "--since", since, "--state-dir", str(out / outdir.STATE / name),
           *(["--resume"] if resume else [])],
          stdout=log, stderr=subprocess.STDOUT, env=env,
          pass_fds=() if held is None else (held,)))
    bars = [tqdm(total=cfg.steps, initial=start, desc=name, position=i,
                 disable=not show_progress, leave=True, dynamic_ncols=True)
            for i, name in enumerate(names)]
    while True:
      for name, bar in zip(names, bars):
        records = _read_jsonl(out / f"metrics-{name}.jsonl", offsets[name])
        done = max((r["step"] for r in records if r.get("event") == "step"), default=start)
        last = next((r for r in reversed(records) if "loss" in r), None)
        bar.update(done - bar.n)
        if last is not None:
          bar.set_postfix(loss=f"{last['loss']:.3f}", refresh=False)
      # A learner that fails ends the job (the others are stopped below).
      if any(p.poll() not in (None, 0) for p in processes) or all(
          p.poll() is not None for p in processes):
        break
      time.sleep(0.3)
  finally:
    failed = [(n, p.returncode) for n, p in zip(names, processes)
              if p.poll() is not None and p.returncode != 0]
    stopped = [n for n, p in zip(names, processes) if p.poll() is None]
    for p in processes:
      if p.poll() is None:
        p.kill()
        p.wait()  # reaped: it holds ``out`` no longer
    for bar in bars:
      bar.close()
    for log in logs:
      log.close()
  if failed:
    tails = "\n".join(
        f"--- {n} (exit {code}) ---\n" + (out / f"{n}.log").read_text()[-3000:] for n, code in failed
    )
    others = f" (stopped: {', '.join(stopped)})" if stopped else ""
    raise LearnersFailed(f"learners failed: {failed}{others}\n{tails}")


def train(cfg: config_lib.TrainConfig, *, show_progress: bool = True,
          force: bool = False, resume: bool = False) -> dict[str, Any]:
  """Runs the demo job; returns a summary (also written to ``<out>/summary.json``).

  Everything the config and the corpus say is checked before any process starts or any
  file is written.

  Args:
    cfg: the job's config.
    show_progress: progress bars.
    force: delete a run already in ``<out>/run`` and train anew (not one whose
      learners still run on this host).
    resume: continue the run in ``<out>/run``, started with this very config: its
      learners rejoin it at the step of its newest committed round (steps trained past
      it are lost with the stopped processes; the inner optimizer's moments start again,
      its learning-rate schedule goes on from that step) and train until ``steps``;
      their metrics are appended to. The baseline's metrics are kept if they reach
      ``steps``, else the baseline trains again from the start.

  Raises:
    FileExistsError: ``<out>/run`` holds a run, or ``<out>`` an earlier job's outputs,
      and neither ``force`` nor ``resume`` is set (neither is deleted unless asked);
      ``<out>``, or a folder it would be made in, is a file.
    FileNotFoundError: ``resume`` without a run in ``<out>/run``; the corpus is missing.
    ValueError: ``force`` with ``resume``; ``resume`` with a config other than the
      run's (the differing settings named), or without the ``config.json`` it was
      started with; another job running in ``<out>``, or ``resume`` or ``force`` while
      the run's learners still run on this host; a config the corpus or the model
      cannot train with.
    LearnersFailed: a learner process failed (the tail of its log quoted).
    KeyboardInterrupt: Ctrl-C, SIGTERM or SIGHUP: the learners are stopped first.
  """
  if force and resume:
    raise ValueError("--force deletes the run and trains anew, --resume continues it;"
                     " pass one of them")
  with stops.stopped_by_signals():
    out = Path(cfg.out)
    outdir.check_out(out)
    config_lib.check_data(cfg)
    _, params = model.build(cfg.model, seed=cfg.seed)
    schema = cfg.diloco.cut(gmjax.Schema.from_tree(params))
    cfg.diloco.check_parameters(schema)
    if not resume:  # taken before anything in it is looked at: another job may make it
      out.mkdir(parents=True, exist_ok=True)
    held = outdir.lock(out) if out.is_dir() else None
    try:
      return _job(cfg, out, params, schema, held, show_progress, force, resume)
    finally:
      if held is not None:
        os.close(held)


def _job(cfg: config_lib.TrainConfig, out: Path, params: Any, schema: gmjax.Schema,
         held: int | None, show_progress: bool, force: bool, resume: bool
         ) -> dict[str, Any]:
  """``train`` once the config is checked and ``out`` taken."""
  run_dir = out / "run"
  if resume:
    start = outdir.resume_point(cfg, out, run_dir, schema)
  else:
    start = 0
    outdir.check_new_run(out, run_dir, force)
    (out / outdir.CONFIG).write_text(json.dumps(cfg.to_json(), indent=2), encoding="utf-8")
    # Every version kept: the metrics and plots read every round's record at the end.
    gmjax.mail.create(str(run_dir), params, cfg.diloco, keep_versions=None)

  names = [f"learner-{i}" for i in range(cfg.learners)]
  # What an earlier attempt's summary says it took, for what this one does not train.
  earlier = _earlier_seconds(out) if resume else {}
  started = time.time()
  if start < cfg.steps:
    if resume:
      print(f"gmjax train: --resume: the learners rejoin {run_dir} at step {start} of"
            f" {cfg.steps}")
    _train_learners(cfg, out, run_dir, names, start, resume, show_progress, held)
  else:
    print(f"gmjax train: --resume: the newest round of {run_dir} is at step {start}: its"
          f" learners have trained all {cfg.steps} steps")
  diloco_seconds = (time.time() - started if start < cfg.steps
                    else earlier.get("diloco_seconds"))

  baseline_path = out / "metrics-baseline.jsonl"
  baseline_seconds = None
  if cfg.baseline and resume and _finished(baseline_path, cfg.steps):
    baseline_seconds = earlier.get("baseline_seconds")
    print(f"gmjax train: --resume: keeping the baseline's {cfg.steps} steps in {baseline_path}")
  elif cfg.baseline:
    baseline_path.unlink(missing_ok=True)  # a stopped baseline trains again from the start
    with (tqdm(total=cfg.steps, desc="data-parallel baseline", disable=not show_progress)
          as bar, stops.deferred() as check):
      started = time.time()
      train_baseline(cfg, str(baseline_path), progress=bar, check=check)
      baseline_seconds = time.time() - started

  run = gmjax.mail.open(str(run_dir))
  rounds = run.rounds()
  metrics = []
  for name in [*names, "baseline"]:
    metrics.extend(_read_jsonl(out / f"metrics-{name}.jsonl"))
  with open(out / "metrics.jsonl", "w", encoding="utf-8") as f:
    for record in metrics:
      f.write(json.dumps(record) + "\n")
    for record in rounds:
      f.write(json.dumps({"event": "round", **record.to_json()}) + "\n")
  sent = published(run)
  figures = plots.plot_all(_latest(metrics), rounds, _bytes_sent(cfg, params, sent, names),
                           str(out))
  learner_goodput = plots.goodput(metrics, rounds, names,
                                  len(cfg.diloco.plan(schema)))
  figures.append(plots.plot_goodput(learner_goodput, str(out), cfg.learner_speeds))

  cosines = [r.cosine for r in rounds if r.cosine is not None]
  summary = {
      "run": str(run_dir),
      "rounds": len(rounds),
      "resumed_at_step": start if resume else None,
      "final_val_loss": final_losses(metrics, [*names, *(["baseline"] if cfg.baseline else [])],
                                    cfg.steps),
      "bytes_sent": bytes_by_learner(cfg, params, sent, names),
      "mean_cosine": sum(cosines) / len(cosines) if cosines else None,
      "goodput": learner_goodput,
      "diloco_seconds": None if diloco_seconds is None else round(diloco_seconds, 1),
      "baseline_seconds": None if baseline_seconds is None else round(baseline_seconds, 1),
      "figures": figures,
      "metrics": str(out / "metrics.jsonl"),
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=2))
  return summary
