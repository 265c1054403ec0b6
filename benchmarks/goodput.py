"""Goodput of ``gmjax.mail`` with learners of different speeds, kills and a late joiner.

Learners are real processes that train a small linear regression through a run in a
local directory. Each learner's data is deterministic: the batch of learner ``i`` at
global step ``s`` is drawn from ``default_rng([seed, i, s])``, so a restarted learner
trains on what it would have. A learner at speed ``v`` simulates its hardware by
sleeping: each inner step (gradient and update included) takes ``base_ms / v``.

Every learner process measures for itself, from the moment all learners are ready (a
file barrier after the imports, so JAX's start-up is not counted) to the end of its
``close``: the steps and tokens it trained, and the seconds it spent blocked inside
``run.join``, ``learner.pull``, ``learner.step`` and ``learner.close`` (its own
compute and sleep are outside those calls). It rewrites a progress file after every
step, so a learner killed with SIGKILL leaves what it had trained. Then:

* goodput = steps in committed aggregates (the round records' participants' ``steps``,
  ``run.rounds()``) / steps trained (every incarnation of every learner);
* idle fraction of a learner = blocked seconds / wall seconds, every incarnation of its
  name summed: round 0 and the final close included;
* held-out loss of each committed Θ (read back from the run) against the wall time of
  its commit, and the wall time to a target loss: 1% of the initial held-out loss.

The inner step is SGD at learning rate 0.0075 on batches of 16; the outer step Nesterov
SGD at learning rate 1.0 and momentum 0.6 (README, "Choosing settings": the default
0.7 / 0.9 oscillates on this quadratic), so the budget ends short of the noise floor
and the loss still tells the scenarios apart.

Same token budget per scenario: the driver sums the learners' progress files and, once
``rounds · sync_every · 4 · batch`` tokens are trained (what 4 learners train in
``rounds`` full rounds), writes a stop file; each learner stops at its next step and
closes (publishing what it trained since its last round as a final contribution).

Scenarios: ``homogeneous`` (speeds 1, 1, 1, 1), ``straggler`` (1, 1, 1/2, 1/4, fixed
``sync_every``), ``straggler-quorum`` (the same with ``quorum_size=3``: a round closes
after three contributions and the run's grace period; the grace is the run's timeout,
``max(30·poll, 3·(step + quorum + sync))`` of its estimates, so ``--poll`` sets its floor),
``kills`` (straggler speeds; the driver watches the run's committed rounds and, at a
random round of each block of ``--kill-every`` (20) committed rounds, for the run's whole
length, SIGKILLs a random training learner at a random moment within that round's
nominal time and restarts it at once under the same name: a real rejoin, which pulls
the newest Θ; ``KillPlan``) and ``late`` (straggler speeds; learner ``l1`` starts once a
quarter of the budget is trained). ``--adaptive on`` runs the chosen scenarios with
``gmjax.DiLoCo(adaptive_steps=True)`` (results named ``<scenario>+adaptive``), ``both``
runs each both ways; ``--overlap-steps`` sets ``overlap_steps`` (``none``: a learner
merges a commit at the first step after it lands, and waits only past ``in_flight``),
``--outer-delay 1`` delayed outer gradients (a learner sends its delta and goes on from
the round before's Θ without waiting).

Synchronous data-parallel is computed, not run: the same budget as global steps of the
4 learners' batches (the same data, plain SGD on their concatenation at 4x the inner
learning rate, the linear scaling rule for a 4x batch), each taking the slowest
learner's step time plus a ring all-reduce of the parameters' F32 gradient, ``2·(L − 1)/L · bytes / bandwidth + 2·(L − 1) · latency``
(``--dp-gbps``, ``--dp-latency-ms``); a learner of step time ``t`` idles
``1 − t / (that step)``.

Run:  .venv/bin/python benchmarks/goodput.py --out /tmp/goodput
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

DIM = 64
NOISE = 0.1
LEARNING_RATE = 0.0075
OUTER = {"outer_learning_rate": 1.0, "outer_momentum": 0.6}  # README, "Choosing settings"
TARGET = 0.01  # of the initial held-out loss
HELD_OUT = 2048
BATCH = 16


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One benchmark setting.

  Attributes:
    name: the scenario's name.
    speeds: each learner's speed (1 is ``base_ms`` a step).
    quorum_size: ``gmjax.DiLoCo.quorum_size``.
    kills: whether learners are killed and restarted.
    late: the index of a learner that starts late, or None.
  """

  name: str
  speeds: tuple[float, ...]
  quorum_size: int | None = None
  kills: bool = False
  late: int | None = None


