"""Convergence and bytes: DiLoCo learners against synchronous data-parallel training.

Runs the demo job (``gmjax train``) for a config and reports, from that one run, the
final validation loss of each DiLoCo learner and of the data-parallel baseline (same
model, same data, same inner optimizer, same number of inner steps), their ratio, and the
bytes each learner sent under each scheme.
Run: ``.venv/bin/python benchmarks/convergence.py configs/quickstart.toml``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import gmjax
from gmjax.app import config as config_lib
from gmjax.app import model
from gmjax.app.train import _bytes_sent, train


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("config", nargs="?", default="configs/quickstart.toml")
  parser.add_argument("--out", default="runs/benchmark-convergence")
  args = parser.parse_args()
  cfg = dataclasses.replace(config_lib.load(args.config), out=args.out, baseline=True)
  summary = train(cfg, show_progress=False)
  _, params = model.build(cfg.model, seed=cfg.seed)
  rounds = gmjax.mail.open(summary["run"]).rounds()
  sent = {label: series[-1][1] for label, series in _bytes_sent(cfg, params, rounds).items()}
  losses = dict(summary["final_val_loss"])
  baseline = losses.pop("baseline")
  print(f"config {args.config}: {cfg.learners} learners x {cfg.steps} steps, "
        f"{sum(p.size for p in gmjax.Schema.from_tree(params)) / 1e6:.2f}M parameters,"
        f" {summary['rounds']} rounds, mean cosine {summary['mean_cosine']:.3f}")
  print(f"{'':>28} {'val loss':>9} {'/ baseline':>11}")
  print(f"{'data-parallel baseline':>28} {baseline:>9.4f} {1.0:>11.3f}")
  for name, value in losses.items():
    print(f"{'DiLoCo ' + name:>28} {value:>9.4f} {value / baseline:>11.3f}")
  (dp_label, dp), = [(k, v) for k, v in sent.items() if "all-reduce" in k]
  for label, value in sent.items():
    print(f"{label:>45}: {value / 2**20:9.3f} MiB per learner ({dp / value:7.1f}x less than all-reduce)")
  print(f"wall: DiLoCo {summary['diloco_seconds']} s (learners in parallel processes),"
        f" baseline {summary['baseline_seconds']} s (one process)")
  print(json.dumps({"losses": summary["final_val_loss"], "bytes": sent}))


if __name__ == "__main__":
  main()
