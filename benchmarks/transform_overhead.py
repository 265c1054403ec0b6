"""Step-time overhead of ``gmjax.diloco`` against its plain inner optimizer, in one run.

A small MLP (about 2.1M F32 parameters) trains with ``jit(optax.adamw)`` and with
``jit(gmjax.diloco(optax.adamw, config))`` (one learner, ``axis_name=None``), each step
computing the loss gradient, the optimizer update and ``apply_updates``. Every variant
runs twice: with the parameters and optimizer state donated to the step (as training
loops do), and without donation; each ratio is against ``optax.adamw`` run the same way.
Each figure is the median over repetitions of the mean step time of a window of
``sync_every`` steps (so the window holds every fragment's sync once), after a warm-up
window (compilation); ``--sync-every`` far above the window count measures steps
without any sync. ``temp`` is the compiled step's scratch memory, which XLA on CPU
allocates on every call: a rarely taken branch that needs more of it slows every step.

Run: .venv/bin/python benchmarks/transform_overhead.py [--repeats N] [--sync-every H]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import gmjax

WIDTHS = (512, 1024, 1024, 512)
BATCH = 64


def init_mlp(key):
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
    key, sub = jax.random.split(key)
    params[f"layer{i}"] = {
        "w": jax.random.normal(sub, (fan_in, fan_out), jnp.float32) / fan_in**0.5,
        "b": jnp.zeros((fan_out,), jnp.float32),
    }
  return params


def loss_fn(params, x, y):
  h = x
  for i in range(len(WIDTHS) - 1):
    layer = params[f"layer{i}"]
    h = h @ layer["w"] + layer["b"]
    if i < len(WIDTHS) - 2:
      h = jax.nn.gelu(h)
  return jnp.mean(jnp.square(h - y))


def make_step(optimizer, donate=True):
  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


class Trainer:
  """A jitted training step of ``optimizer`` on the MLP, with its own params and state."""

  def __init__(self, optimizer, donate=True):
    self.params = init_mlp(jax.random.PRNGKey(0))
    self.state = optimizer.init(self.params)
    self.x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, WIDTHS[0]))
    self.y = jax.random.normal(jax.random.PRNGKey(2), (BATCH, WIDTHS[-1]))
    self.step = make_step(optimizer, donate)

  def temp_bytes(self):
    """Scratch bytes of the compiled step."""
    compiled = self.step.lower(self.params, self.state, self.x, self.y).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  def window(self, steps):
    """Mean seconds per step over ``steps`` steps."""
    start = time.perf_counter()
    for _ in range(steps):
      self.params, self.state = self.step(self.params, self.state, self.x, self.y)
    jax.block_until_ready((self.params, self.state))
    return (time.perf_counter() - start) / steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--sync-every", type=int, default=50)
  args = parser.parse_args()
  n = sum(p.size for p in jax.tree.leaves(init_mlp(jax.random.PRNGKey(0))))
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({platform.machine()}),"
        f" MLP {WIDTHS}, {n / 1e6:.2f}M params, batch {BATCH},"
        f" window {args.sync_every} steps, median of {args.repeats}")
  inner = lambda: optax.adamw(1e-3)
  variants = {
      "optax.adamw": inner,
      "diloco P=1 F32": lambda: gmjax.diloco(inner(), gmjax.DiLoCo(
          sync_every=args.sync_every)),
      "diloco P=4 I4 tau=2 mix=.5": lambda: gmjax.diloco(inner(), gmjax.DiLoCo(
          sync_every=args.sync_every, fragments=4, delta_precision="I4",
          overlap_steps=2, mixing=0.5)),
  }
  trainers = {
      (label, donate): Trainer(make(), donate)
      for donate in (True, False) for label, make in variants.items()
  }
  for trainer in trainers.values():
    trainer.window(args.sync_every)  # compiles
  # Windows interleave, so a change in machine load moves every variant alike.
  seconds = {key: [] for key in trainers}
  for _ in range(args.repeats):
    for key, trainer in trainers.items():
      seconds[key].append(trainer.window(args.sync_every))
  for (label, _), trainer in trainers.items():
    if trainer.step._cache_size() != 1:
      raise RuntimeError(f"{label}: the step compiled {trainer.step._cache_size()} times")
  for (label, donate), times in seconds.items():
    base = seconds["optax.adamw", donate]
    ratio = statistics.median(t / b for t, b in zip(times, base))
    temp = trainers[label, donate].temp_bytes() / 2**20
    print(f"  {label:28s} {'donated' if donate else 'copied ':8s}"
          f" {statistics.median(times) * 1e3:8.3f} ms/step  {ratio:.2f}x"
          f"  temp {temp:6.1f} MiB")

if __name__ == "__main__":
  main()
