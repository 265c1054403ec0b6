"""What a rarely taken branch's scratch memory costs every step on CPU, in one run.

``gmjax.diloco``'s step holds its rounds under ``lax.cond``: they run once every many
steps, but XLA sizes the compiled step's scratch (``memory_analysis().temp_size_in_bytes``)
for its largest branch, and XLA:CPU allocates that scratch on every call. This probe
isolates the effect: the MLP of ``transform_overhead.py`` trains with ``optax.adamw``
whose updates cross a ``lax.cond`` that is never taken, and whose untaken branch needs
``k`` more parameter-sized F32 buffers (``k`` sorted copies of the flattened
parameters); ``k = 0`` is the ``cond`` alone. Each ratio is against ``k = 0``, the
variants interleaved, median over repetitions of a window's mean step time, donated.
Run it with and without ``GLIBC_TUNABLES`` (e.g.
``glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296``,
which keeps freed memory for reuse) to see the allocator's part.

Run: .venv/bin/python benchmarks/scratch_cost.py [--repeats N] [--window STEPS]
"""

from __future__ import annotations

import argparse
import platform
import statistics

import jax
import jax.numpy as jnp
import optax

import transform_overhead


class RareScratch:
  """``optax.adamw`` whose updates cross a ``lax.cond`` whose rare branch needs
  ``buffers`` parameter-sized F32 temporaries (it is never taken here)."""

  def __init__(self, buffers):
    self.tx = optax.adamw(1e-3)
    self.buffers = buffers

  def init(self, params):
    return self.tx.init(params), jnp.zeros([], jnp.int32)

  def update(self, grads, state, params):
    inner, count = state
    updates, inner = self.tx.update(grads, inner, params)

    def rare(updates, params):
      flat = jnp.concatenate([x.ravel() for x in jax.tree.leaves(params)])
      # Sorting keeps each copy whole (XLA cannot fuse it away).
      copies = [jnp.sort(flat * (i + 1)) for i in range(self.buffers)]
      shift = sum((c[0] for c in copies), jnp.zeros([], jnp.float32))
      return jax.tree.map(lambda u: u + shift, updates)

    taken = count < 0  # never, but XLA cannot know
    updates = jax.lax.cond(taken, rare, lambda u, p: u, updates, params)
    return updates, (inner, count + 1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--window", type=int, default=100)
  args = parser.parse_args()
  trainers = {k: transform_overhead.Trainer(RareScratch(k)) for k in (0, 1, 2, 3)}
  n = sum(p.size for p in jax.tree.leaves(trainers[0].params))
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({platform.machine()}),"
        f" MLP {transform_overhead.WIDTHS}, {n / 1e6:.2f}M params, window {args.window}"
        f" steps, median of {args.repeats}")
  for trainer in trainers.values():
    trainer.window(10)  # compiles
  seconds = {k: [] for k in trainers}
  for _ in range(args.repeats):
    for k, trainer in trainers.items():
      seconds[k].append(trainer.window(args.window)[0])  # the wall clock
  for k, times in seconds.items():
    ratio = statistics.median(t / b for t, b in zip(times, seconds[0]))
    temp = trainers[k].temp_bytes() / 2**20
    print(f"  rare branch with {k} more buffers  {statistics.median(times) * 1e3:8.3f} ms/step"
          f"  {ratio:.2f}x  temp {temp:6.1f} MiB")


if __name__ == "__main__":
  main()