STRAGGLER = (1.0, 1.0, 0.5, 0.25)
SCENARIOS = {s.name: s for s in (
    Scenario("homogeneous", (1.0, 1.0, 1.0, 1.0)),
    Scenario("straggler", STRAGGLER),
    Scenario("straggler-quorum", STRAGGLER, quorum_size=3),
    Scenario("kills", STRAGGLER, kills=True),
    Scenario("late", STRAGGLER, late=1),
)}


# The task: y = x·w* + b* + noise, loss ½·mean((x·w + b − y)²).


def truth() -> tuple[np.ndarray, np.float32]:
  rng = np.random.default_rng(12345)
  return rng.normal(size=DIM).astype(np.float32), np.float32(0.5)


def params0() -> dict[str, np.ndarray]:
  return {"w": np.zeros(DIM, np.float32), "b": np.zeros(1, np.float32)}


def batch(seed: int, index: int, step: int, size: int = BATCH):
  rng = np.random.default_rng([seed, index, step])
  w, b = truth()
  x = rng.normal(size=(size, DIM)).astype(np.float32)
  y = x @ w + b + NOISE * rng.normal(size=size).astype(np.float32)
  return x, y


def held_out():
  return batch(999, 999, 0, HELD_OUT)


def loss(params, x, y) -> float:
  r = x @ params["w"] + params["b"][0] - y
  return float(0.5 * np.mean(r * r))


def sgd(params, x, y, lr: float = LEARNING_RATE):
  r = x @ params["w"] + params["b"][0] - y
  return {"w": (params["w"] - lr * (x.T @ r) / len(y)).astype(np.float32),
          "b": (params["b"] - lr * np.mean(r)).astype(np.float32)}


def config(scenario: Scenario, sync_every: int, adaptive: bool, overlap_steps: int | None,
           outer_delay: int = 0):
  """The scenario's ``gmjax.DiLoCo``."""
  import gmjax  # pylint: disable=g-import-not-at-top

  return gmjax.DiLoCo(sync_every=sync_every, quorum_size=scenario.quorum_size, **OUTER,
                      adaptive_steps=adaptive, overlap_steps=overlap_steps,
                      outer_delay=outer_delay)


# The learner process.


def _write_json(path: str, record: dict[str, Any]) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f)
  os.replace(tmp, path)


