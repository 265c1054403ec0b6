"""Per-learner bytes of ``gmjax.diloco``'s state for a 100M-parameter bf16 model, by layout.

Compile only, nothing is trained or allocated: for each learner count ``M`` a fresh
process asks XLA for ``M`` fake CPU devices, builds the state's shapes with
``jax.eval_shape`` of ``optimizer.init`` under ``shard_map`` (one learner per device), and
compiles the training step (``optax.sgd`` inner, so the inner optimizer holds no state)
for ``memory_analysis``. "array bytes" are the sizes of one learner's state arrays by
field of the state; the outer state is everything but the inner state, the anchor Θ
(which a learner needs to form its delta) and the counters. "compiled" is the
compiled step's per-device arguments (parameters, state and gradients), outputs and
scratch, from ``memory_analysis``. The reference under the table is data-parallel
adamw's step on the same model and mesh (its gradients ``pmean``-ed, the same
``shard_map``): its scratch plus the model's F32 bytes is what a sync may add to. (With
``optax.adamw`` as the inner optimizer instead of ``optax.sgd`` the compiled scratch of
``gmjax.diloco``'s step is the same.)

Run: .venv/bin/python benchmarks/outer_state_memory.py [--learners 2 8 64]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
import inmesh

# 24 matrices of 1024×4096 and two vectors whose sizes are no multiple of 32·M.
SHAPES = {**{f"layer{i:02d}": (1024, 4096) for i in range(24)},
          "norm": (1000,), "bias": (4099,)}
NOT_OUTER = ("inner_state", "anchor", "count", "pending", "tokens", "stats")


def measure(m: int) -> tuple[list[dict], int]:
  """Per-learner bytes for each layout, with ``m`` learners (needs ``m`` devices), and
  data-parallel adamw's scratch bytes."""

  mesh = jax.make_mesh((m,), ("learner",))
  sharding = NamedSharding(mesh, P("learner"))
  params = {k: jax.ShapeDtypeStruct((m, *s), jnp.bfloat16, sharding=sharding)
            for k, s in SHAPES.items()}
  rows = []
  for layout, kwargs in inmesh.layouts():
    optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=50),
                             axis_name="learner", **kwargs)
    state = jax.eval_shape(inmesh.learner_init(optimizer, mesh), params)
    fields = {}
    for field in state._fields:
      leaves = jax.tree.leaves(getattr(state, field))
      # Every leaf carries the learner dimension; one learner holds 1/M of it.
      fields[field] = sum(x.size * x.dtype.itemsize for x in leaves) // m
    step = inmesh.learner_step(optimizer, mesh, donate=True)
    memory = step.lower(params, state, params).compile().memory_analysis()
    rows.append(dict(
        layout=layout, learners=m, fields=fields,
        outer=sum(v for k, v in fields.items() if k not in NOT_OUTER),
        arguments=memory.argument_size_in_bytes, outputs=memory.output_size_in_bytes,
        temp=memory.temp_size_in_bytes,
    ))
  return rows, _data_parallel_temp(mesh, params)


def _data_parallel_temp(mesh, params) -> int:
  """Scratch bytes of data-parallel adamw's donated step (gradients ``pmean``-ed)."""
  mean = optax.stateless(lambda grads, params: jax.lax.pmean(grads, "learner"))
  adamw = optax.chain(mean, optax.adamw(1e-3))
  state = jax.eval_shape(inmesh.learner_init(adamw, mesh), params)
  step = inmesh.learner_step(adamw, mesh, donate=True)
  return step.lower(params, state, params).compile().memory_analysis().temp_size_in_bytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--learners", type=int, nargs="+", default=[2, 8, 64])
  parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # in a child process
  args = parser.parse_args()
  if args.one:
    inmesh.fake_cpu_devices(args.one)
    print(json.dumps(measure(args.one)))
    return
  n = sum(math.prod(s) for s in SHAPES.values())
  print(f"{n / 1e6:.2f}M bf16 parameters ({2 * n / 2**20:.0f} MiB); MiB per learner")
  print("| M | layout | outer state (fields) | anchor | compiled: arguments"
        " | outputs | temp |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  mib = lambda b: f"{b / 2**20:.1f}"
  references = []
  for m in args.learners:
    out = subprocess.run([sys.executable, __file__, "--one", str(m)], check=True,
                         capture_output=True, text=True).stdout
    rows, reference = json.loads(out.strip().splitlines()[-1])
    references.append(f"M = {m}: {mib(reference)}")
    for row in rows:
      outer = ", ".join(f"{k} {mib(v)}" for k, v in row["fields"].items()
                        if k not in NOT_OUTER and v)
      print(f"| {m} | {row['layout']} | {mib(row['outer'])} ({outer})"
            f" | {mib(row['fields']['anchor'])} | {mib(row['arguments'])}"
            f" | {mib(row['outputs'])} | {mib(row['temp'])} |")
  print(f"\nData-parallel adamw's scratch (MiB per device): {', '.join(references)};"
        f" the parameters' F32 bytes: {mib(4 * n)} MiB.")


if __name__ == "__main__":
  main()
