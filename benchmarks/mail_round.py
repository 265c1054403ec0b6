"""Per-round overhead of mail mode on a local run: publish to commit applied.

M learners (threads of one process) train a model of N float32 parameters with a trivial
inner step, over a run in a local directory, with ``overlap_steps=0``: at each sync step a
learner publishes its delta and waits for the commit. For every round this reports the
time from the last learner's publish to the moment every learner has the commit applied
(returned from ``step``), and the closer's own timings from the round record.

Run:  .venv/bin/python benchmarks/mail_round.py --params 10000000 --learners 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import gmjax
from gmjax import mail


def model(parameters: int, leaves: int = 4) -> dict[str, jax.Array]:
  size = parameters // leaves
  rng = np.random.default_rng(0)
  return {f"layer{i}/w": jnp.asarray(rng.normal(size=(size,)).astype(np.float32))
          for i in range(leaves)}


@jax.jit
def inner_step(params, scale):
  return jax.tree.map(lambda p: p * (1.0 - 1e-3 * scale), params)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=int, default=10_000_000)
  parser.add_argument("--learners", type=int, default=4)
  parser.add_argument("--sync-every", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--poll", type=float, default=0.01)
  parser.add_argument("--delta-precision", default=None)
  parser.add_argument("--commit-precision", default=None,
                      help="e.g. F8_E4M3: commits carry the update at this precision")
  parser.add_argument("--dir", default=None, help="run directory (default: a temporary one)")
  args = parser.parse_args()

  params = model(args.params)
  config = gmjax.DiLoCo(sync_every=args.sync_every, quorum_size=args.learners,
                        delta_precision=args.delta_precision,
                        commit_precision=args.commit_precision)
  root = args.dir or tempfile.mkdtemp(prefix="gmjax-bench-")
  url = f"{root}/run"
  mail.create(url, params, config, keep_versions=None)  # the table reads every round
  steps = args.sync_every * args.rounds
  published: dict[tuple[str, int], float] = {}
  applied: dict[tuple[str, int], float] = {}
  plain: list[float] = []
  errors: list[BaseException] = []

  def learner_loop(index: int) -> None:
    try:
      learner = mail.open(url).join(f"l{index}", poll_interval=args.poll)
      local = learner.pull(params)
      scale = jnp.float32(index + 1)
      for step in range(1, steps + 1):
        local = inner_step(local, scale)
        jax.block_until_ready(local)
        start = time.perf_counter()
        local = learner.step(local)
        jax.block_until_ready(local)
        end = time.perf_counter()
        if step % args.sync_every == 0:
          published[(learner.name, step)] = start
          applied[(learner.name, step)] = end
        else:
          plain.append(end - start)
      learner.close(local)
    except BaseException as error:  # pylint: disable=broad-except
      errors.append(error)

  started = time.perf_counter()
  threads = [threading.Thread(target=learner_loop, args=(i,)) for i in range(args.learners)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  wall = time.perf_counter() - started

  run = mail.open(url)
  records = {r.step: r for r in run.rounds()}
  rows = []
  for step in range(args.sync_every, steps + 1, args.sync_every):
    last_publish = max(published[(f"l{i}", step)] for i in range(args.learners))
    all_applied = max(applied[(f"l{i}", step)] for i in range(args.learners))
    record = records[step]
    rows.append({
        "round": record.round,
        "publish_to_applied_s": round(all_applied - last_publish, 4),
        "closer_sync_s": round(record.sync_seconds, 4),
        "participants": len(record.participants),
    })
  overheads = [r["publish_to_applied_s"] for r in rows]
  steady = overheads[1:] or overheads  # round 0 includes jit compilation
  summary = {
      "parameters": sum(int(v.size) for v in params.values()),
      "learners": args.learners,
      "sync_every": args.sync_every,
      "delta_precision": args.delta_precision,
      "commit_precision": args.commit_precision,
      "rounds": rows,
      "median_publish_to_applied_s": round(statistics.median(steady), 4),
      "median_closer_sync_s": round(statistics.median(r["closer_sync_s"] for r in rows[1:] or rows), 4),
      "median_plain_step_overhead_ms": round(1e3 * statistics.median(plain), 3),
      "wall_s": round(wall, 2),
      "run": url,
  }
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  main()
