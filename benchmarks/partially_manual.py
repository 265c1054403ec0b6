"""The exchange's collectives under ``shard_map`` with only the learners' axis manual.

``gmjax.diloco`` on a ``(learner=M, fsdp=2)`` mesh of fake CPU devices with Auto axes,
stepped as ``jit(shard_map(step, axis_names={"learner"}))`` (XLA partitions ``fsdp``):
one leaf of ``n`` F32 parameters a learner, its rows split over ``fsdp``, one fragment
synced every 2 steps. The step is compiled at a sync step (the step count folded in, so
the program holds that step's exchange alone; nothing is run) and the script prints,
for each ``M`` and outer-step layout, the collective instructions of the compiled step
by op (a tuple collective counts once), the bytes each device sends per sync (the ring
model of ``gmjax.transform.hlo``; a collective inside a loop counts once per turn, which
it reads from the loop's trip count, ``M − 1`` for the ring of ``all_gather``) and what
one learner's two devices send together against the bound
``(M−1)/M · (b_delta + b_publish) · n`` (sharded) of the README's table, and whether
any all-gather spans ``fsdp``.

Run: .venv/bin/python benchmarks/partially_manual.py [--learners 2 4 8] [--precision F8_E4M3]
"""

from __future__ import annotations

import argparse
import collections

import inmesh

FSDP = 2
BYTES = {None: 4.0, "F32": 4.0, "BF16": 2.0, "F8_E4M3": 1.125, "I4": 0.625, "I2": 0.375}


def compiled(learners: int, precision: str | None, shard_outer: bool, size: int,
             explicit: bool = False):
  """The compiled text of the sync step, and its mesh (Auto axes, or Explicit)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import gmjax

  config = gmjax.DiLoCo(sync_every=2, delta_precision=precision)
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner",
                           shard_outer=shard_outer)
  mesh = jax.make_mesh((learners, FSDP), ("learner", "fsdp"),
                       axis_types=(AxisType.Explicit if explicit else AxisType.Auto,) * 2,
                       devices=jax.devices()[:learners * FSDP])
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)
  stack = lambda tree: jax.tree.map(lambda a: a[None], tree)

  def step(params, state, grads):
    params, state, grads = first((params, state, grads))
    state = state._replace(count=jnp.asarray(1, state.count.dtype))  # t = 2: a sync
    updates, state = optimizer.update(grads, state, params)
    return stack((optax.apply_updates(params, updates), state))

  manual = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("learner"),
                                           out_specs=P("learner"),
                                           axis_names={"learner"}))
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(jnp.ones((learners, size // 64, 64), jnp.float32),
                                  NamedSharding(mesh, P("learner", "fsdp")))}
    state = manual(lambda p: stack(optimizer.init(first(p))))(params)
    text = manual(step).lower(params, state, params).compile().as_text()
  return text, mesh


def measure(learners: int, precision: str | None, shard_outer: bool, size: int) -> dict:
  from gmjax.transform import hlo

  text, mesh = compiled(learners, precision, shard_outer, size)
  found = hlo.collective_bytes(text)
  trips = hlo.trip_counts(text)
  ops = collections.Counter()
  for name, op in {(c.name, c.op) for c in found}:
    ops[op] += 1
  sent = sum(c.bytes_sent * trips.get(c.computation, 1) for c in found)
  fsdp_gathers = [c for c in found if c.op == "all-gather" and any(
      hlo.spanned_axes(mesh, g) - {"learner"} for g in c.groups)]
  return {"ops": dict(ops), "count": sum(ops.values()), "sent": sent,
          "fsdp_gathers": len(fsdp_gathers)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--learners", type=int, nargs="+", default=[2, 4, 8])
  parser.add_argument("--precision", default="F8_E4M3")
  parser.add_argument("--size", type=int, default=8192, help="n, parameters a learner")
  args = parser.parse_args()
  inmesh.fake_cpu_devices(FSDP * max(args.learners))
  import jax

  precision = None if args.precision in ("None", "F32") else args.precision
  print(f"jax {jax.__version__}, n = {args.size}, delta {args.precision}, Θ F32")
  print("| M | layout | collectives | by op | bytes / device | learner / bound | "
        "fsdp gathers |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for learners in args.learners:
    for layout, shard_outer in (("sharded", True), ("replicated", False)):
      row = measure(learners, precision, shard_outer, args.size)
      bound = (learners - 1) / learners * (BYTES[precision] + 4.0) * args.size
      ops = ", ".join(f"{op} {n}" for op, n in sorted(row["ops"].items()))
      ratio = f"{FSDP * row['sent'] / bound:.3f}" if shard_outer else "-"
      print(f"| {learners} | {layout} | {row['count']} | {ops} | {row['sent']:.0f} | "
            f"{ratio} | {row['fsdp_gathers']} |")


if __name__ == "__main__":
  main()
