"""``gmjax train``: M learners as separate processes over a local-directory run.

The job creates a run, starts one ``gmjax.app.worker`` process per learner, shows their
progress, trains the synchronous data-parallel baseline, and writes ``metrics.jsonl``
and the plots into the output folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

import gmjax
from gmjax.app import config as config_lib
from gmjax.app import model, plots
from gmjax.app.baseline import train_baseline


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
  if not path.exists():
    return []
  records = []
  for line in path.read_text(encoding="utf-8").splitlines():
    if line.strip():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # a line being written as we read; the next poll sees it whole
  return records


def _bytes_sent(cfg: config_lib.TrainConfig, params: Any, rounds: list[dict[str, Any]]):
  """Cumulative bytes each learner sent, for DiLoCo rounds and for per-step all-reduce."""
  schema = gmjax.Schema.from_tree(params)
  plan = cfg.diloco.plan(schema)
  per_fragment = [cfg.diloco.delta_layout(schema.subset(names)).nbytes for names in plan]
  total, diloco = 0.0, [(0, 0.0)]
  for record in rounds:
    if record.get("participants"):
      total += per_fragment[record["fragment"]]
      diloco.append((record["step"], total))
  m = cfg.learners
  ring = 2 * (m - 1) / m if m > 1 else 1.0  # bytes a ring all-reduce sends per byte
  grad_bytes = sum(p.size * 4 for p in schema.parameters) * ring
  baseline = [(s, s * grad_bytes) for s in range(1, cfg.steps + 1)]
  label = f"DiLoCo, H={cfg.diloco.sync_every}, P={len(plan)}, {cfg.diloco.delta_precision or 'F32'}"
  return {label: diloco[1:] or diloco, "data-parallel all-reduce (F32, ring)": baseline}


def bytes_by_learner(cfg: config_lib.TrainConfig, params: Any, rounds: list[dict[str, Any]],
                     names: list[str]) -> dict[str, int]:
  """Bytes each learner published (its delta payloads, rejected ones included), and the
  baseline's: a ring all-reduce of F32 gradients on every step, as data parallelism sends."""
  schema = cfg.diloco.cut(gmjax.Schema.from_tree(params))
  per_fragment = [cfg.diloco.delta_layout(schema.subset(names_)).nbytes
                  for names_ in cfg.diloco.plan(schema)]
  sent = dict.fromkeys(names, 0)
  for record in rounds:
    senders = [p["learner"] for p in record.get("participants", ())]
    senders += [r["learner"] for r in record.get("rejected", ())]
    for name in senders:
      if name in sent:
        sent[name] += per_fragment[record["fragment"]]
  m = cfg.learners
  ring = 2 * (m - 1) / m if m > 1 else 1.0
  sent["baseline"] = int(sum(p.size * 4 for p in schema.parameters) * ring * cfg.steps)
  return sent


def train(cfg: config_lib.TrainConfig, *, show_progress: bool = True,
          force: bool = False) -> dict[str, Any]:
  """Runs the demo job; returns a summary (also written to ``<out>/summary.json``).

  Raises:
    FileExistsError: ``<out>/run`` holds a run already and ``force`` is not set (a run
      is never deleted unless asked).
  """
  out = Path(cfg.out)
  run_dir = out / "run"
  if run_dir.exists():
    if not force:
      raise FileExistsError(
          f"{run_dir} holds a run already; pass --out DIR to train elsewhere, or --force to"
          " delete that run and train anew")
    print(f"gmjax train: --force: deleting the previous run in {run_dir}")
    shutil.rmtree(run_dir)
  out.mkdir(parents=True, exist_ok=True)
  for old in out.glob("metrics*.jsonl"):
    old.unlink()

  _, params = model.build(cfg.model, seed=cfg.seed)
  gmjax.mail.create(str(run_dir), params, cfg.diloco)
  names = [f"learner-{i}" for i in range(cfg.learners)]
  started = time.time()
  processes, logs = [], []
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  for index, name in enumerate(names):
    log = open(out / f"{name}.log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
    logs.append(log)
    processes.append(subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "gmjax.app.worker", "--config", cfg.source, "--run",
         str(run_dir), "--name", name, "--index", str(index),
         "--metrics", str(out / f"metrics-{name}.jsonl")],
        stdout=log, stderr=subprocess.STDOUT, env=env))
  bars = [tqdm(total=cfg.steps, desc=name, position=i, disable=not show_progress,
               leave=True, dynamic_ncols=True) for i, name in enumerate(names)]
  try:
    while True:
      for name, bar in zip(names, bars):
        records = _read_jsonl(out / f"metrics-{name}.jsonl")
        done = max((r["step"] for r in records if r.get("event") == "step"), default=0)
        last = next((r for r in reversed(records) if "loss" in r), None)
        bar.update(done - bar.n)
        if last is not None:
          bar.set_postfix(loss=f"{last['loss']:.3f}", refresh=False)
      if all(p.poll() is not None for p in processes):
        break
      time.sleep(0.3)
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
    for bar in bars:
      bar.close()
    for log in logs:
      log.close()
  failed = [(n, p.returncode) for n, p in zip(names, processes) if p.returncode != 0]
  if failed:
    tails = "\n".join(
        f"--- {n} (exit {code}) ---\n" + (out / f"{n}.log").read_text()[-3000:] for n, code in failed
    )
    raise RuntimeError(f"learners failed: {failed}\n{tails}")
  diloco_seconds = time.time() - started

  if cfg.baseline:
    with tqdm(total=cfg.steps, desc="data-parallel baseline", disable=not show_progress) as bar:
      started = time.time()
      train_baseline(cfg, str(out / "metrics-baseline.jsonl"), progress=bar)
      baseline_seconds = time.time() - started
  else:
    baseline_seconds = None

  run = gmjax.mail.open(str(run_dir))
  rounds = run.rounds()
  metrics = []
  for name in [*names, "baseline"]:
    metrics.extend(_read_jsonl(out / f"metrics-{name}.jsonl"))
  with open(out / "metrics.jsonl", "w", encoding="utf-8") as f:
    for record in metrics:
      f.write(json.dumps(record) + "\n")
    for record in rounds:
      f.write(json.dumps({"event": "round", **record}) + "\n")
  figures = plots.plot_all(metrics, rounds, _bytes_sent(cfg, params, rounds), str(out))

  def final(name):
    values = [r["val_loss"] for r in metrics if r["learner"] == name and "val_loss" in r]
    return values[-1] if values else None

  cosines = [r["cosine"] for r in rounds if r.get("cosine") is not None]
  summary = {
      "run": str(run_dir),
      "rounds": len(rounds),
      "final_val_loss": {n: final(n) for n in [*names, *(["baseline"] if cfg.baseline else [])]},
      "bytes_sent": bytes_by_learner(cfg, params, rounds, names),
      "mean_cosine": sum(cosines) / len(cosines) if cosines else None,
      "diloco_seconds": round(diloco_seconds, 1),
      "baseline_seconds": None if baseline_seconds is None else round(baseline_seconds, 1),
      "figures": figures,
      "metrics": str(out / "metrics.jsonl"),
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=2))
  return summary
