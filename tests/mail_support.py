"""Shared pieces of the mail tests: a tiny model, inner steps in numpy, learner threads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

POLL = 0.02
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mail_worker.py")
JAX_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mail_jax_job.py")


def params0():
  return {
      "a": np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3),
      "b": np.ones((5,), np.float32),
      "c": np.full((2, 2), 0.5, np.float32),
  }


def target(index: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(100 + index)
  return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params0().items()}


def inner(params, goal, lr=0.1):
  """One plain SGD step on ``0.5·|p − goal|²``, in float32 numpy."""
  return {k: (np.asarray(v, np.float32) - np.float32(lr) * (np.asarray(v, np.float32) - goal[k]))
          .astype(np.float32) for k, v in params.items()}


def records_reference(config, plan, records, goals):
  """Plain numpy DiLoCo driven by round records, each fragment on its own.

  Every participant of a round of fragment ``f`` starts from ``f``'s Θ before the round,
  trains the steps its record reports on ``f``'s leaves (``inner`` is elementwise, so
  fragments train apart) toward ``goals[learner]``, and the mean of the deltas weighted by
  the tokens the record reports takes a Nesterov SGD step on an F64 master of ``f``. It is
  the committed Θ exactly when every contribution's delta holds the steps it reports,
  trained from its base version.

  Args:
    config: the run's ``DiLoCo`` (outer learning rate and momentum).
    plan: the run's fragment plan (leaf names per fragment).
    records: ``run.rounds()`` (``RoundRecord``s).
    goals: learner name -> its ``target``.

  Returns:
    The newest Θ of every leaf, F32.
  """
  lr, mu = config.outer_learning_rate, config.outer_momentum
  master = {k: v.astype(np.float64) for k, v in params0().items()}
  momentum = {k: np.zeros(v.shape) for k, v in master.items()}
  for record in sorted(records, key=lambda r: r.round):
    names = plan[record.fragment]
    theta = {k: master[k].astype(np.float32) for k in names}
    total = sum(p.tokens for p in record.participants)
    g = {k: np.zeros(master[k].shape) for k in names}
    for p in record.participants:
      local = dict(theta)
      for _ in range(p.steps):
        local = inner(local, goals[p.learner])
      for k in names:
        g[k] += p.tokens / total * (theta[k].astype(np.float64) - local[k])
    for k in names:
      momentum[k] = mu * momentum[k] + g[k]
      master[k] = master[k] - lr * (g[k] + mu * momentum[k])
  return {k: v.astype(np.float32) for k, v in master.items()}


def train(run, name, index, steps, *, tokens=None, out=None, poll=POLL, close=True,
          started=None, wait_timeout=60.0, startup_timeout=60.0, together=None):
  """A learner's training loop: pull, ``steps`` inner steps, close; the result in ``out``.

  ``together``: a ``threading.Barrier`` every learner of the test waits at after its
  ``pull``, so all are live before any publishes round 0 (a learner that publishes it
  alone, before the others' joins, rightly closes it alone).
  """
  try:
    learner = run.join(name, poll_interval=poll, wait_timeout=wait_timeout,
                       startup_timeout=startup_timeout)
    params = learner.pull(params0())
    if together is not None:
      together.wait()
  except BaseException:
    if together is not None:
      together.abort()  # the others stop waiting for this one
    raise
  if started is not None:
    started.set()
  goal = target(index)
  for _ in range(steps):
    params = inner(params, goal)
    params = learner.step(params, tokens=tokens)
  if close:
    params = learner.close(params)
  if out is not None:
    out[name] = params
  return learner, params


class Threads:
  """Runs callables in threads and re-raises the first failure on ``join``."""

  def __init__(self):
    self.threads, self.errors = [], []

  def start(self, fn, *args, **kwargs):
    def body():
      try:
        fn(*args, **kwargs)
      except BaseException as error:  # pylint: disable=broad-except
        self.errors.append(error)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    self.threads.append(thread)

  def join(self, timeout=120.0):
    deadline = time.monotonic() + timeout
    for thread in self.threads:
      thread.join(max(0.0, deadline - time.monotonic()))
    if self.errors:
      raise self.errors[0]
    alive = [t for t in self.threads if t.is_alive()]
    if alive:
      raise TimeoutError(f"{len(alive)} learner thread(s) still running after {timeout}s")


def spawn(url, name, index, steps, *, mode="normal", poll=POLL, step_sleep=0.0):
  """A learner in its own process (``mail_worker.py``)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return subprocess.Popen(
      [sys.executable, WORKER, url, name, str(index), str(steps), mode, str(poll),
       str(step_sleep)],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def two_process_job(url, steps, outs, *extra, env=None, fails=False):
  """One learner of two JAX processes (``mail_jax_job.py``, ``jax.distributed`` on
  127.0.0.1, two CPU devices each) training ``steps`` steps; returns what each process
  wrote to its file of ``outs`` (with ``fails``, each one's log: both must fail).

  Raises:
    AssertionError: a process did not exit with 0 (its output in the message).
  """
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2", **(env or {}))
  jobs = [subprocess.Popen([sys.executable, JAX_JOB, url, str(port), str(i), str(steps),
                            outs[i], *extra],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                           text=True) for i in range(2)]
  try:
    logs = [j.communicate(timeout=240)[0] for j in jobs]
  finally:
    for j in jobs:
      kill(j)
  if fails:  # expected to fail: the processes' logs
    assert 0 not in [j.returncode for j in jobs], logs
    return logs
  assert [j.returncode for j in jobs] == [0, 0], logs
  seen = []
  for out in outs:
    with open(out) as f:
      seen.append(json.load(f))
  return seen


def kill(process):
  if process.poll() is None:
    process.send_signal(signal.SIGKILL)
  process.wait(timeout=30)


def wait_for(condition, timeout, what):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return
    time.sleep(0.02)
  raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def check_dated_listing(store) -> None:
  """``store.list_dated`` names what ``list`` names, dates each object by the storage's
  clock (the tests' servers run on this machine: within a few seconds of its clock;
  S3 dates to the second), and dates no folder; a rewrite dates the object again."""
  before = time.time()
  store.put("dated/one.json", b"1")
  store.put("dated/sub/two.bin", b"2")
  dated = store.list_dated("dated")
  assert list(dated) == store.list("dated") == ["one.json", "sub"]
  assert dated["sub"] is None
  assert before - 2.0 <= dated["one.json"] <= time.time() + 2.0, (before, dated)
  assert store.list_dated("dated/nothing") == {}
  time.sleep(1.1)
  store.put("dated/one.json", b"11")
  assert store.list_dated("dated")["one.json"] > dated["one.json"]
