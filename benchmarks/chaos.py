"""A seeded chaos run of ``gmjax.mail``, and the invariants it must keep.

Learner processes train a small model through a run in a local directory while the
driver SIGKILLs random learners at random moments and restarts them (a restarted learner
joins under a new name, pulls and goes on), learners kill themselves at random as
designated closers between saving a state and creating its commit, every learner's
storage calls fail transiently at a given rate, torn temporary files appear, and one
hostile file of each kind is planted at the run's normal paths: a deeply nested payload
header, a malformed heartbeat, a huge finite delta, absurd reported fields, a FIFO, a
huge sparse file, a megabyte of attacker text, hundreds of dead learners' heartbeats and
claims, hundreds of files under names that never joined in one round, a one-byte file
where a round's folder goes, a folder at a future commit record's path, junk at a live
learner's next contribution path (no key needed), and claim files named ``²`` and with 240
digits under the names restarted learners will take. Two kinds are
acted out rather than planted: ``replayed-heartbeats`` captures two heartbeats of a
learner, kills it, and writes them back in turn every 0.1 s to the end of the run, and
``late-learner`` adds a learner that publishes at 0.8x the run's current timeout for
``LATE_ROUNDS`` rounds, then leaves.

The run keeps its newest ``--keep-versions`` versions of each fragment (4, as
``gmjax.mail.create``; 0 keeps every version), so the driver reads every commit record
as it appears (``Ledger``) and samples the objects and bytes on storage as it goes.
Afterwards ``check`` asserts: one commit per version and versions contiguous (from the
ledger), the run verifies (``gmjax.mail.verify``: nothing but the planted bad heartbeat,
while it lies there), no hostile payload was aggregated,
every learner that survived ends on the Θ committed at the end step, no learner failed
or waited past the run's timeouts, the replayed learner is not live in rounds committed
more than ``REPLAY_GRACE`` seconds after its death, the run's quorum estimate stayed
below ``QUORUM_BOUND`` (the late learner's wait is not fed back), and with retention: each fragment keeps its newest
versions only, ``rounds/`` holds only their rounds, planted strangers are counted and
not listed in the records, and dead heartbeats are compacted once the run outlives them.

Run:  .venv/bin/python benchmarks/chaos.py --rounds 500
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HOSTILE = "evil"  # every planted learner name starts with this
KINDS = ("deep-header", "bad-heartbeat", "huge-delta", "huge-fields", "fifo", "sparse",
         "long-text", "torn", "dead-heartbeats", "strangers", "replayed-heartbeats",
         "late-learner", "round-file", "commit-dir", "honest-junk", "odd-claims")
PLANTED_MANY = 300  # dead heartbeats, or strangers' files in one round
REPLAY_GRACE = 10.0  # seconds a replayed learner may still count as live after its death
LATE_ROUNDS = 4  # rounds the late learner publishes late in, then it leaves
# Seconds: honest learners' arrivals spread far less; the late learner's wait, fed back,
# grew the estimate to 0.8x a timeout that grew ~1.2x a round.
QUORUM_BOUND = 1.0
# The kinds that are contributions: each must be listed as rejected by its round.
REJECTED_KINDS = ("deep-header", "huge-delta", "huge-fields", "fifo", "sparse", "long-text")


def params0() -> dict[str, np.ndarray]:
  return {
      "a": np.linspace(-1.0, 1.0, 96, dtype=np.float32).reshape(8, 12),
      "b": np.ones((40,), np.float32),
      "c": np.full((6, 6), 0.5, np.float32),
  }


def goal(index: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(1000 + index)
  return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params0().items()}


def inner(params, target, lr=0.05):
  """One plain SGD step on ``0.5·|p − target|²`` in float32 numpy."""
  return {k: (v - np.float32(lr) * (v - target[k])).astype(np.float32)
          for k, v in params.items()}


# The learner process.


def _inject_faults(rng: random.Random, error_rate: float, die_rate: float) -> None:
  """Transient errors on a share of this process's storage calls; self-kills at commits."""
  from gmjax.mail import states  # pylint: disable=g-import-not-at-top
  from gmjax.mail import store  # pylint: disable=g-import-not-at-top

  def flaky(method):
    def call(self, *args, **kwargs):
      if rng.random() < error_rate:
        raise ConnectionResetError("injected transient storage error")
      return method(self, *args, **kwargs)
    return call

  for name in ("_get", "_put", "_create", "_list", "_list_dated", "_delete"):
    setattr(store.LocalStore, name, flaky(getattr(store.LocalStore, name)))
  write_commit = states.write_commit

  def maybe_die(*args, **kwargs):
    if rng.random() < die_rate:
      print("dying between state and commit", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    return write_commit(*args, **kwargs)

  states.write_commit = maybe_die


def worker(args: argparse.Namespace) -> None:
  from gmjax import mail  # pylint: disable=g-import-not-at-top

  rng = random.Random(args.seed)
  _inject_faults(rng, args.error_rate, args.die_rate)
  run = mail.open(args.url)
  learner = run.join(args.name, poll_interval=args.poll)
  params = learner.pull(params0())
  target = goal(args.index)
  longest = 0.0
  timeouts = []
  while not (args.late and len(timeouts) >= LATE_ROUNDS):
    # The driver writes the global step to stop at: every learner that is still there
    # trains up to it, so all of them end on the round committed at that step.
    if os.path.exists(args.stop):
      with open(args.stop) as f:
        text = f.read()
      if text and learner.step_count >= int(text):
        break
    params = inner(params, target)
    if args.late and learner.schedule.round_at(learner.step_count + 1) is not None:
      timeouts.append(run_timeout(run, args.poll))
      time.sleep(0.8 * timeouts[-1])  # publishes late, every round
    started = time.monotonic()
    params = learner.step(params)
    longest = max(longest, time.monotonic() - started)
    time.sleep(args.step_sleep * rng.random())
  params = learner.close(params)
  np.savez(os.path.join(args.out, f"{args.name}.npz"), **params)
  with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
    json.dump({"step": learner.step_count, "longest_step_seconds": longest,
               "timeouts": timeouts, "left": len(timeouts) >= LATE_ROUNDS}, f)
  print("closed", flush=True)


def run_timeout(run, poll: float) -> float:
  """The run's current timeout: from the estimates of its newest round's record."""
  import gmjax  # pylint: disable=g-import-not-at-top

  newest = {}
  for fragment, version in run.newest_versions().items():
    if version > 0:
      record = run.commit(fragment, version)
      newest[record.round] = record
  estimates = newest[max(newest)].estimates if newest else gmjax.Estimates()
  return estimates.timeout(poll)


class Replay:
  """The ``replayed-heartbeats`` kind: captures two heartbeats of learner ``name`` (then
  the driver kills it) and writes them back in turn, one each ``tick``."""

  def __init__(self, root: str, name: str):
    self.name = name
    self.path = os.path.join(root, "learners", f"{name}.json")
    # Written beside the run, not in it (learners/ is compacted), then moved in.
    self.scratch = os.path.join(os.path.dirname(os.path.abspath(root)), "replay.tmp")
    self.beats: list[bytes] = []
    self.turn = 0
    self.killed_at: float | None = None  # wall clock, as records' committed_at
    self.ended_at: float | None = None

  @property
  def captured(self) -> bool:
    return len(self.beats) == 2

  def tick(self) -> None:
    if not self.captured:
      try:
        with open(self.path, "rb") as f:
          data = f.read()
        seq = json.loads(data)["seq"]
      except (OSError, ValueError, KeyError, TypeError):
        return
      if seq not in [json.loads(b)["seq"] for b in self.beats]:
        self.beats.append(data)
      return
    if self.killed_at is not None:
      with open(self.scratch, "wb") as f:
        f.write(self.beats[self.turn % 2])
      os.replace(self.scratch, self.path)
      self.turn += 1


# Hostile files.


def _payload(header: bytes, data: bytes = b"") -> bytes:
  return len(header).to_bytes(8, "little") + header + data


def _contribution(run, round_: int, learner: str, scale: float, **fields: Any) -> bytes:
  """A well-formed contribution of ``learner`` to ``round_`` with a delta of ``scale``."""
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.mail import contributions  # pylint: disable=g-import-not-at-top

  fragment = run.config.schedule(len(run.plan)).fragment_of(round_)
  names = run.plan[fragment]
  delta = {n: np.full(run.schema[n].shape, scale, np.float32) for n in names}
  entries = {k: np.asarray(v) for k, v in gmjax.encode(delta, run.config.delta_precision).items()}
  schedule = run.config.schedule(len(run.plan))
  record = dict(learner=learner, round_=round_, fragment=fragment,
                base_version=schedule.version_after(round_) - 1, local_step=1, steps=1,
                tokens=1, step_seconds=0.01, final=False,
                precision=run.config.delta_precision, key=None)
  record.update(fields)
  return contributions.dumps(entries, **record)


def plant(run, root: str, kind: str, round_: int) -> list[str]:
  """Plants one hostile file of ``kind`` aimed at ``round_``; returns the paths."""
  schedule = run.config.schedule(len(run.plan))
  if kind == "round-file":  # where the round's folder goes (later kinds aim further)
    path = os.path.join(root, "rounds", str(round_))
    if not os.path.exists(path):
      with open(path, "wb") as f:
        f.write(b"x")
    return [path]
  if kind == "commit-dir":  # where the round's commit record goes
    path = os.path.join(root, "fragments", str(schedule.fragment_of(round_)),
                        f"{schedule.version_after(round_)}.commit.json")
    os.makedirs(os.path.join(path, "inside"), exist_ok=True)
    return [path]
  rounds = os.path.join(root, "rounds", str(round_))
  os.makedirs(rounds, exist_ok=True)
  learners = os.path.join(root, "learners")
  name = f"{HOSTILE}-{kind}"
  path = os.path.join(rounds, f"{name}.safetensors")

  def heartbeat_like_a_learner(who: str) -> None:
    # A copy of a real learner's heartbeat makes the hostile name a known, live learner.
    real = sorted(f for f in os.listdir(learners) if not f.startswith(HOSTILE)
                  and f.endswith(".json"))
    with open(os.path.join(learners, real[0])) as f:
      beat = json.load(f)
    beat["name"] = who
    with open(os.path.join(learners, f"{who}.json"), "w") as f:
      json.dump(beat, f)

  if kind == "deep-header":
    with open(path, "wb") as f:
      f.write(_payload(b"[" * 200_000 + b"]" * 200_000))
  elif kind == "bad-heartbeat":
    path = os.path.join(learners, f"{name}.json")
    with open(path, "w") as f:
      json.dump({"status": "live", "seq": 1, "first_round": "abc", "final_rounds": 5}, f)
  elif kind == "huge-delta":
    heartbeat_like_a_learner(name)
    with open(path, "wb") as f:
      f.write(_contribution(run, round_, name, 3e38))
  elif kind == "huge-fields":
    heartbeat_like_a_learner(name)
    with open(path, "wb") as f:
      f.write(_contribution(run, round_, name, 1e-3, step_seconds=1e300, tokens=10**30))
  elif kind == "fifo":
    os.mkfifo(path)
  elif kind == "sparse":
    with open(path, "wb") as f:
      f.truncate(3 << 30)
  elif kind == "long-text":
    with open(path, "wb") as f:
      f.write(_payload(json.dumps({"__metadata__": {"learner": "x" * (1 << 20)}}).encode()))
  elif kind == "dead-heartbeats":
    long_ago = (datetime.datetime.now(datetime.timezone.utc)
                - datetime.timedelta(hours=1)).isoformat()
    paths = []
    for i in range(PLANTED_MANY):
      who = f"{name}-{i}"
      with open(os.path.join(learners, f"{who}.json"), "w") as f:
        json.dump({"name": who, "status": "closed" if i % 2 else "live", "seq": 7,
                   "last_seen": long_ago, "incarnation": f"{i:032x}"}, f)
      os.makedirs(os.path.join(learners, f"{who}.claims"), exist_ok=True)
      with open(os.path.join(learners, f"{who}.claims", "1"), "w") as f:
        f.write(f"{i:032x}")
      paths.append(os.path.join(learners, f"{who}.json"))
    return paths
  elif kind == "strangers":
    paths = []
    for i in range(PLANTED_MANY):
      paths.append(os.path.join(rounds, f"{name}-{i}.safetensors"))
      with open(paths[-1], "wb") as f:
        f.write(b"junk")
    return paths
  elif kind == "honest-junk":
    # Junk where a live learner's contribution to the round goes, before it gets there.
    live = []
    for entry in sorted(os.listdir(learners)):
      if entry.endswith(".json") and entry.startswith("w"):
        try:
          with open(os.path.join(learners, entry)) as f:
            if json.load(f).get("status") == "live":
              live.append(entry[: -len(".json")])
        except (OSError, ValueError):
          continue
    if not live:
      return []
    path = os.path.join(rounds, f"{live[0]}.safetensors")
    with open(path, "wb") as f:
      f.write(os.urandom(64))
  elif kind == "torn":
    path = os.path.join(rounds, f"w0.safetensors.{random.getrandbits(64):016x}.tmp")
    with open(path, "wb") as f:
      f.write(_payload(b'{"__metadata__": {"lear'))
    fragments = os.path.join(root, "fragments", "0")
    torn = os.path.join(fragments, f"999.commit.json.{random.getrandbits(64):016x}.tmp")
    with open(torn, "w") as f:
      f.write('{"round": 9')
    return [path, torn]
  else:
    raise ValueError(f"unknown hostile kind {kind!r}; one of {KINDS}")
  return [path]


# The driver.


class Ledger:
  """Every commit record of the run, read as it appears.

  A run that prunes keeps only its newest versions; a version lives for at least
  ``keep_versions`` commits of its fragment, far longer than the driver's poll, so the
  ledger sees every commit, and every record that stood in a slot.
  """

  def __init__(self, url: str, fragments: int):
    self.url = url
    self.fragments = fragments
    self.slots: dict[tuple[int, int], dict[str, Any]] = {}  # (f, v) -> {path: record}

  def poll(self) -> None:
    from gmjax.mail import layout  # pylint: disable=g-import-not-at-top

    for fragment in range(self.fragments):
      folder = os.path.join(self.url, "fragments", str(fragment))
      try:
        entries = os.listdir(folder)
      except FileNotFoundError:
        continue
      for entry in entries:
        version = layout.slot_version(entry)
        path = f"fragments/{fragment}/{entry}"
        if version is None or path in self.slots.get((fragment, version), {}):
          continue
        try:
          with open(os.path.join(folder, entry)) as f:
            record = json.load(f)
        except (OSError, ValueError):
          continue  # gone, a folder, or torn: not a record
        if isinstance(record, dict) and record.get("version") == version:
          self.slots.setdefault((fragment, version), {})[path] = record

  def versions(self, fragment: int) -> list[int]:
    return sorted(v for f, v in self.slots if f == fragment)

  def in_force(self, fragment: int, version: int) -> dict[str, Any]:
    slots = self.slots[(fragment, version)]
    return slots[max(slots, key=_slot_number)]

  def duplicates(self) -> list[str]:
    """Records of one version that the record in force does not supersede."""
    found = []
    for (fragment, version), slots in sorted(self.slots.items()):
      last = max(slots, key=_slot_number)
      superseded = set(slots[last].get("supersedes") or [])
      found += [f"{path} and {last}" for path in slots
                if path != last and path not in superseded]
    return found

  def records(self) -> list[dict[str, Any]]:
    """The record in force of every version but 0, by round."""
    records = [self.in_force(f, v) for f, v in self.slots if v > 0]
    return sorted(records, key=lambda r: r["round"])


def _slot_number(path: str) -> int:
  name = path.rsplit("/", 1)[-1]
  return int(name.split("commit-")[1].split(".")[0]) if "commit-" in name else 0


def usage(root: str) -> tuple[int, int]:
  """``(objects, bytes)`` under ``root`` (apparent sizes; files that vanish skipped)."""
  objects = size = 0
  for folder, _, names in os.walk(root):
    for name in names:
      try:
        size += os.lstat(os.path.join(folder, name)).st_size
        objects += 1
      except FileNotFoundError:
        continue
  return objects, size


@dataclasses.dataclass
class Report:
  url: str
  out: str
  keep_versions: int | None = None
  ledger: Ledger | None = None
  samples: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (round, objects, bytes)
  planted_at: dict[str, float] = dataclasses.field(default_factory=dict)
  killed_at: dict[str, float] = dataclasses.field(default_factory=dict)  # wall clock
  ended: float = 0.0
  rounds: int = 0
  kills: int = 0
  self_kills: int = 0
  restarts: int = 0
  failures: list[str] = dataclasses.field(default_factory=list)
  planted: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  survivors: list[str] = dataclasses.field(default_factory=list)
  end_step: int = 0
  seconds: float = 0.0
  replay: Replay | None = None


def _newest_round(run) -> int:
  versions = run.newest_versions()
  schedule = run.config.schedule(len(run.plan))
  fragments = len(run.plan)
  # Round r of fragment r mod P commits version r div P + 1.
  return max((v - 1) * fragments + f for f, v in versions.items()) if versions else -1


def chaos(root: str, *, rounds: int = 30, learners: int = 4, seed: int = 0,
          kill_every: float = 4.0, error_rate: float = 0.03, die_rate: float = 0.05,
          poll: float = 0.02, step_sleep: float = 0.02, deadline: float = 600.0,
          hostile: tuple[str, ...] = KINDS, min_uptime: float = 8.0,
          keep_versions: int | None = 4) -> Report:
  """Runs the chaos run in ``root``; returns what happened (check it with ``check``)."""
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax import mail  # pylint: disable=g-import-not-at-top

  rng = random.Random(seed)
  url = os.path.join(root, "run")
  out = os.path.join(root, "out")
  os.makedirs(out, exist_ok=True)
  stop = os.path.join(root, "stop")
  config = gmjax.DiLoCo(sync_every=4, fragments=2, delta_precision="F8_E4M3",
                        quorum_size=2, flush_on_close=False)
  run = mail.create(url, params0(), config, keep_versions=keep_versions)
  ledger = Ledger(url, len(run.plan))
  report = Report(url=url, out=out, keep_versions=keep_versions, ledger=ledger)
  sampled = 0.0
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  logs = os.path.join(root, "logs")
  os.makedirs(logs, exist_ok=True)

  def start(index: int, generation: int) -> tuple[str, subprocess.Popen]:
    late = index == learners  # the late-learner kind's learner, past the others
    name = f"late-{generation}" if late else f"w{index}-{generation}"
    log = open(os.path.join(logs, f"{name}.log"), "w")  # pylint: disable=consider-using-with
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--url", url,
               "--name", name, "--index", str(index), "--seed", str(rng.getrandbits(32)),
               "--error-rate", str(error_rate), "--die-rate", str(die_rate),
               "--poll", str(poll), "--step-sleep", str(step_sleep), "--stop", stop,
               "--out", out] + (["--late"] if late else [])
    return name, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

  def kill(i: int) -> None:
    name, proc = procs[i]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    report.killed_at[name] = time.time()
    report.kills += 1
    generation[i] += 1
    procs[i] = start(i, generation[i])
    born[i] = time.monotonic()
    report.restarts += 1

  generation = {i: 0 for i in range(learners)}
  procs = {i: start(i, 0) for i in range(learners)}
  started = time.monotonic()
  born = {i: started for i in range(learners)}
  next_kill = started + rng.expovariate(1 / kill_every)
  kinds = list(hostile)
  rng.shuffle(kinds)
  planted_at = -1
  try:
    while True:
      now = time.monotonic()
      if now - started > deadline:
        report.failures.append(f"did not reach round {rounds} within {deadline}s")
        break
      if len(report.failures) >= 2 * learners:
        report.failures.append("learners keep failing: stopped the run")
        break
      newest = _newest_round(run)
      ledger.poll()
      if now - sampled >= 1.0:
        report.samples.append((newest, *usage(url)))
        sampled = now
      # The run goes on past ``rounds`` until it has been disturbed at least once: on a
      # fast machine all its rounds can close before the first learner is old enough to
      # be killed (``min_uptime``).
      if newest + 1 >= rounds and report.kills + report.self_kills > 0:
        break
      if kinds and newest >= max(1, planted_at + 1) and os.listdir(os.path.join(url, "learners")):
        # One hostile file per new round, aimed two rounds ahead so it is there in time.
        kind = kinds.pop()
        if kind == "replayed-heartbeats":
          victim = rng.randrange(learners)
          report.replay = Replay(url, procs[victim][0])
          report.planted[kind] = [report.replay.path]
        elif kind == "odd-claims":
          report.planted[kind] = []
          for i in range(learners):
            folder = os.path.join(url, "learners", f"w{i}-{generation[i] + 1}.claims")
            os.makedirs(folder, exist_ok=True)
            for odd in ("\u00b2", "9" * 240):
              with open(os.path.join(folder, odd), "w") as f:
                f.write("0" * 32)
              report.planted[kind].append(os.path.join(folder, odd))
        elif kind == "late-learner":
          generation[learners] = 0
          procs[learners] = start(learners, 0)
          born[learners] = time.monotonic()
          report.planted[kind] = []
        else:
          report.planted[kind] = plant(run, url, kind, newest + 2)
        report.planted_at[kind] = time.monotonic()
        planted_at = newest
      replay = report.replay
      if replay is not None and replay.ended_at is None:
        replay.tick()
        if replay.captured and replay.killed_at is None:
          i = next((i for i, (name, _) in procs.items() if name == replay.name), None)
          if i is not None:
            kill(i)
          replay.killed_at = time.time()
      for i, (name, proc) in list(procs.items()):
        code = proc.poll()
        if code is None:
          continue
        if code == -signal.SIGKILL:
          report.self_kills += 1
          report.killed_at[name] = time.time()
        elif code == 0 and i == learners:  # the late learner left
          del procs[i]
          continue
        else:
          report.failures.append(f"{name} exited with {code} (see {logs}/{name}.log)")
        generation[i] += 1
        procs[i] = start(i, generation[i])
        born[i] = time.monotonic()
        report.restarts += 1
      if now >= next_kill:
        i = rng.randrange(learners)
        name, proc = procs[i]
        # A learner is killed only once it has been up for min_uptime: one that dies
        # while still starting (importing, compiling its closer) adds no fault the run
        # has not seen, and killing faster than learners start would starve the run.
        if proc.poll() is None and now - born[i] >= min_uptime:
          kill(i)
        next_kill = now + rng.expovariate(1 / kill_every)
      time.sleep(0.1)
  finally:
    if report.replay is not None:
      report.replay.ended_at = time.time()
    ledger.poll()
    records = ledger.records()
    sync_every = config.sync_every
    newest_step = records[-1]["step"] if records else 0
    end = (newest_step // sync_every + 2) * sync_every
    with open(stop + ".tmp", "w") as f:
      f.write(str(end))
    os.replace(stop + ".tmp", stop)
    report.end_step = end
    for i, (name, proc) in procs.items():
      try:
        code = _wait_polling(proc, 120, ledger)
      except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        report.failures.append(f"{name} did not close within 120 s of the stop")
      if code == 0 and not _left(out, name):
        report.survivors.append(name)
      elif code == 0:
        pass  # the late learner left on its own between the last poll and the stop
      elif code == -signal.SIGKILL:
        report.self_kills += 1
      else:
        report.failures.append(f"{name} exited with {code} (see {logs}/{name}.log)")
  ledger.poll()
  report.samples.append((_newest_round(run), *usage(url)))
  report.rounds = len(ledger.records())
  report.ended = time.monotonic()
  report.seconds = report.ended - started
  return report


def _left(out: str, name: str) -> bool:
  """Whether learner ``name`` left the run on its own (the late learner does)."""
  with open(os.path.join(out, f"{name}.json")) as f:
    return json.load(f).get("left", False)


def _wait_polling(proc: subprocess.Popen, timeout: float, ledger: Ledger) -> int:
  """``proc.wait(timeout)``, reading new commit records meanwhile."""
  deadline = time.monotonic() + timeout
  while True:
    try:
      return proc.wait(timeout=0.1)
    except subprocess.TimeoutExpired:
      ledger.poll()
      if time.monotonic() > deadline:
        raise


def _time(text: str) -> float:
  return datetime.datetime.fromisoformat(text).timestamp()


def check(report: Report) -> list[str]:
  """The invariants the run must keep; returns what is wrong (empty: all held)."""
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax import mail  # pylint: disable=g-import-not-at-top
  from gmjax.mail import layout, retention, states  # pylint: disable=g-import-not-at-top

  problems = list(report.failures)
  run = mail.open(report.url)
  # The planted bad heartbeat is listed (readers ignore it) while it lies there; any
  # other problem is the run's.
  planted = f"learners/{HOSTILE}-bad-heartbeat.json: "
  problems += [f"verify: {p}" for p in mail.verify(report.url) if not p.startswith(planted)]
  ledger = report.ledger
  for fragment in range(len(run.plan)):
    versions = ledger.versions(fragment)
    if versions != list(range(len(versions))):
      problems.append(f"fragment {fragment}: versions {_spans(versions)} are not 0..n")
  problems += [f"two commits of one version: {d}" for d in ledger.duplicates()]
  records = ledger.records()
  rejected = {r["learner"] for record in records for r in record["rejected"]}
  for kind in set(report.planted) & set(REJECTED_KINDS):
    if f"{HOSTILE}-{kind}" not in rejected:
      problems.append(f"the hostile {kind} contribution is in no round's rejected list")
  for path in report.planted.get("honest-junk", []):
    round_, name = int(path.split(os.sep)[-2]), os.path.basename(path).split(".")[0]
    record = next((r for r in records if r["round"] == round_), None)
    if record is None or name in report.killed_at:
      continue  # the round was pruned from the ledger's view, or the learner died
    if name in {r["learner"] for r in record["rejected"]} and name not in {
        p["learner"] for p in record["participants"]}:
      problems.append(f"round {round_}: junk planted at {name}'s path stood for its"
                      " contribution")
  if "strangers" in report.planted and not any(
      r.get("unlisted_rejections", 0) >= PLANTED_MANY - retention.MAX_LISTED_STRANGERS
      for r in records):
    problems.append("no round counts the strangers' files as unlisted rejections")
  problems += _retention(report, run, records)
  if [r["round"] for r in records] != list(range(len(records))):
    problems.append(f"rounds {_spans([r['round'] for r in records])} are not contiguous")
  for record in records:
    bad = [p["learner"] for p in record["participants"] if p["learner"].startswith(HOSTILE)]
    if bad:
      problems.append(f"round {record['round']} aggregated hostile payloads from {bad}")
    size = len(json.dumps(record))
    if size > 64 << 10:
      problems.append(f"round {record['round']}'s record is {size} bytes")
  # At the end step the last fragment has just merged its commit (mixing 0, no
  # overlap), so its leaves are that commit's Θ on every learner still there.
  last = len(run.plan) - 1
  newest = states.read_commit(run.store, last, run.newest_versions()[last], None)
  if newest.step != report.end_step:
    problems.append(f"the newest round of fragment {last} is at step {newest.step},"
                    f" not at the end step {report.end_step}")
  committed = states.load_theta(
      run.store, newest, states.max_file_bytes(run.manifest.schema, run.manifest.config))
  for name in report.survivors:
    with open(os.path.join(report.out, f"{name}.json")) as f:
      step = json.load(f)["step"]
    params = dict(np.load(os.path.join(report.out, f"{name}.npz")))
    if step != report.end_step:
      problems.append(f"{name} stopped at step {step}, not {report.end_step}")
    for leaf in run.plan[last]:
      if not np.array_equal(params[leaf], committed[leaf]):
        problems.append(f"{name} ends on another {leaf} than the committed Θ")
  if not report.survivors:
    problems.append("no learner survived to the end")
  replay = report.replay
  if replay is not None and replay.killed_at is not None:
    held = [r["round"] for r in records if replay.name in (r.get("live") or [])
            and replay.killed_at + REPLAY_GRACE < _time(r["committed_at"]) < replay.ended_at]
    if held:
      problems.append(f"{replay.name}, dead and its heartbeats replayed, was live in rounds"
                      f" {_spans(held)}")
  quorum = max((r["estimates"].get("quorum") or 0.0 for r in records), default=0.0)
  if quorum >= QUORUM_BOUND:
    problems.append(f"the run's quorum estimate grew to {quorum:.2f}s")
  # Waits: the longest step of a learner against the longest timeout the run measured.
  timeouts = [gmjax.Estimates.from_json(r["estimates"]).timeout(0.02) for r in records]
  bound = 4 * max(timeouts + [2.0])
  for name in report.survivors:
    with open(os.path.join(report.out, f"{name}.json")) as f:
      longest = json.load(f)["longest_step_seconds"]
    if longest > bound:
      problems.append(f"{name} waited {longest:.1f}s in one step, past 4x the run's"
                      f" longest timeout ({bound / 4:.1f}s)")
  return problems


def late_timeouts(report: Report) -> list[float]:
  """The run's timeouts that the late learners saw, every round (empty without one)."""
  seen = []
  for entry in sorted(os.listdir(report.out)):
    if entry.startswith("late-") and entry.endswith(".json"):
      with open(os.path.join(report.out, entry)) as f:
        seen += json.load(f).get("timeouts", [])
  return seen


def _spans(numbers: list[int]) -> str:
  """``[0, 1, 2, 5]`` as ``0-2, 5``."""
  if not numbers:
    return "none"
  spans, start = [], numbers[0]
  for previous, number in zip(numbers, numbers[1:] + [None]):
    if number != previous + 1:
      spans.append(str(start) if start == previous else f"{start}-{previous}")
      start = number
  return ", ".join(spans)


def _retention(report: Report, run, records: list[dict[str, Any]]) -> list[str]:
  """What a run that keeps its newest versions must have deleted, and nothing more."""
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.mail import retention, states  # pylint: disable=g-import-not-at-top

  keep = report.keep_versions
  if keep is None:
    return []
  problems = []
  schedule = run.config.schedule(len(run.plan))
  newest = run.newest_versions()
  for fragment, version in newest.items():
    kept = states.committed_versions(run.store, fragment)
    if kept != list(range(retention.floor(version, keep), version + 1)):
      problems.append(f"fragment {fragment} keeps versions {_spans(kept)}, not its newest"
                      f" {keep} up to {version}")
  for entry in run.store.list("rounds"):
    round_ = int(entry)
    fragment = schedule.fragment_of(round_)
    if schedule.version_after(round_) < retention.floor(newest[fragment], keep):
      problems.append(f"rounds/{entry} is kept, but its version was pruned")
  planted = report.planted_at.get("dead-heartbeats")
  timeouts = [gmjax.Estimates.from_json(r["estimates"]).timeout(0.02) for r in records]
  # Dead after DEAD_TIMEOUTS liveness timeouts (at least 2 s each), from a closer's
  # first sight; checked only when the run went on twice that long after planting.
  dead_after = retention.DEAD_TIMEOUTS * max(timeouts + [2.0])
  if planted is not None and report.ended - planted > 2 * dead_after:
    left = [e for e in run.store.list("learners") if e.startswith(f"{HOSTILE}-dead")]
    if left:
      problems.append(f"{len(left)} dead heartbeats and claims were not compacted")
  return problems


def figures(report: Report) -> dict[str, Any]:
  records = report.ledger.records()
  latency = sorted(_time(r["committed_at"]) - _time(r["opened_at"]) for r in records
                   if r.get("opened_at"))
  takeovers = 0
  for r in records:
    live = sorted(r.get("live") or [])
    if live and r["closer"] != live[r["fragment"] % len(live)]:
      takeovers += 1
  rejected = sum(len(r["rejected"]) for r in records)
  return {
      "rounds": len(records), "kills": report.kills, "self_kills": report.self_kills,
      "restarts": report.restarts, "takeovers": takeovers, "hostile_kinds": len(report.planted),
      "rejected": rejected,
      "commit_latency_p50_s": statistics.median(latency) if latency else None,
      "commit_latency_p95_s": latency[int(0.95 * (len(latency) - 1))] if latency else None,
      "seconds": report.seconds,
      "late_learner_timeouts_s": _range(late_timeouts(report)),
      "quorum_estimate_max_s": max((r["estimates"].get("quorum") or 0.0 for r in records),
                                   default=None),
      "replayed_learner": None if report.replay is None else report.replay.name,
      **_storage(report),
  }


def _range(values: list[float]) -> list[float] | None:
  return [round(min(values), 3), round(max(values), 3)] if values else None


def _storage(report: Report) -> dict[str, Any]:
  """Objects and bytes on storage: the most over each quarter of the run, and at the end."""
  samples = report.samples
  if not samples:
    return {}
  last = max(r for r, _, _ in samples) or 1
  quarters = []
  for q in range(4):
    inside = [(o, b) for r, o, b in samples if q * last / 4 <= r <= (q + 1) * last / 4]
    if inside:
      quarters.append([max(o for o, _ in inside), max(b for _, b in inside)])
  return {"keep_versions": report.keep_versions,
          "storage_max_objects_bytes_by_quarter": quarters,
          "storage_end_objects": samples[-1][1], "storage_end_bytes": samples[-1][2]}


def lost_or_duplicate(ledger: Ledger) -> int:
  """Versions missing below each fragment's newest, and versions committed twice, as
  the ledger saw them (counted, not read from ``check``'s messages)."""
  lost = 0
  for fragment in range(ledger.fragments):
    versions = set(ledger.versions(fragment))
    lost += len(set(range(max(versions, default=-1) + 1)) - versions)
  return lost + len(ledger.duplicates())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--learners", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--kill-every", type=float, default=4.0)
  parser.add_argument("--error-rate", type=float, default=0.03)
  parser.add_argument("--die-rate", type=float, default=0.05)
  parser.add_argument("--dir", default=None)
  parser.add_argument("--hostile", default=",".join(KINDS),
                      help="comma-separated kinds of hostile file to plant (empty: none)")
  parser.add_argument("--keep-versions", type=int, default=4,
                      help="versions of each fragment the run keeps (0: every version)")
  # The learner process.
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  for flag in ("--url", "--name", "--stop", "--out"):
    parser.add_argument(flag, help=argparse.SUPPRESS)
  parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--poll", type=float, default=0.02, help=argparse.SUPPRESS)
  parser.add_argument("--step-sleep", type=float, default=0.02, help=argparse.SUPPRESS)
  parser.add_argument("--late", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args)
    return
  root = args.dir or tempfile.mkdtemp(prefix="gmjax-chaos-")
  report = chaos(root, rounds=args.rounds, learners=args.learners, seed=args.seed,
                 kill_every=args.kill_every, error_rate=args.error_rate,
                 die_rate=args.die_rate, deadline=max(600.0, 6.0 * args.rounds),
                 hostile=tuple(k for k in args.hostile.split(",") if k),
                 keep_versions=args.keep_versions or None)
  problems = check(report)
  result = figures(report)
  result["lost_or_duplicate_commits"] = lost_or_duplicate(report.ledger)
  result["problems"] = problems
  print(json.dumps(result, indent=2))
  sys.exit(1 if problems else 0)


if __name__ == "__main__":
  main()