def worker(args: argparse.Namespace) -> None:
  from gmjax import mail  # pylint: disable=g-import-not-at-top

  step_seconds = args.base_ms / 1000.0 / args.speed
  progress = os.path.join(args.dir, f"progress-{args.name}-{args.incarnation}.json")
  open(os.path.join(args.dir, f"ready-{args.name}-{args.incarnation}"), "w").close()
  while args.barrier and not os.path.exists(os.path.join(args.dir, "go")):
    time.sleep(0.01)
  record = {"learner": args.name, "incarnation": args.incarnation, "speed": args.speed,
            "steps": 0, "tokens": 0, "blocked_seconds": 0.0, "wall_seconds": 0.0,
            "compute_seconds": 0.0, "closed": False}
  started = time.monotonic()

  def blocked(call, *a, **k):
    t = time.monotonic()
    try:
      return call(*a, **k)
    finally:
      record["blocked_seconds"] += time.monotonic() - t

  def save():
    record["wall_seconds"] = time.monotonic() - started
    _write_json(progress, record)

  run = blocked(mail.open, args.url)
  learner = blocked(run.join, args.name, poll_interval=args.poll)
  params = blocked(learner.pull, params0())
  save()
  stop = os.path.join(args.dir, "stop")
  while not os.path.exists(stop):
    t = time.monotonic()
    x, y = batch(args.seed, args.index, learner.step_count + 1)
    params = sgd(params, x, y)
    record["compute_seconds"] += time.monotonic() - t
    time.sleep(max(0.0, step_seconds - (time.monotonic() - t)))
    record["steps"] += 1
    record["tokens"] += len(y)
    save()  # trained before the step may publish it: a kill after that counts it
    params = blocked(learner.step, params, tokens=len(y))
    save()
  blocked(learner.close, params)
  record["closed"] = True
  save()
  with open(os.path.join(args.dir, "learners.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\n")


# The driver.


def _spawn(args, scenario: Scenario, index: int, incarnation: int, url: str, directory: str,
           barrier: bool) -> subprocess.Popen:
  command = [sys.executable, os.path.abspath(__file__), "--worker", "--url", url,
             "--dir", directory, "--name", f"l{index}", "--index", str(index),
             "--incarnation", str(incarnation), "--speed", str(scenario.speeds[index]),
             "--base-ms", str(args.base_ms), "--poll", str(args.poll),
             "--seed", str(args.seed)]
  if barrier:
    command.append("--barrier")
  import gmjax  # pylint: disable=g-import-not-at-top

  # The learners import the gmjax this driver imported.
  root = os.path.dirname(os.path.dirname(os.path.abspath(gmjax.__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  log = open(os.path.join(directory, f"l{index}-{incarnation}.log"), "w")  # pylint: disable=consider-using-with
  return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def _progress(directory: str) -> list[dict[str, Any]]:
  records = []
  for entry in sorted(os.listdir(directory)):
    if entry.startswith("progress-") and entry.endswith(".json"):
      try:
        with open(os.path.join(directory, entry)) as f:
          records.append(json.load(f))
      except (OSError, ValueError):
        continue  # being replaced: read again at the next poll
  return records


def _utc(text: str) -> float:
  return datetime.datetime.fromisoformat(text).timestamp()


class KillPlan:
  """The committed rounds at which the ``kills`` scenario kills a learner: one at a
  random round of each block of ``every`` rounds (rounds ``[b·every, (b + 1)·every)``),
  for as long as the run goes on.

  Args:
    every: committed rounds per kill.
    rng: the driver's ``random.Random``.
  """

  def __init__(self, every: int, rng: random.Random):
    self.every, self.rng, self.block = every, rng, 0
    self.round = rng.randrange(every)

  def due(self, committed: int) -> bool:
    """Whether a kill is due once ``committed`` rounds committed; if so, the plan moves
    on to the next block's round (a call per kill: kills a slow poll missed follow)."""
    if committed < self.round:
      return False
    self.block += 1
    self.round = self.block * self.every + self.rng.randrange(self.every)
    return True


def _committed_rounds(run) -> int:
  return sum(run.newest_versions().values())  # version v of a fragment is its v-th commit


def run_scenario(args, scenario: Scenario, adaptive: bool) -> dict[str, Any]:
  """Runs one scenario's learner processes to the token budget; returns its results."""
  from gmjax import mail  # pylint: disable=g-import-not-at-top
  from gmjax.mail import states  # pylint: disable=g-import-not-at-top

  name = scenario.name + ("+adaptive" if adaptive else "")
  if args.work is not None:
    os.makedirs(args.work, exist_ok=True)
  directory = tempfile.mkdtemp(prefix=f"goodput-{scenario.name}-", dir=args.work)
  url = os.path.join(directory, "run")
  run = mail.create(url, params0(), config(scenario, args.sync_every, adaptive,
                                           args.overlap_steps, args.outer_delay),
                    keep_versions=None)
  learners = len(scenario.speeds)
  budget = args.rounds * args.sync_every * learners * BATCH
  rng = random.Random(args.seed)
  first = [i for i in range(learners) if i != scenario.late]
  processes = {i: _spawn(args, scenario, i, 0, url, directory, True) for i in first}
  incarnations = dict.fromkeys(range(learners), 0)
  deadline = time.monotonic() + args.timeout
  while not all(os.path.exists(os.path.join(directory, f"ready-l{i}-0")) for i in first):
    if time.monotonic() > deadline or any(p.poll() is not None for p in processes.values()):
      raise RuntimeError(f"{name}: learners did not start; see {directory}/*.log")
    time.sleep(0.05)
  open(os.path.join(directory, "go"), "w").close()
  wall0, clock0 = time.time(), time.monotonic()
  plan = KillPlan(args.kill_every, rng) if scenario.kills else None
  kill_time, kill_round = None, None  # the next kill's moment, once its round is due
  kills, stopped_at = [], None
  while any(p.poll() is None for p in processes.values()):
    if time.monotonic() > deadline:
      for p in processes.values():
        p.kill()
      raise RuntimeError(f"{name}: not done in {args.timeout} s; see {directory}/*.log")
    trained = sum(r["tokens"] for r in _progress(directory))
    if scenario.late is not None and scenario.late not in processes and trained >= budget / 4:
      processes[scenario.late] = _spawn(args, scenario, scenario.late, 0, url, directory, False)
    if plan is not None and stopped_at is None:
      if kill_time is None:
        committed = _committed_rounds(run)
        if plan.due(committed):
          # A random moment of the round: its nominal time at the fastest learner's pace.
          kill_round = committed
          kill_time = time.monotonic() + rng.uniform(
              0.0, args.sync_every * args.base_ms / 1000.0)
      # A learner that trains: its incarnation has joined and pulled (its progress file).
      training = sorted(i for i, p in processes.items() if p.poll() is None and os.path.exists(
          os.path.join(directory, f"progress-l{i}-{incarnations[i]}.json")))
      if kill_time is not None and time.monotonic() >= kill_time and training:
        victim = rng.choice(training)
        processes[victim].send_signal(signal.SIGKILL)
        processes[victim].wait()
        incarnations[victim] += 1
        kills.append({"learner": f"l{victim}", "seconds": time.monotonic() - clock0,
                      "round": kill_round})
        processes[victim] = _spawn(args, scenario, victim, incarnations[victim], url,
                                   directory, False)
        kill_time = None
    if trained >= budget and stopped_at is None:
      open(os.path.join(directory, "stop"), "w").close()
      stopped_at = time.monotonic() - clock0
    time.sleep(0.05)
  wall = time.monotonic() - clock0
  failed = {f"l{i}": p.returncode for i, p in processes.items() if p.returncode != 0}
  if failed:
    raise RuntimeError(f"{name}: learners exited with {failed}; see {directory}/*.log")

  incarnation_records = _progress(directory)
  records = run.rounds()
  x, y = held_out()
  curve = [{"seconds": 0.0, "loss": loss(params0(), x, y), "tokens": 0}]
  committed_tokens = 0
  per_learner = {f"l{i}": {"speed": scenario.speeds[i], "trained": 0, "committed": 0,
                           "blocked_seconds": 0.0, "wall_seconds": 0.0, "incarnations": 0}
                 for i in range(learners)}
  for record in records:
    for p in record.participants:
      per_learner[p.learner]["committed"] += p.steps
      committed_tokens += p.tokens
    theta = states.load_theta(run.store, run.commit(record.fragment, record.version),
                              states.max_file_bytes(run.manifest.schema, run.manifest.config))
    curve.append({"seconds": _utc(record.committed_at) - wall0,
                  "loss": loss(theta, x, y), "tokens": committed_tokens,
                  "round": record.round})
  for r in incarnation_records:
    entry = per_learner[r["learner"]]
    entry["trained"] += r["steps"]
    entry["blocked_seconds"] += r["blocked_seconds"]
    entry["wall_seconds"] += r["wall_seconds"]
    entry["incarnations"] += 1
  for entry in per_learner.values():
    entry["idle"] = entry["blocked_seconds"] / max(entry["wall_seconds"], 1e-9)
    entry["goodput"] = entry["committed"] / entry["trained"] if entry["trained"] else None
  trained = sum(e["trained"] for e in per_learner.values())
  committed = sum(e["committed"] for e in per_learner.values())
  return {
      "scenario": name, "speeds": list(scenario.speeds), "quorum_size": scenario.quorum_size,
      "adaptive": adaptive, "budget_tokens": budget,
      "kill_every": args.kill_every if scenario.kills else None,
      "trained_tokens": sum(r["tokens"] for r in incarnation_records),
      "committed_tokens": committed_tokens, "steps_trained": trained,
      "steps_committed": committed, "goodput": committed / trained,
      "idle_max": max(e["idle"] for e in per_learner.values()),
      "rounds": len(records), "wall_seconds": wall, "stop_seconds": stopped_at,
      "final_loss": curve[-1]["loss"], "kills": kills, "learners": per_learner,
      "incarnations": incarnation_records, "curve": curve,
      "round_steps": [{"round": r.round, "participants": {p.learner: p.steps
                                                          for p in r.participants}}
                      for r in records],
  }


def data_parallel(args, speeds: tuple[float, ...]) -> dict[str, Any]:
  """Synchronous data-parallel at the slowest learner's pace, computed: its losses are
  trained for real (numpy), its clock is simulated."""
  learners = len(speeds)
  steps = args.rounds * args.sync_every
  nbytes = 4 * (DIM + 1)
  allreduce = (2 * (learners - 1) / learners * nbytes / (args.dp_gbps * 1e9 / 8)
               + 2 * (learners - 1) * args.dp_latency_ms / 1000.0)
  step = args.base_ms / 1000.0 / min(speeds) + allreduce
  x_val, y_val = held_out()
  params = params0()
  curve = [{"seconds": 0.0, "loss": loss(params, x_val, y_val), "tokens": 0}]
  for s in range(1, steps + 1):
    parts = [batch(args.seed, i, s) for i in range(learners)]
    params = sgd(params, np.concatenate([p[0] for p in parts]),
                 np.concatenate([p[1] for p in parts]), LEARNING_RATE * learners)
    if s % args.sync_every == 0 or s == steps:
      curve.append({"seconds": s * step, "loss": loss(params, x_val, y_val),
                    "tokens": s * learners * BATCH})
  idle = {f"l{i}": 1.0 - (args.base_ms / 1000.0 / v) / step for i, v in enumerate(speeds)}
  return {"scenario": "data-parallel", "speeds": list(speeds), "goodput": 1.0,
          "allreduce_seconds": allreduce, "step_seconds": step, "wall_seconds": steps * step,
          "idle": idle, "idle_max": max(idle.values()), "final_loss": curve[-1]["loss"],
          "steps_trained": steps * learners, "curve": curve}


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
  return next((c["seconds"] for c in curve if c["loss"] <= target), None)


def plot(results: list[dict[str, Any]], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.5))
  names = [r["scenario"] for r in results]
  xs = np.arange(len(names))
  bars.bar(xs - 0.2, [r["goodput"] for r in results], 0.4, label="goodput")
  bars.bar(xs + 0.2, [r["idle_max"] for r in results], 0.4, label="idle (most idle learner)")
  bars.set_xticks(xs, names, rotation=20, ha="right")
  bars.set_ylim(0, 1.05)
  bars.axhline(0.95, color="gray", lw=0.5, ls="--")
  bars.axhline(0.10, color="gray", lw=0.5, ls="--")
  bars.legend()
  bars.set_title("goodput and idle fraction")
  for r in results:
    c = r["curve"]
    curves.plot([p["seconds"] for p in c], [p["loss"] for p in c], label=r["scenario"],
                ls="--" if r["scenario"] == "data-parallel" else "-")
  curves.set_yscale("log")
  curves.set_xlabel("wall seconds")
  curves.set_ylabel("held-out loss of the committed Θ")
  curves.legend()
  curves.set_title("held-out loss against wall time (same token budget)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def table(results: list[dict[str, Any]], target: float) -> str:
  lines = ["| scenario | goodput | idle per learner (l0 l1 l2 l3) | rounds | wall s |"
           f" s to loss {target:.4f} | final loss |",
           "|---|---|---|---|---|---|---|"]
  for r in results:
    if r["scenario"] == "data-parallel":
      idle = " ".join(f"{v:.2f}" for v in r["idle"].values())
      rounds = "-"
    else:
      idle = " ".join(f"{e['idle']:.2f}" for e in r["learners"].values())
      rounds = str(r["rounds"])
    reach = time_to(r["curve"], target)
    lines.append(f"| {r['scenario']} | {r['goodput']:.3f} | {idle} | {rounds} |"
                 f" {r['wall_seconds']:.1f} | {'-' if reach is None else f'{reach:.1f}'} |"
                 f" {r['final_loss']:.4f} |")
  return "\n".join(lines)


def _overlap(text: str) -> int | None:
  return None if text.lower() == "none" else int(text)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base-ms", type=float, default=250.0,
                      help="milliseconds of a step at speed 1")
  parser.add_argument("--rounds", type=int, default=20,
                      help="the token budget: what 4 learners train in this many rounds")
  parser.add_argument("--sync-every", type=int, default=8)
  parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                      help="repeat for several (default: all)")
  parser.add_argument("--adaptive", choices=("off", "on", "both"), default="off",
                      help="gmjax.DiLoCo(adaptive_steps=True) in every scenario (on), or"
                      " each scenario both ways (both)")
  parser.add_argument("--overlap-steps", type=_overlap, default=0,
                      help="DiLoCo's overlap_steps: an int, or 'none' (merge a commit at"
                      " the first step after it lands)")
  parser.add_argument("--outer-delay", type=int, choices=(0, 1), default=0,
                      help="DiLoCo's outer_delay: 1 sends a phase's delta and starts the"
                      " next phase from the round before's Θ without waiting (needs"
                      " --overlap-steps 0)")
  parser.add_argument("--kill-every", type=int, default=None, metavar="ROUNDS",
                      help="the kills scenario kills a learner at a random round of each"
                      " block of this many committed rounds (default 20; 2 with --quick)")
  parser.add_argument("--quick", action="store_true",
                      help="a short smoke run: 3 rounds of 4 steps of 20 ms (and a kill"
                      " every 2 rounds)")
  parser.add_argument("--poll", type=float, default=0.02)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dp-gbps", type=float, default=10.0,
                      help="the simulated all-reduce's bandwidth")
  parser.add_argument("--dp-latency-ms", type=float, default=1.0,
                      help="the simulated all-reduce's latency per hop")
  parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per scenario")
  parser.add_argument("--out", default=None, help="folder for goodput.json and goodput.png")
  parser.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
  # The learner process's arguments.
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--url", help=argparse.SUPPRESS)
  parser.add_argument("--dir", help=argparse.SUPPRESS)
  parser.add_argument("--name", help=argparse.SUPPRESS)
  parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--speed", type=float, default=1.0, help=argparse.SUPPRESS)
  parser.add_argument("--barrier", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    worker(args)
    return
  if args.quick:
    args.rounds, args.sync_every, args.base_ms = 3, 4, 20.0
  if args.kill_every is None:
    args.kill_every = 2 if args.quick else 20
  if args.rounds < 1 or args.sync_every < 1 or args.base_ms <= 0 or args.kill_every < 1:
    parser.error(f"--rounds ({args.rounds}), --sync-every ({args.sync_every}) and"
                 f" --kill-every ({args.kill_every}) must be >= 1 and --base-ms"
                 f" ({args.base_ms}) > 0")
  names = args.scenario or list(SCENARIOS)
  args.work = args.work or tempfile.mkdtemp(prefix="gmjax-goodput-")
  results = []
  modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.adaptive]
  for name, adaptive in [(n, a) for n in names for a in modes]:
    result = run_scenario(args, SCENARIOS[name], adaptive)
    results.append(result)
    print(f"{result['scenario']}: goodput {result['goodput']:.3f}, idle "
          + " ".join(f"{k} {v['idle']:.2f}" for k, v in result["learners"].items())
          + f", {result['rounds']} rounds, {result['wall_seconds']:.1f} s,"
          f" loss {result['final_loss']:.4f}"
          + "".join(f", {k['learner']} killed at round {k['round']} ({k['seconds']:.1f} s)"
                    for k in result["kills"]), flush=True)
  reference = data_parallel(args, STRAGGLER)
  results.append(reference)
  target = TARGET * reference["curve"][0]["loss"]
  for r in results:
    r["seconds_to_target"] = time_to(r["curve"], target)
  print(table(results, target))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "goodput.json"), "w") as f:
      json.dump({"settings": {k: v for k, v in vars(args).items()
                              if k in ("base_ms", "rounds", "sync_every", "kill_every",
                                       "poll", "seed",
                                       "adaptive", "overlap_steps", "outer_delay", "dp_gbps",
                                       "dp_latency_ms")},
                 "target_loss": target, "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "goodput.png"))


if __name__ == "__main__":
  main()
