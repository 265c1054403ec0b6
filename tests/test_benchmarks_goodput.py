"""``benchmarks/goodput.py --quick``: learner processes of speeds 1, 1, 1/2, 1/4 through a
local run; the figures it reports agree with the run's round records and with each other.

No timing thresholds: the machine's load sets the figures, not the code.
"""

import argparse
import json
import random

import numpy as np
import pytest

import bench_support


goodput = bench_support.load("goodput")


@pytest.mark.timeout(180)
def test_quick_straggler_run_reports_figures_consistent_with_its_round_records(tmp_path):
  out = tmp_path / "out"
  goodput.main(["--quick", "--scenario", "straggler", "--out", str(out),
                "--work", str(tmp_path)])
  with open(out / "goodput.json") as f:
    report = json.load(f)
  assert (out / "goodput.png").stat().st_size > 0
  straggler, reference = report["results"]
  assert straggler["scenario"] == "straggler" and reference["scenario"] == "data-parallel"
  assert straggler["rounds"] >= 1

  # Steps: every incarnation's count, and the round records' participants.
  learners = straggler["learners"]
  assert sorted(learners) == ["l0", "l1", "l2", "l3"]
  for name, entry in learners.items():
    trained = sum(r["steps"] for r in straggler["incarnations"] if r["learner"] == name)
    committed = sum(r["participants"].get(name, 0) for r in straggler["round_steps"])
    assert entry["trained"] == trained > 0
    assert entry["committed"] == committed <= trained
    assert 0.0 <= entry["idle"] <= 1.0
    assert 0.0 < entry["wall_seconds"]
    assert entry["blocked_seconds"] <= entry["wall_seconds"]
  assert straggler["steps_trained"] == sum(e["trained"] for e in learners.values())
  assert straggler["steps_committed"] == sum(e["committed"] for e in learners.values())
  assert 0.0 < straggler["goodput"] <= 1.0
  np.testing.assert_allclose(straggler["goodput"],
                             straggler["steps_committed"] / straggler["steps_trained"])
  assert straggler["idle_max"] == max(e["idle"] for e in learners.values())
  # The budget: the driver stops the learners once it is trained, each at its next step.
  assert straggler["budget_tokens"] == 3 * 4 * 4 * goodput.BATCH
  assert straggler["trained_tokens"] == goodput.BATCH * straggler["steps_trained"]
  assert straggler["trained_tokens"] >= straggler["budget_tokens"]
  assert straggler["committed_tokens"] == goodput.BATCH * straggler["steps_committed"]
  # The held-out loss curve starts at the initial parameters and falls as rounds commit.
  curve = straggler["curve"]
  assert len(curve) == straggler["rounds"] + 1
  assert curve[-1]["loss"] < curve[0]["loss"]

  # Data-parallel, computed: every step at the slowest learner's pace plus the all-reduce.
  allreduce = 2 * 3 / 4 * 4 * (goodput.DIM + 1) / (10e9 / 8) + 2 * 3 * 1e-3
  np.testing.assert_allclose(reference["allreduce_seconds"], allreduce)
  np.testing.assert_allclose(reference["step_seconds"], 0.020 / 0.25 + allreduce)
  np.testing.assert_allclose(list(reference["idle"].values()),
                             [1 - (0.020 / v) / (0.080 + allreduce) for v in goodput.STRAGGLER])
  assert reference["goodput"] == 1.0 and reference["steps_trained"] == 3 * 4 * 4


def test_data_parallel_reference_is_plain_sgd_on_the_learners_batches():
  args = argparse.Namespace(
      rounds=2, sync_every=3, base_ms=10.0, seed=0, dp_gbps=10.0, dp_latency_ms=1.0)
  reference = goodput.data_parallel(args, (1.0, 1.0, 1.0, 1.0))
  w, b = np.zeros(goodput.DIM), 0.0
  for step in range(1, 7):
    parts = [goodput.batch(0, i, step) for i in range(4)]
    x = np.concatenate([p[0] for p in parts]).astype(np.float64)
    y = np.concatenate([p[1] for p in parts]).astype(np.float64)
    r = x @ w + b - y
    lr = 4 * goodput.LEARNING_RATE  # the linear scaling rule for 4 learners' batches
    w, b = w - lr * x.T @ r / len(y), b - lr * r.mean()
  x, y = goodput.held_out()
  expected = 0.5 * np.mean((x.astype(np.float64) @ w + b - y) ** 2)
  np.testing.assert_allclose(reference["final_loss"], expected, rtol=1e-4)
  assert [c["tokens"] for c in reference["curve"]] == [0, 3 * 4 * 16, 6 * 4 * 16]


def test_kill_plan_kills_at_one_random_round_of_every_block_for_the_whole_run():
  plan = goodput.KillPlan(20, random.Random(0))
  kills = [committed for committed in range(200) if plan.due(committed)]
  # One kill in each block of 20 committed rounds, all along, not a fixed count per run.
  assert [k // 20 for k in kills] == list(range(10)), kills
  assert len(set(k % 20 for k in kills)) > 1  # at random rounds of their blocks
  # A poll that sees several rounds commit at once still kills once per block due.
  plan = goodput.KillPlan(20, random.Random(0))
  assert [plan.due(59) for _ in range(4)] == [True, True, True, False]
