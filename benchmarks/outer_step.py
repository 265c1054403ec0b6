"""The outer step: closing a round of a 16M-parameter fragment, as ratios in one run.

Measures ``DiLoCoAggregator.close_round`` (decode M deltas, weighted mean, Nesterov step,
publish Θ) against a plain memory copy of the fragment's F32 bytes and against the same
arithmetic written in numpy. Run: ``.venv/bin/python benchmarks/outer_step.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import gmjax
from gmjax.core.aggregator import DiLoCoAggregator
from gmjax.core.records import Contribution
from gmjax.core.wire import Wire


def timed(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def numpy_outer(theta, momentum, deltas, weights, lr=0.7, mu=0.9):
  g = sum(np.float32(w) * d for w, d in zip(weights, deltas))
  u = mu * momentum + g
  return theta - lr * (g + mu * u), u


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--params", type=int, default=16 * 2**20)
  parser.add_argument("--learners", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  n = args.params // 4
  params = {f"w{i}": rng.standard_normal((n // 1024, 1024), np.float32) for i in range(4)}
  schema = gmjax.Schema.from_tree(params)
  flat = np.concatenate([v.ravel() for v in params.values()])
  copy_time = timed(lambda: flat.copy(), args.repeats * 2)
  print(f"{args.params / 1e6:.1f}M parameters, {args.learners} learners;"
        f" memory copy of the F32 bytes: {copy_time * 1e3:.1f} ms")
  print(f"{'delta precision':>16} {'close_round ms':>15} {'x copy':>8} {'numpy ms':>9} {'x numpy':>8}")
  for precision in (None, "BF16", "F8_E4M3", "I4"):
    config = gmjax.DiLoCo(sync_every=10, delta_precision=precision)
    aggregator = DiLoCoAggregator(config, schema)
    state = aggregator.initial_state(params)
    deltas = [{k: (rng.standard_normal(v.shape, np.float32) * 1e-3) for k, v in params.items()}
              for _ in range(args.learners)]
    contributions = [
        Contribution(f"l{m}", 10, 10, 100, 0.1, False,
                     {k: np.asarray(v) for k, v in Wire(precision).encode(d, schema).items()})
        for m, d in enumerate(deltas)
    ]
    aggregator.close_round(state, contributions)  # compile
    seconds = timed(lambda: aggregator.close_round(state, contributions), args.repeats)
    weights = [0.25] * args.learners
    ref = timed(lambda: [numpy_outer(params[k], state.outer[f"momentum.{k}"],
                                     [d[k] for d in deltas], weights) for k in params], args.repeats)
    print(f"{str(precision):>16} {seconds * 1e3:>15.1f} {seconds / copy_time:>8.1f}"
          f" {ref * 1e3:>9.1f} {seconds / ref:>8.2f}")


if __name__ == "__main__":
  main()
