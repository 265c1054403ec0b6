"""PNG plots of a demo run: loss against the baseline, bytes sent, cosine per round."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np


def _smooth(values: list[float], window: int = 10) -> np.ndarray:
  values = np.asarray(values, np.float64)
  if values.size < window:
    return values
  kernel = np.ones(window) / window
  head = np.cumsum(values[: window - 1]) / np.arange(1, window)
  return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def plot_all(metrics: list[dict[str, Any]], rounds: list[dict[str, Any]],
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
  for fragment in sorted({r["fragment"] for r in rounds}):
    points = [(r["round"], r["cosine"]) for r in rounds
              if r["fragment"] == fragment and r.get("cosine") is not None]
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


def _save(fig, out: str, name: str) -> str:
  path = os.path.join(out, name)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
