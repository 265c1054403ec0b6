"""``gmjax.diloco`` on a multi-controller JAX runtime: 2 processes × 4 CPU devices.

The learner axis of a (learner=4, data=2) mesh spans both processes, whose collectives
run over gloo on 127.0.0.1, as a multi-host pod's do over its network. The cases cover
the sharded outer step (the default) and ``shard_outer=False``, F32 and I4 deltas. Each
process saves its addressable shards; together they must equal the same steps on 8
devices of this one process.
"""

import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import multiprocess_worker as worker

PROCESSES = 2
DEADLINE_S = 90  # a hung collective fails the test well inside two minutes


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(tmp_path, port):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  procs = []
  for i in range(PROCESSES):
    log = open(tmp_path / f"worker{i}.log", "w")
    procs.append((subprocess.Popen(
        [sys.executable, worker.__file__, str(i), str(PROCESSES), str(port),
         str(tmp_path / f"process{i}.npz")],
        env=env, stdout=log, stderr=subprocess.STDOUT), log))
  return procs


def _wait(procs, tmp_path, started):
  """Waits for every worker until the deadline; kills them all if one fails or hangs."""
  try:
    for proc, _ in procs:
      proc.wait(timeout=max(1.0, started + DEADLINE_S - time.monotonic()))
  except subprocess.TimeoutExpired:
    pass
  finally:
    for proc, log in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      log.close()
  logs = "\n".join(f"--- worker {i} (exit {p.returncode}) ---\n"
                   + (tmp_path / f"worker{i}.log").read_text()[-3000:]
                   for i, (p, _) in enumerate(procs))
  if any(p.returncode != 0 for p, _ in procs):
    pytest.fail(f"a worker failed or ran past {DEADLINE_S} s:\n{logs}")


def _assemble(shard_sets):
  """``{label/path: global array}`` from ``{label/path@bounds: shard}`` mappings."""
  parts = {}
  for shards in shard_sets:
    for key, data in shards.items():
      name, index = key.rsplit("@", 1)
      bounds = [tuple(map(int, b.split(":"))) for b in index.split(",") if b]
      parts.setdefault(name, []).append((bounds, np.asarray(data)))
  whole = {}
  for name, shards in parts.items():
    shape = [max(stop for _, stop in dims) for dims in zip(*(b for b, _ in shards))]
    array = np.zeros(shape, shards[0][1].dtype) if shape else shards[0][1]
    covered = np.zeros(shape, bool)
    for bounds, data in shards:
      if bounds:
        array[tuple(slice(a, b) for a, b in bounds)] = data
        covered[tuple(slice(a, b) for a, b in bounds)] = True
    assert covered.all(), f"{name}: shards missing from the processes' files"
    whole[name] = array
  return whole


def _leaf(results, label, suffix):
  (name,) = [n for n in results if n.startswith(f"{label}/") and n.endswith(suffix)]
  return results[name]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_processes_match_one_process(tmp_path):
  started = time.monotonic()
  procs = _start(tmp_path, _free_port())
  try:
    # The reference runs here, on 8 devices of this process, while the workers compute.
    mesh = jax.make_mesh((worker.LEARNERS, worker.DATA), ("learner", "data"))
    want = _assemble([worker.addressable(worker.run_cases(mesh))])
  finally:
    _wait(procs, tmp_path, started)
  saved = [dict(np.load(tmp_path / f"process{i}.npz")) for i in range(PROCESSES)]
  for s in saved:
    # The learner axis spans both processes: learners 0-1 on one, 2-3 on the other.
    assert len(set(s.pop("mesh_processes")[:, 0])) == PROCESSES
  got = _assemble(saved)
  assert sorted(got) == sorted(want)
  labels = {name.split("/")[0] for name in want}
  assert labels == {label for label, _, _ in worker.cases()}
  for name in sorted(want):
    np.testing.assert_allclose(got[name], want[name], rtol=2e-6, atol=2e-6, err_msg=name)
  for label in labels:
    rounds = _leaf(got, label, ".stats.rounds")
    assert np.all(rounds == rounds.flat[0]) and rounds.flat[0] >= 2, (label, rounds)
    w = _leaf(got, label, "[0]['w']")
    assert not np.allclose(w[0], w[2]), f"{label}: the learners did not train apart"
  # The default layout really shards the outer state (one momentum per parameter): a
  # learner holds whole blocks of 32 of each leaf padded to 32·M, the replicated one
  # all of each leaf, padded to whole blocks of 32.
  block = 32 * worker.LEARNERS
  leaves = [16 * 4, 4, 40]
  per_learner = {"sharded": sum(-(-n // block) * 32 for n in leaves),
                 "replicated": sum(-(-n // 32) * 32 for n in leaves)}
  for setting, layout in worker.CASES:
    held = sum(v.size for n, v in got.items()
               if n.startswith(f"{setting}-{layout}/[1].outer_state"))
    assert held == worker.LEARNERS * per_learner[layout], (setting, layout, held)
