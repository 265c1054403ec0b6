"""A learner process that keeps its state in a state_dir, for tests/test_mail_restart.py.

Usage: mail_restart_worker.py URL NAME STATE_DIR STEPS PAUSE_AT OUT. It trains a linear
model with Adam (a decaying learning rate) on batches that its data position numbers,
hands ``learner.step`` its optimizer state and position, and restores both when
STATE_DIR (``-`` for none) holds a saved state. After PAUSE_AT steps of this process
(``-1``: never) it prints ``paused`` and waits to be killed; after STEPS it closes and
saves its parameters to OUT (``.npz``).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gmjax

POLL = 0.02


def params0():
  return {"w": np.zeros((8, 4), np.float32), "b": np.zeros((4,), np.float32)}


def batch(position: int):
  """The batch at data position ``position``: the same wherever a process starts."""
  rng = np.random.default_rng(1000 + position)
  x = rng.standard_normal((16, 8)).astype(np.float32)
  y = x @ np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4) + 0.5
  return x, y


optimizer = optax.adam(optax.linear_schedule(0.05, 0.005, 12))


@jax.jit
def train_step(params, opt_state, x, y):
  def loss(p):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
  grads = jax.grad(loss)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def main():
  url, name, state_dir, steps, pause_at, out = sys.argv[1:7]
  steps, pause_at = int(steps), int(pause_at)
  state_dir = None if state_dir == "-" else state_dir
  run = gmjax.mail.open(url)
  learner = run.join(name, poll_interval=POLL, wait_timeout=60.0, state_dir=state_dir)
  params = learner.pull(params0())
  opt_state, position = optimizer.init(params), 0
  if state_dir is not None:
    restored = learner.restore(opt_state)
    if restored is not None:
      opt_state, position = restored.state, restored.position
      print(f"restored {position} exact={restored.exact} step={learner.step_count}",
            flush=True)
  trained = 0
  while position < steps:
    params, opt_state = train_step(params, opt_state, *batch(position))
    position += 1
    kept = {} if state_dir is None else {"state": opt_state, "position": position}
    params = learner.step(params, tokens=16, **kept)
    trained += 1
    if trained == pause_at:
      print(f"paused {position}", flush=True)
      time.sleep(600)
  params = learner.close(params)
  np.savez(out, **{k: np.asarray(v) for k, v in params.items()})
  print("closed", flush=True)


if __name__ == "__main__":
  main()
