"""Step-time overhead of ``gmjax.diloco`` against its plain inner optimizer, in one run.

A small MLP (about 2.6M F32 parameters) trains with ``jit(optax.adamw)`` and with
``jit(gmjax.diloco(optax.adamw, config))`` (one learner, ``axis_name=None``), each step
computing the loss gradient, the optimizer update and ``apply_updates``, with the
parameters and optimizer state donated. Each figure is the median over repetitions of
the mean step time of a window of ``sync_every`` steps (so the window holds every
fragment's sync once), after a warm-up window (compilation).

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


def make_step(optimizer):
  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


class Trainer:
  """A jitted training step of ``optimizer`` on the MLP, with its own params and state."""

  def __init__(self, optimizer):
    self.params = init_mlp(jax.random.PRNGKey(0))
    self.state = optimizer.init(self.params)
    self.x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, WIDTHS[0]))
    self.y = jax.random.normal(jax.random.PRNGKey(2), (BATCH, WIDTHS[-1]))
    self.step = make_step(optimizer)

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
  trainers = {
      "optax.adamw": Trainer(inner()),
      "diloco P=1 F32": Trainer(gmjax.diloco(inner(), gmjax.DiLoCo(
          sync_every=args.sync_every))),
      "diloco P=4 I4 tau=2 mix=.5": Trainer(gmjax.diloco(inner(), gmjax.DiLoCo(
          sync_every=args.sync_every, fragments=4, delta_precision="I4",
          overlap_steps=2, mixing=0.5))),
  }
  for trainer in trainers.values():
    trainer.window(args.sync_every)  # compiles
  # Windows interleave, so a change in machine load moves every variant alike.
  seconds = {label: [] for label in trainers}
  for _ in range(args.repeats):
    for label, trainer in trainers.items():
      seconds[label].append(trainer.window(args.sync_every))
  for label, trainer in trainers.items():
    if trainer.step._cache_size() != 1:
      raise RuntimeError(f"{label}: the step compiled {trainer.step._cache_size()} times")
  base = seconds["optax.adamw"]
  for label, times in seconds.items():
    ratio = statistics.median(t / b for t, b in zip(times, base))
    print(f"  {label:28s} {statistics.median(times) * 1e3:8.3f} ms/step  {ratio:.2f}x")


if __name__ == "__main__":
  main()
