"""PNG plots of a demo run: loss against the baseline, bytes sent, cosine per round, and
each learner's goodput and idle fraction."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

from gmjax.mail.records import RoundRecord


def _smooth(values: list[float], window: int = 10) -> np.ndarray:
  values = np.asarray(values, np.float64)
  if values.size < window:
    return values
  kernel = np.ones(window) / window
  head = np.cumsum(values[: window - 1]) / np.arange(1, window)
  return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def plot_all(metrics: list[dict[str, Any]], rounds: list[RoundRecord],
             bytes_per_step: dict[str, list[tuple[int, float]]], out: str) -> list[str]:
  """Writes ``loss.png``, ``bytes.png`` and ``cosine.png`` into ``out``; returns their paths."""
  paths = []
  by_learner = defaultdict(list)
  for record in metrics:
    by_learner[record["learner"]].append(record)

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in sorted(by_learner):
    steps = [r for r in by_learner[name] if r.get("event") == "step"]
    if not steps:
      continue
    style = {"color": "black", "lw": 2} if name == "baseline" else {"alpha": 0.8}
    label = "synchronous data-parallel" if name == "baseline" else f"{name} (train)"
    ax.plot([r["step"] for r in steps], _smooth([r["loss"] for r in steps]), label=label, **style)
    evals = [r for r in by_learner[name] if "val_loss" in r]
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o--",
            color=style.get("color"), alpha=0.6, label=f"{label.split(' (')[0]} (validation)")
  ax.set_xlabel("inner step")
  ax.set_ylabel("cross-entropy (nats/byte)")
  ax.set_title("loss: DiLoCo learners vs synchronous data-parallel")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  paths.append(_save(fig, out, "loss.png"))

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for label, series in bytes_per_step.items():
    if series:
      ax.plot([s for s, _ in series], [b / 2**20 for _, b in series], label=label)
  ax.set_xlabel("inner step")
  ax.set_ylabel("MiB sent per learner (cumulative)")
  ax.set_yscale("log")
  ax.set_title("bytes sent")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  paths.append(_save(fig, out, "bytes.png"))

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for fragment in sorted({r.fragment for r in rounds}):
    points = [(r.round, r.cosine) for r in rounds
              if r.fragment == fragment and r.cosine is not None]
    if points:
      ax.plot(*zip(*points), "o-", label=f"fragment {fragment}")
  ax.axhline(0, color="gray", lw=0.5)
  ax.set_xlabel("round")
  ax.set_ylabel("mean pairwise cosine of deltas")
  ax.set_title("learner agreement per round")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  paths.append(_save(fig, out, "cosine.png"))
  return paths


def goodput(metrics: list[dict[str, Any]], rounds: list[RoundRecord],
            names: list[str], fragments: int = 1) -> dict[str, dict[str, float | int | None]]:
  """Each learner's steps trained, steps that reached a committed aggregate, and idle
  fraction.

  Args:
    metrics: every record the learners logged, every attempt's (``gmjax.app.worker``),
      in the order each learner logged them.
    rounds: the run's round records (``Run.rounds()``).
    names: the learners.
    fragments: the run's fragments: each step is sent once with every fragment, so a
      round of one fragment carries ``1 / fragments`` of the steps it lists.

  Returns:
    ``{name: {"trained", "committed", "goodput", "idle"}}``: ``trained`` counts step
    records (a step trained again after a resume counts twice: it was trained twice),
    ``committed`` sums the learner's ``steps`` over the rounds' participants, divided by
    ``fragments`` (a step counts in full once all its fragments' rounds committed it),
    ``goodput``
    is ``committed / trained`` and ``idle`` the seconds blocked in the run (``blocked``
    of its records: join, pull and the wait for the job's learners, steps, close) over
    its wall time, each attempt from its join (``joined`` of its ``start``/``resume``
    record) to its ``closed`` record (or its last record, if it was stopped); None where
    the records do not tell.
  """
  stats = {}
  for name in names:
    trained, blocked, wall, begun, last = 0, 0.0, 0.0, None, None
    for record in (r for r in metrics if r.get("learner") == name):
      event, when = record.get("event"), record.get("time")
      if event in ("start", "resume"):
        if begun is not None:
          wall += last - begun
        begun = record.get("joined", when)
      trained += event == "step"
      blocked += record.get("blocked", 0.0)
      last = when
    if begun is not None:
      wall += last - begun
    committed = sum(p.steps for r in rounds for p in r.participants
                    if p.learner == name) / fragments
    stats[name] = {"trained": trained, "committed": committed,
                   "goodput": committed / trained if trained else None,
                   "idle": blocked / wall if wall > 0 else None}
  return stats


def plot_goodput(stats: dict[str, dict[str, Any]], out: str,
                 speeds: tuple[float, ...] | None = None) -> str:
  """Writes ``goodput.png`` into ``out`` from ``goodput(...)``: per learner, the steps
  trained against those that reached a committed aggregate, and the idle fraction."""
  names = sorted(stats)
  xs = np.arange(len(names))
  labels = [n if speeds is None else f"{n}\nspeed {speeds[i]:g}" for i, n in enumerate(names)]
  fig, (steps, idle) = plt.subplots(1, 2, figsize=(10, 4.5))
  steps.bar(xs - 0.2, [stats[n]["trained"] for n in names], 0.4, label="trained")
  steps.bar(xs + 0.2, [stats[n]["committed"] for n in names], 0.4,
            label="in committed aggregates")
  for x, n in zip(xs, names):
    if stats[n]["goodput"] is not None:
      steps.annotate(f"{stats[n]['goodput']:.0%}", (x + 0.2, stats[n]["committed"]),
                     ha="center", va="bottom", fontsize=8)
  steps.set_xticks(xs, labels)
  steps.set_ylabel("inner steps")
  steps.set_title("goodput: steps that reached a committed aggregate")
  steps.legend(fontsize=8)
  idle.bar(xs, [stats[n]["idle"] or 0.0 for n in names])
  idle.set_xticks(xs, labels)
  idle.set_ylim(0, 1)
  idle.set_ylabel("seconds blocked in the run / wall seconds")
  idle.set_title("idle fraction")
  for ax in (steps, idle):
    ax.grid(alpha=0.3, axis="y")
  return _save(fig, out, "goodput.png")


def _save(fig, out: str, name: str) -> str:
  path = os.path.join(out, name)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
