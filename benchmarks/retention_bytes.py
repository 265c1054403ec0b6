"""Bytes on storage of a run that keeps its newest versions, against the README's formula.

Two learners train a model of ``--params`` F32 parameters in two fragments with F8
deltas for ``--rounds`` rounds, keeping ``--keep-versions`` versions of each fragment;
the bytes under the run are sampled after every commit and compared with

  K · N · (2·b + s + L·d)        (b = 4, s = 4, d = 1 + 4/32 for F32, SGD, F8)

plus what does not scale with N (records, Orbax's metadata, heartbeats).

Run:  .venv/bin/python benchmarks/retention_bytes.py --params 2000000 --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np

from chaos import usage  # the same count of objects and bytes as the chaos run


def main() -> None:
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.core.codec import BLOCK  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=int, default=2_000_000)
  parser.add_argument("--rounds", type=int, default=40)
  parser.add_argument("--learners", type=int, default=2)
  parser.add_argument("--keep-versions", type=int, default=4)
  args = parser.parse_args()
  half = args.params // 2
  params = {"a": np.zeros((half,), np.float32), "b": np.zeros((args.params - half,), np.float32)}
  config = gmjax.DiLoCo(sync_every=2, fragments=2, delta_precision="F8_E4M3",
                        quorum_size=args.learners)
  url = os.path.join(tempfile.mkdtemp(prefix="gmjax-retention-"), "run")
  run = gmjax.mail.create(url, params, config, keep_versions=args.keep_versions)
  samples = []
  steps = args.rounds  # two fragments, sync_every 2: one round a step

  def learner(index: int) -> None:
    rng = np.random.default_rng(index)
    with run.join(f"l{index}", poll_interval=0.02) as member:
      current = member.pull(params)
      for _ in range(steps):
        current = {k: v - 1e-3 * rng.standard_normal(v.shape).astype(np.float32)
                   for k, v in current.items()}
        current = member.step(current, tokens=1)

  threads = [threading.Thread(target=learner, args=(i,)) for i in range(args.learners)]
  started = time.monotonic()
  for thread in threads:
    thread.start()
  while any(t.is_alive() for t in threads):
    newest = sum(run.newest_versions().values())
    samples.append((newest, *usage(url)))
    time.sleep(0.2)
  for thread in threads:
    thread.join()
  samples.append((sum(run.newest_versions().values()), *usage(url)))
  k, n, l = args.keep_versions, args.params, args.learners
  per_parameter = 2 * 4 + 4 + l * (1 + 4 / BLOCK)
  formula = k * n * per_parameter
  late = [b for v, _, b in samples if v >= 2 * (k + 1)]
  print(json.dumps({
      "parameters": n, "learners": l, "keep_versions": k, "rounds_kept": len(run.rounds()),
      "versions": run.newest_versions(), "seconds": round(time.monotonic() - started, 1),
      "formula_bytes": int(formula), "bytes_per_parameter_per_version": per_parameter,
      "max_bytes_once_pruning": max(late) if late else None,
      "end_objects": samples[-1][1], "end_bytes": samples[-1][2],
      "max_over_formula": round(max(late) / formula, 3) if late else None,
  }, indent=1))
  shutil.rmtree(os.path.dirname(url))  # the run, measured: nothing left in the temp folder


if __name__ == "__main__":
  main()
