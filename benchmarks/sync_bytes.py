"""Bytes each learner sends per sync, read from the compiled step, against the learner count.

For ``M`` learners (one per fake CPU device, the ``"learner"`` axis of a shard_map) and a
model of ``n`` F32 parameters in one fragment, the step is compiled with its step counter
fixed to a sync step, so XLA drops the branches that step does not take (the first
update's broadcast among them) and the compiled step holds exactly the sync's
collectives; ``gmjax.transform.hlo.collective_bytes`` reads their bytes (ring model).
Figures are bytes per parameter per learner. Beside them, the formula of each layout:

* replicated, F32 deltas: one psum of ``(w·Δ, Δ/‖Δ‖)``: ``2·2(M−1)/M·4``;
* replicated, other precisions: an all-gather of the encoded deltas: ``(M−1)·b``;
* sharded: ``(M−1)/M·(b + b_publish)`` (all_to_all of deltas, all_gather of Θ or of the
  update at ``commit_precision``), plus ``O(M²)`` bytes of statistics;

with ``b`` the bytes per value of ``delta_precision`` (F32 4, BF16 2, F8_E4M3 1.125,
F4/I4 0.625, I2 0.375, block scales included), and, for reference, torchft's quantized
all-reduce ``2(M−1)/M·(n + 4R)/n`` (all_to_all, F32 reduce, all_gather of 8-bit values with
``R`` F32 scales; here ``R = n/32``, our block size) and a ring all-reduce of F32 values,
``2(M−1)/M·4``.

Run: .venv/bin/python benchmarks/sync_bytes.py [--learners 2 4 8] [--formula 16 64]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
import inmesh
from gmjax.transform import hlo

SHAPES = {"w": (1024, 1024), "v": (4000,)}
BYTES_PER_VALUE = {None: 4.0, "F32": 4.0, "F16": 2.0, "BF16": 2.0, "F8_E4M3": 1.125,
                   "F4": 0.625, "I4": 0.625, "I2": 0.375}
VARIANTS = [(None, None), ("BF16", None), ("F8_E4M3", None), ("F4", None), ("I4", None),
            ("F8_E4M3", "F8_E4M3"), ("I4", "BF16"), ("I2", "I2")]


def formula(layout: str, delta, commit, m: int) -> float:
  """Bytes per parameter per learner per sync that ``layout`` should send (F32 params)."""
  b = BYTES_PER_VALUE[delta]
  if layout == "sharded":
    return (m - 1) / m * (b + BYTES_PER_VALUE[commit])
  return 2 * 2 * (m - 1) / m * 4 if b == 4 else (m - 1) * b


def torchft(m: int) -> float:
  return 2 * (m - 1) / m * (1 + 4 / 32)


def f32_all_reduce(m: int) -> float:
  return 2 * (m - 1) / m * 4


def measure(m: int, delta, commit, diloco_kwargs) -> tuple[float, dict]:
  """(bytes per parameter sent per learner in one sync, bytes by element type)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:m]), ("learner",))
  config = gmjax.DiLoCo(sync_every=4, delta_precision=delta, commit_precision=commit)
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner", **diloco_kwargs)
  sharding = NamedSharding(mesh, P("learner"))
  params = {k: jax.ShapeDtypeStruct((m, *s), jnp.float32, sharding=sharding)
            for k, s in SHAPES.items()}
  state = jax.eval_shape(inmesh.learner_init(optimizer, mesh), params)
  # The state's count before the update at step t is t - 1: this update syncs.
  sync = config.schedule(1).step_of(0)
  step = inmesh.learner_step(optimizer, mesh, count=sync - 1)
  found = hlo.collective_bytes(step.lower(params, state, params).compile().as_text())
  n = sum(math.prod(s) for s in SHAPES.values())
  by_type = {}
  for c in found:
    by_type[c.dtype] = by_type.get(c.dtype, 0.0) + c.bytes_sent / n
  return hlo.total_bytes_sent(found) / n, by_type


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--learners", type=int, nargs="+", default=[2, 4, 8])
  parser.add_argument("--formula", type=int, nargs="+", default=[16, 64])
  args = parser.parse_args()
  inmesh.fake_cpu_devices(max(args.learners))  # before JAX's first use of a device
  n = sum(math.prod(s) for s in SHAPES.values())
  print(f"jax {jax.__version__}, {n} F32 parameters in one fragment; bytes per parameter"
        " sent per learner per sync (measured / formula)")
  ms = args.learners + args.formula
  header = " | ".join(f"M={m}" for m in ms)
  print(f"| delta, commit | layout | {header} |")
  print("| --- | --- |" + " --- |" * len(ms))
  for delta, commit in VARIANTS:
    for layout, kwargs in inmesh.layouts():
      cells, types = [], set()
      for m in args.learners:
        got, by_type = measure(m, delta, commit, kwargs)
        types |= {t for t, v in by_type.items() if v > 1e-3}
        cells.append(f"{got:.3f} / {formula(layout, delta, commit, m):.3f}")
      cells += [f"{formula(layout, delta, commit, m):.3f}" for m in args.formula]
      print(f"| {delta}, {commit} | {layout} ({'+'.join(sorted(types))}) | "
            + " | ".join(cells) + " |")
  print("| torchft 2(M−1)/M·(n+4R), R=n/32 | | "
        + " | ".join(f"{torchft(m):.3f}" for m in ms) + " |")
  print("| F32 ring all-reduce 2(M−1)/M·4n | | "
        + " | ".join(f"{f32_all_reduce(m):.3f}" for m in ms) + " |")


if __name__ == "__main__":
  main()
