"""``gmjax train`` end to end: learner processes over a local run, metrics, plots, status."""

import json
import subprocess
import sys

import pytest

TINY = """
[train]
learners = 2
steps = 8
batch_size = 4
learning_rate = 3e-3
warmup_steps = 2
eval_every = 4
eval_batches = 1
poll_interval = 0.02
corpus_bytes = 300000

[model]
d_model = 16
layers = 1
heads = 2
mlp = 32
seq_len = 16

[diloco]
sync_every = 4
fragments = 2
delta_precision = "F8_E4M3"
overlap_steps = 1
"""


@pytest.mark.timeout(300)
def test_train_writes_metrics_plots_and_a_run(tmp_path):
  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  result = subprocess.run(
      [sys.executable, "-m", "gmjax.app.cli", "train", str(config), "--out", str(out), "--quiet"],
      capture_output=True, text=True, timeout=280, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  summary = json.loads((out / "summary.json").read_text())
  # 8 steps, H=4, P=2: rounds at steps 2, 4, 6, 8, then closing flushes fragment 0's
  # last two steps into round 4.
  assert summary["rounds"] == 5
  assert set(summary["final_val_loss"]) == {"learner-0", "learner-1", "baseline"}
  assert all(v is not None and 0 < v < 10 for v in summary["final_val_loss"].values())
  sent = summary["bytes_sent"]
  assert set(sent) == {"learner-0", "learner-1", "baseline"}
  # F8 deltas once per round against F32 gradients every step: far fewer bytes.
  assert 0 < sent["learner-0"] < sent["baseline"] / 4
  table = result.stdout[result.stdout.index("| learner |"):]
  assert all(f"| {name} |" in table for name in sent)
  for name in ("loss.png", "bytes.png", "cosine.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in records if r.get("event") == "step" and r["learner"] == "learner-0"]
  assert [r["step"] for r in steps] == list(range(1, 9))
  rounds = [r for r in records if r.get("event") == "round"]
  assert [r["fragment"] for r in rounds] == [0, 1, 0, 1, 0]
  assert [r["step"] for r in rounds] == [2, 4, 6, 8, 10]
  # Liveness is judged by heartbeats, so on a loaded machine a round may close with one
  # learner; every round has a participant and both learners take part in most rounds.
  assert all(1 <= len(r["participants"]) <= 2 for r in rounds)
  for name in ("learner-0", "learner-1"):
    assert sum(name in {p["learner"] for p in r["participants"]} for r in rounds) >= 3

  status = subprocess.run([sys.executable, "-m", "gmjax.app.cli", "status", str(out / "run")],
                          capture_output=True, text=True, timeout=120, check=False)
  assert status.returncode == 0, status.stderr
  assert "learner-0" in status.stdout and "learner-1" in status.stdout


def test_train_refuses_a_bad_config(tmp_path):
  config = tmp_path / "bad.toml"
  config.write_text(TINY.replace("fragments = 2", "fragments = 9"))
  result = subprocess.run([sys.executable, "-m", "gmjax.app.cli", "train", str(config)],
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2
  assert "fragments" in result.stderr


def test_train_never_deletes_a_run_unless_forced(tmp_path):
  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  kept = out / "run" / "manifest.json"
  kept.parent.mkdir(parents=True)
  kept.write_text("{}")
  result = subprocess.run(
      [sys.executable, "-m", "gmjax.app.cli", "train", str(config), "--out", str(out)],
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2
  assert "holds a run already" in result.stderr and "--force" in result.stderr
  assert kept.read_text() == "{}"  # nothing deleted, no learner started
  assert not list(out.glob("learner-*.log"))


def test_status_exits_quietly_when_the_reader_closes_the_pipe(tmp_path):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import gmjax  # pylint: disable=g-import-not-at-top

  run = tmp_path / "run"
  gmjax.mail.create(str(run), {"w": jnp.ones(4)}, gmjax.DiLoCo(sync_every=2))
  # The reader is gone before the command writes (as `gmjax status --json | head` once
  # head has its lines): its first write fails with EPIPE.
  process = subprocess.Popen(
      [sys.executable, "-m", "gmjax.app.cli", "status", str(run), "--json"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  process.stdout.close()
  _, err = process.communicate(timeout=120)
  assert process.returncode == 0, err.decode()
  assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
