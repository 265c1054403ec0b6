"""``gmjax train`` end to end: learner processes over a local run, metrics, plots, status."""

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
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
  # learner-1 runs at half speed: it sleeps as long as it computed after each step.
  config.write_text(TINY.replace("poll_interval = 0.02",
                                 "poll_interval = 0.02\nlearner_speeds = [1, 0.5]"))
  out = tmp_path / "out dir"  # the printed commands must paste as they are
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
  # The table says which settings ran.
  settings = next(line for line in table.splitlines() if line.startswith("settings: "))
  for part in ("2 learners x 8 steps", "sync_every 4", "fragments 2", "deltas F8_E4M3",
               "overlap 1", "outer sgd η 0.7 μ 0.9 Nesterov"):
    assert part in settings, (part, settings)
  for name in ("loss.png", "bytes.png", "cosine.png", "goodput.png"):
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

  # Goodput: steps trained (step records) against the round records' participants' steps;
  # the idle fraction from the records' blocked seconds.
  for name in ("learner-0", "learner-1"):
    mine = [r for r in records if r.get("learner") == name]
    stats = summary["goodput"][name]
    assert stats["trained"] == sum(r.get("event") == "step" for r in mine) == 8
    # Each step is sent with both fragments: a fragment's round carries half of its steps.
    assert stats["committed"] == sum(p["steps"] for r in rounds for p in r["participants"]
                                     if p["learner"] == name) / 2
    assert 0 < stats["committed"] <= stats["trained"]
    assert stats["goodput"] == stats["committed"] / stats["trained"]
    start = next(r for r in mine if r["event"] == "start")
    closed = next(r for r in mine if r["event"] == "closed")
    blocked = sum(r["blocked"] for r in mine if "blocked" in r)
    wall = closed["time"] - start["joined"]
    np.testing.assert_allclose(stats["idle"], blocked / wall)
    assert 0 <= stats["idle"] <= 1
    steps = [r for r in mine if r.get("event") == "step"]
    slept = [r["slept"] for r in steps[1:]]  # the first step compiles: no sleep
    assert steps[0]["slept"] == 0
    assert all(s > 0 for s in slept) if name == "learner-1" else not any(slept)

  # It printed the path unquoted: pasted, "gmjax status out dir/run" is two arguments.
  assert f"see the rounds with: gmjax status '{out / 'run'}'" in result.stdout
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


def test_train_keeps_an_earlier_jobs_outputs_whose_run_was_deleted(tmp_path, capsys):
  # The run deleted by hand, its metrics and learners' states kept: a new job deleted
  # them without a word.
  from gmjax.app import cli, config as config_lib  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  (out / "state" / "learner-0").mkdir(parents=True)
  (out / "state" / "learner-0" / "notes.txt").write_text("kept")
  (out / "metrics-learner-0.jsonl").write_text('{"step": 1}\n')
  saved = json.dumps(config_lib.load(config).to_json())
  (out / "config.json").write_text(saved)
  assert cli.main(["train", str(config), "--out", str(out), "--quiet"]) == 2
  err = capsys.readouterr().err
  assert (f"{out} holds an earlier job's outputs (metrics-learner-0.jsonl,"
          " state/learner-0/, config.json) but no run" in err), err
  assert "--force to delete them" in err, err
  assert (out / "state" / "learner-0" / "notes.txt").read_text() == "kept"
  assert (out / "metrics-learner-0.jsonl").read_text() == '{"step": 1}\n'
  assert (out / "config.json").read_text() == saved
  assert not (out / "run").exists()


def test_train_names_files_by_a_jobs_names_instead_of_overwriting_them(tmp_path, capsys):
  # A summary.json, plots and learner-<i>.log in <out>, and no run: the job truncated
  # the logs as its learners started and replaced the rest at its end, without a word.
  from gmjax.app import cli, outdir  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  out.mkdir()
  mine = {"summary.json": '{"my": "results"}', "learner-0.log": "my own log",
          "loss.png": "a plot", "goodput.png": "a plot", "notes.log": "kept",
          "learner-x.log": "kept", "summary.json.bak": "kept"}
  for name, text in mine.items():
    (out / name).write_text(text)
  assert cli.main(["train", str(config), "--out", str(out), "--quiet"]) == 2
  err = capsys.readouterr().err
  assert (f"{out} holds an earlier job's outputs (goodput.png, learner-0.log, loss.png,"
          " summary.json) but no run" in err), err
  assert {p.name: p.read_text() for p in out.iterdir()} == mine
  outdir.check_new_run(out, out / "run", force=True)
  assert sorted(p.name for p in out.iterdir()) == ["learner-x.log", "notes.log",
                                                   "summary.json.bak"]


def test_force_deletes_only_what_a_job_wrote(tmp_path, capsys):
  # --force deleted the whole of <out>/state and overwrote any config.json: files of
  # the user's that a job never writes, named as "an earlier job's outputs".
  from gmjax.app import cli, outdir  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  (out / "state" / "learner-0").mkdir(parents=True)
  (out / "state" / "db.txt").write_text("the user's")
  (out / "config.json").write_text('{"the user\'s": 1}')
  for flags in ([], ["--force"]):
    assert cli.main(["train", str(config), "--out", str(out), "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'config.json'} is not a config that a gmjax train job wrote" in err, err
  assert (out / "config.json").read_text() == '{"the user\'s": 1}'
  (out / "config.json").unlink()
  # Metrics of the user's: any metrics*.jsonl was called the job's, and deleted.
  (out / "metrics_eval_final.jsonl").write_text("the user's")
  (out / "metrics-learner-3.jsonl").write_text("")
  assert outdir.earlier_outputs(out) == ["metrics-learner-3.jsonl", "state/learner-0/"]
  outdir.check_new_run(out, out / "run", force=True)
  assert capsys.readouterr().out.endswith(
      f"deleting metrics-learner-3.jsonl, state/learner-0/ in {out}\n")
  assert os.listdir(out / "state") == ["db.txt"]
  assert sorted(os.listdir(out)) == ["metrics_eval_final.jsonl", "state"]
  assert outdir.earlier_outputs(out) == []
  # A state folder linked elsewhere (a scratch disk) holds a job's states as well; a
  # learner's entry that is a link goes, not what it points to.
  scratch = tmp_path / "scratch"
  (scratch / "learner-0").mkdir(parents=True)
  (tmp_path / "kept").mkdir()
  (scratch / "learner-1").symlink_to(tmp_path / "kept")
  (out / "state" / "db.txt").rename(scratch / "db.txt")
  (out / "state").rmdir()
  (out / "state").symlink_to(scratch)
  assert outdir.earlier_outputs(out) == ["state/learner-0/", "state/learner-1/"]
  outdir.check_new_run(out, out / "run", force=True)
  assert os.listdir(scratch) == ["db.txt"] and (tmp_path / "kept").is_dir()


def test_a_run_folder_without_a_manifest_is_named_as_no_run(tmp_path, capsys):
  # A run whose creation was stopped: the job said to --resume it, and --resume said
  # to drop --resume, so neither got on.
  from gmjax.app import cli, outdir  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  stray = out / "run" / "fragment-0" / "part"
  stray.parent.mkdir(parents=True)
  stray.write_text("kept")
  assert cli.main(["train", str(config), "--out", str(out), "--quiet"]) == 2
  err = capsys.readouterr().err
  assert f"{out / 'run'} exists but holds no run (no manifest.json" in err, err
  assert "--force to delete it" in err and "--resume" not in err, err
  assert cli.main(["train", str(config), "--out", str(out), "--quiet", "--resume"]) == 2
  err = capsys.readouterr().err
  assert f"--resume: {out / 'run'} holds no run to continue" in err, err
  assert "pass --force instead of --resume" in err, err
  assert stray.read_text() == "kept"
  outdir.check_new_run(out, out / "run", force=True)
  assert not (out / "run").exists() and "deleting the previous run" in capsys.readouterr().out
  (out / "run").mkdir()  # empty, as a job stopped before the run's first file leaves it
  outdir.check_new_run(out, out / "run", force=False)
  (out / "run").rmdir()
  (out / "run").write_text("kept")
  with pytest.raises(FileExistsError, match=r"holds no run"):
    outdir.check_new_run(out, out / "run", force=False)
  outdir.check_new_run(out, out / "run", force=True)
  assert not (out / "run").exists()


@pytest.mark.parametrize("out", ["afile", "afile/run1"])
def test_train_refuses_an_out_that_is_or_is_under_a_file(tmp_path, capsys, out):
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  (tmp_path / "afile").write_text("kept")
  assert cli.main(["train", str(config), "--out", str(tmp_path / out)]) == 2
  err = capsys.readouterr().err
  assert f"output folder {tmp_path / out} (--out" in err, err
  assert f"{tmp_path / 'afile'} is a file" in err and "pass a folder" in err, err
  assert (tmp_path / "afile").read_text() == "kept"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "tiny.toml"]


@pytest.mark.timeout(120)  # deleting the live run, the job waited on its learners
def test_force_refuses_to_delete_a_run_whose_learners_still_run(tmp_path, capsys):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  run = str(out / "run")
  gmjax.mail.create(run, {"w": jnp.ones(4)}, gmjax.DiLoCo(sync_every=2))
  # A learner of that run, alive on this host (another gmjax train still at work).
  learner = gmjax.mail.open(run).join("learner-0", poll_interval=0.02)
  try:
    assert cli.main(["train", str(config), "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"--force: learners of the run in {out / 'run'} are still running" in err, err
    assert "learner-0 (pid" in err and "stop that gmjax train first" in err, err
    assert gmjax.mail.open(run).status()["learners"][0]["name"] == "learner-0"
  finally:
    learner.close({"w": jnp.ones(4)})
  assert not list(out.glob("learner-*.log"))


def test_status_exits_quietly_when_the_reader_closes_the_pipe(tmp_path):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import gmjax  # pylint: disable=g-import-not-at-top

  run = tmp_path / "run"
  gmjax.mail.create(str(run), {"w": jnp.ones(4)}, gmjax.DiLoCo(sync_every=2))
  # The reader is gone before the command writes (as `gmjax status --json | head` once
  # head has its lines): its first write fails with EPIPE.
  def status():
    process = subprocess.Popen(
        [sys.executable, "-m", "gmjax.app.cli", "status", str(run), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    return process.returncode, err.decode()

  assert status()[0] == 0
  # A damaged run still exits 1 (it exited 0: the damage was lost with the pipe).
  (run / "learners").mkdir(exist_ok=True)
  (run / "learners" / "x.json").write_text("{}")
  code, err = status()
  assert code == 1 and "is damaged: 1 problem(s)" in err, err


def test_status_of_a_job_folder_names_its_run(tmp_path, capsys):
  # The --out folder, the natural thing to pass, was "no run ...; create one".
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  gmjax.mail.create(str(tmp_path / "out" / "run"), {"w": jnp.ones(4)},
                    gmjax.DiLoCo(sync_every=2))
  assert cli.main(["status", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert f"but {tmp_path / 'out' / 'run'} holds one" in err, err
  assert f"gmjax status {tmp_path / 'out' / 'run'}" in err and err.count("\n") == 1, err
  assert cli.main(["status", str(tmp_path / "elsewhere")]) == 2
  assert "no run at" in capsys.readouterr().err


def test_status_reads_the_key_from_the_named_variable_or_names_it(tmp_path, capsys,
                                                                    monkeypatch):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  run, key = str(tmp_path / "run"), "a-test-key-of-32-characters-0123"
  gmjax.mail.create(run, {"w": jnp.ones(4)}, gmjax.DiLoCo(sync_every=2), key=key)
  monkeypatch.delenv("GMJAX_TEST_KEY", raising=False)
  assert cli.main(["status", run, "--key-env", "GMJAX_TEST_KEY"]) == 2
  err = capsys.readouterr().err
  assert "--key-env GMJAX_TEST_KEY: the environment variable GMJAX_TEST_KEY is not set" in err
  monkeypatch.setenv("GMJAX_TEST_KEY", "")
  assert cli.main(["status", run, "--key-env", "GMJAX_TEST_KEY"]) == 2
  assert "GMJAX_TEST_KEY is empty" in capsys.readouterr().err
  monkeypatch.setenv("GMJAX_TEST_KEY", key)
  assert cli.main(["status", run, "--key-env", "GMJAX_TEST_KEY"]) == 0
  assert f"run {run}:" in capsys.readouterr().out
  with pytest.raises(SystemExit) as exit_:  # one way to give the key, not two
    cli.main(["status", run, "--key", key, "--key-env", "GMJAX_TEST_KEY"])
  assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err
  # A key missing, wrong or given to an unsigned run: named as the command line gives it.
  assert cli.main(["status", run]) == 2
  assert capsys.readouterr().err == (
      f"gmjax status: run {run} is signed: give its key with --key KEY or --key-env VAR\n")
  assert cli.main(["status", run, "--key", "x" * 32]) == 2
  assert capsys.readouterr().err == (
      f"gmjax status: run {run} is signed with another key than --key gives\n")
  unsigned = str(tmp_path / "unsigned")
  gmjax.mail.create(unsigned, {"w": jnp.ones(4)}, gmjax.DiLoCo(sync_every=2))
  assert cli.main(["status", unsigned, "--key-env", "GMJAX_TEST_KEY"]) == 2
  assert capsys.readouterr().err == (
      f"gmjax status: run {unsigned} was created without a key: drop --key-env"
      " GMJAX_TEST_KEY\n")


def test_status_json_carries_each_learners_pace_and_each_rounds_waits(tmp_path, capsys):
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  import mail_support as ms  # pylint: disable=g-import-not-at-top

  url = str(tmp_path / "run")
  run = gmjax.mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2))
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, gmjax.mail.open(url), f"w{m}", m, 4)
  threads.join(timeout=60)
  assert cli.main(["status", url, "--json"]) == 0
  shown = json.loads(capsys.readouterr().out)
  expected = {l["name"]: l for l in run.status()["learners"]}
  learners = {l["name"]: l for l in shown["status"]["learners"]}
  assert sorted(learners) == ["w0", "w1"]
  for name, learner in learners.items():
    # Numbers, as Run.status() has them (not the strings json's default=str would make).
    for field in ("step_seconds", "steps_per_second", "idle_seconds", "idle_fraction",
                  "steps_per_round_mean", "goodput"):
      assert isinstance(learner[field], float), (name, field, learner[field])
      assert learner[field] == pytest.approx(expected[name][field], rel=1e-12), field
    for field in ("trained", "steps_per_round_last", "committed_steps"):
      assert learner[field] == expected[name][field] and type(learner[field]) is int
    # Each trained 4 steps, all in its two committed rounds of 2 steps.
    assert learner["trained"] == 4 and learner["committed_steps"] == 4
    assert learner["steps_per_round_last"] == 2 and learner["goodput"] == 1.0
    assert learner["step_seconds"] > 0 and 0 <= learner["idle_fraction"] <= 1
    assert learner["steps_per_second"] == pytest.approx(1 / learner["step_seconds"])
  records = {r.round: r for r in run.rounds()}
  rounds = {r["round"]: r for r in shown["rounds"] if r["round"] is not None}
  assert sorted(rounds) == [0, 1]
  for number, record in rounds.items():
    for field in ("quorum_seconds", "grace_seconds", "takeover_seconds", "wait_seconds",
                  "sync_seconds"):
      assert isinstance(record[field], float), (number, field, record[field])
      assert record[field] == getattr(records[number], field), (number, field)
    assert record["wait_seconds"] >= record["quorum_seconds"]
    assert {p["learner"]: p["steps"] for p in record["participants"]} == {"w0": 2, "w1": 2}


def test_status_of_unreachable_storage_says_so_in_one_line(capsys, monkeypatch):
  import socket  # pylint: disable=g-import-not-at-top

  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  with socket.socket() as s:  # a port nothing listens on: every request is refused
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
  assert cli.main(["status", "gs://gmjax-nowhere/run", "--retry-seconds", "1"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("gmjax status: the storage at gs://gmjax-nowhere/run did not answer"
                        " within 1 s"), err
  assert "--retry-seconds" in err and "Traceback" not in err and err.count("\n") == 1, err
  assert "(or STORAGE_EMULATOR_HOST)" in err, err
  assert cli.main(["status", "gs://gmjax-nowhere/run", "--retry-seconds", "0"]) == 2
  assert "--retry-seconds 0: must be a positive number" in capsys.readouterr().err
  # An S3-compatible endpoint is AWS_ENDPOINT_URL's; the hint named the GCS variable.
  monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
  for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x")):
    monkeypatch.setenv(name, value)
  assert cli.main(["status", "s3://gmjax-nowhere/run", "--retry-seconds", "1"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("gmjax status: the storage at s3://gmjax-nowhere/run did not answer")
  assert "(or AWS_ENDPOINT_URL, for an S3-compatible service)" in err, err


@pytest.mark.parametrize("url,package,extra", [("gs://b/run", "gcsfs", "gcs"),
                                               ("s3://b/run", "s3fs", "s3")])
def test_status_without_the_storage_package_names_the_extra(url, package, extra):
  # The README's [app] install has no gcsfs or s3fs: a raw ImportError traceback, exit 1.
  script = (f"import sys; sys.modules[{package!r}] = None\n"  # not importable, as if absent
            "from gmjax.app import cli\n"
            f"sys.exit(cli.main(['status', {url!r}]))\n")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=120, check=False)
  assert done.returncode == 2, done.stderr
  assert f"needs {package}, which is not installed: pip install 'gmjax[{extra}]'" in \
      done.stderr and done.stderr.count("\n") == 1, done.stderr
  assert "Traceback" not in done.stderr


def _train_cli(*args, timeout=280):
  return subprocess.run([sys.executable, "-m", "gmjax.app.cli", "train", *map(str, args)],
                        capture_output=True, text=True, timeout=timeout, check=False)


def test_resume_needs_a_run_and_refuses_force(tmp_path, capsys):
  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  result = _train_cli(config, "--out", out, "--resume")
  assert result.returncode == 2
  assert f"no run to continue in {out / 'run'}; drop --resume" in result.stderr
  result = _train_cli(config, "--out", out, "--resume", "--force")
  assert result.returncode == 2 and "pass one of them" in result.stderr
  assert not out.exists()
  # An earlier job's outputs without a run: dropping --resume would be refused too.
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top
  out.mkdir()
  (out / "metrics-learner-0.jsonl").write_text("")
  assert cli.main(["train", str(config), "--out", str(out), "--resume"]) == 2
  err = capsys.readouterr().err
  assert "earlier job's outputs (metrics-learner-0.jsonl); pass --force instead of" \
         " --resume" in err, err
  # A run whose config.json is torn: a raw JSON error named neither the file nor a fix.
  (out / "run").mkdir()
  (out / "run" / "manifest.json").write_text("{}")
  for torn in ('{"name": "tin', ""):
    (out / "config.json").write_text(torn)
    assert cli.main(["train", str(config), "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {out / 'config.json'}, the config the run" in err, err
    assert "is damaged" in err and "put it back" in err, err
    # It said to pass --force, which refuses such a config.json too.
    assert "or move it away and pass --force instead of --resume" in err, err
    assert cli.main(["train", str(config), "--out", str(out), "--force"]) == 2
    assert "is not a config that a gmjax train job wrote" in capsys.readouterr().err


def _newest_step(run_dir):
  import gmjax  # pylint: disable=g-import-not-at-top

  run = gmjax.mail.open(str(run_dir))
  return max(run.commit_step(f, v) for f, v in run.newest_versions().items())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stopped_run_resumes_until_its_steps_are_done(tmp_path):
  import gmjax  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY.replace("steps = 8", "steps = 40").replace("eval_every = 4",
                                                                   "eval_every = 20"))
  out = tmp_path / "out"
  # Stop the whole job (the CLI and its learner processes) once two rounds committed.
  job = subprocess.Popen(  # pylint: disable=consider-using-with
      [sys.executable, "-m", "gmjax.app.cli", "train", str(config), "--out", str(out),
       "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      start_new_session=True)
  deadline = time.monotonic() + 400
  try:
    while True:
      assert job.poll() is None, "the job ended before it was stopped"
      assert time.monotonic() < deadline, "no two rounds committed in 400 s"
      try:
        if len(gmjax.mail.open(str(out / "run")).rounds()) >= 2:
          break
      except (FileNotFoundError, ValueError):
        pass  # the run is being created
      time.sleep(0.05)
  finally:
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
  stopped_at = _newest_step(out / "run")
  assert 2 <= stopped_at < 40 and not (out / "summary.json").exists()

  differs = config.with_name("other.toml")
  differs.write_text(config.read_text().replace("steps = 40", "steps = 41"))
  result = _train_cli(differs, "--out", out, "--resume")
  assert result.returncode == 2
  assert "[train] steps: 40 -> 41; resume with that config" in result.stderr

  result = _train_cli(config, "--out", out, "--quiet", "--resume", timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f"rejoin {out / 'run'} at step {stopped_at} of 40" in result.stdout
  summary = json.loads((out / "summary.json").read_text())
  assert summary["resumed_at_step"] == stopped_at
  assert all(v is not None and 0 < v < 10 for v in summary["final_val_loss"].values())
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  for name in ("learner-0", "learner-1"):
    mine = [r for r in records if r.get("learner") == name]
    events = [r["event"] for r in mine]
    resumed = events.index("resume")
    before = [r["step"] for r in mine[:resumed] if r["event"] == "step"]
    after = [r["step"] for r in mine[resumed:] if r["event"] == "step"]
    # The stopped attempt's records are kept; the resumed learner goes on from the
    # newest committed round to the last step.
    assert events[0] == "start" and before == list(range(1, len(before) + 1))
    assert len(before) >= stopped_at
    # Each learner restores the Adam state it saved at the last commit it merged: the
    # newest round's (then one step later, with overlap_steps = 1) or, if the job was
    # stopped before it merged that one, an older one (then it goes on from the run's step).
    start = mine[resumed]["step"]
    assert mine[resumed]["restored"] in ("exact", "moved on") and "val_loss" in mine[resumed]
    assert start == stopped_at + (1 if mine[resumed]["restored"] == "exact" else 0)
    assert after == list(range(start + 1, 41))
    assert events[-1] == "closed" and events.count("resume") == 1
  rounds = [r for r in records if r.get("event") == "round"]
  for fragment in (0, 1):
    versions = [r["version"] for r in rounds if r["fragment"] == fragment]
    assert versions == list(range(1, len(versions) + 1))
  assert max(r["step"] for r in rounds) >= 40
  assert gmjax.mail.verify(gmjax.mail.open(str(out / "run")), deep=True) == []
  baseline = (out / "metrics-baseline.jsonl").read_bytes()
  assert [json.loads(l)["step"] for l in baseline.splitlines()][-1] == 40

  # Resumed again, the run has nothing left to train: the baseline's metrics are kept,
  # and so are the times the summary gives them (they read 0.0 and null).
  result = _train_cli(config, "--out", out, "--quiet", "--resume")
  assert result.returncode == 0, result.stdout + result.stderr
  assert "have trained all 40 steps" in result.stdout
  assert "keeping the baseline's 40 steps" in result.stdout
  assert (out / "metrics-baseline.jsonl").read_bytes() == baseline
  again = json.loads((out / "summary.json").read_text())
  assert again["diloco_seconds"] == summary["diloco_seconds"] > 0
  assert again["baseline_seconds"] == summary["baseline_seconds"] > 0


@pytest.mark.parametrize("argv, message", [
    (["train", "CONFIG", "--out", ""], "--out '': must be a local folder"),
    (["train", "CONFIG", "--out", "gs://bucket/x"], "--out 'gs://bucket/x': must be a local"),
    (["status", "RUN", "--key", ""], "--key is empty; give the run's key"),
])
def test_bad_arguments_are_named_in_one_line(tmp_path, capsys, argv, message):
  # --out '' was ignored, a URL made junk local folders, --key '' a raw TypeError.
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  argv = [str(config) if a == "CONFIG" else str(tmp_path / "run") if a == "RUN" else a
          for a in argv]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1, err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.toml"]


def test_status_of_s3_without_credentials_says_so_in_one_line(capsys, monkeypatch):
  # botocore's NoCredentialsError came out as a traceback.
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
               "AWS_PROFILE", "AWS_ENDPOINT_URL"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
  monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
  monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
  assert cli.main(["status", "s3://gmjax-nowhere/run", "--retry-seconds", "2"]) == 2
  err = capsys.readouterr().err
  assert "no usable credentials for the storage (NoCredentialsError" in err, err
  assert "Traceback" not in err and err.count("\n") == 1, err


def test_a_job_holds_its_output_folder_and_its_learners_hold_it_too(tmp_path, capsys):
  # --force deleted the run of a job still at work: before its learners' first
  # heartbeats, and while it trained its baseline after they closed. The job now holds
  # <out> (flock) for as long as it, or a learner it started, runs.
  from gmjax.app import cli, outdir  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  out = tmp_path / "out"
  (out / "run").mkdir(parents=True)
  (out / "run" / "keep.txt").write_text("the other job's")
  held = outdir.lock(out)
  # A learner process inherits the hold (as the job's workers do) and outlives the job.
  learner = subprocess.Popen(["sleep", "60"], pass_fds=(held,))  # pylint: disable=consider-using-with
  os.close(held)
  try:
    for flags in (["--force"], ["--resume"], []):
      assert cli.main(["train", str(config), "--out", str(out), *flags]) == 2
      err = capsys.readouterr().err
      assert f"another gmjax train job is running in {out}" in err, (flags, err)
    assert (out / "run" / "keep.txt").read_text() == "the other job's"
  finally:
    learner.kill()
    learner.wait()
  os.close(outdir.lock(out))  # free again once every holder is gone


def test_force_deletes_a_run_whose_manifest_is_damaged(tmp_path, capsys):
  # The manifest was opened to look for live learners, and its damage stopped --force:
  # the run could only be deleted by hand.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.app import outdir  # pylint: disable=g-import-not-at-top

  out = tmp_path / "out"
  gmjax.mail.create(str(out / "run"), {"w": jnp.ones(4)}, gmjax.DiLoCo(sync_every=2))
  manifest = out / "run" / "manifest.json"
  manifest.write_bytes(manifest.read_bytes()[:40])
  with pytest.raises(FileExistsError, match="holds a run already"):
    outdir.check_new_run(out, out / "run", force=False)
  outdir.check_new_run(out, out / "run", force=True)
  assert not (out / "run").exists()
  assert "cannot be opened" in capsys.readouterr().out


def test_a_learner_that_died_early_has_no_final_loss():
  # A learner killed at step 0 was shown at its start's loss as its held-out loss.
  from gmjax.app.train import final_losses  # pylint: disable=g-import-not-at-top

  metrics = [{"learner": "a", "event": "start", "step": 0, "val_loss": 6.0},
             {"learner": "b", "event": "start", "step": 0, "val_loss": 6.0},
             {"learner": "a", "event": "step", "step": 8, "val_loss": 2.5},
             {"learner": "a", "event": "closed", "step": 8, "val_loss": 2.4},
             {"learner": "baseline", "event": "step", "step": 8, "val_loss": 2.3}]
  assert final_losses(metrics, ["a", "b", "baseline"], 8) == {"a": 2.4, "b": None,
                                                              "baseline": 2.3}


def test_resume_without_the_recorded_config_is_refused(tmp_path, capsys):
  # Without config.json, --resume compared [diloco] and the shapes only, and trained on
  # with other [train] settings under the earlier baseline.
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.app import cli, config as config_lib, model  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  cfg = config_lib.load(config)
  out = tmp_path / "out"
  _, params = model.build(cfg.model, seed=cfg.seed)
  gmjax.mail.create(str(out / "run"), params, cfg.diloco, keep_versions=None)
  assert cli.main(["train", str(config), "--out", str(out), "--resume"]) == 2
  err = capsys.readouterr().err
  assert f"{out / 'config.json'}, the config the run in {out / 'run'} was started with, is" \
         " missing" in err, err
  # A run whose creation was stopped: the library's "create it again" named no flag.
  (out / "config.json").write_text(json.dumps(cfg.to_json()))
  for path in sorted((out / "run" / "fragments").rglob("*"), reverse=True):
    path.rmdir() if path.is_dir() else path.unlink()
  assert cli.main(["train", str(config), "--out", str(out), "--resume"]) == 2
  err = capsys.readouterr().err
  assert f"--resume: the run in {out / 'run'} cannot be continued (" in err, err
  assert "pass --force instead of --resume" in err, err


def test_sigterm_stops_the_job_and_its_learners(tmp_path):
  # `kill <job>` left its learners running without it, and the next --resume or
  # --force was refused for learners of a job that no longer existed. And the learners
  # re-read the TOML file when they started: one edited (here: removed) after the job's
  # checks trained with other settings than the job recorded.
  import gmjax  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY.replace("steps = 8", "steps = 400").replace(
      "poll_interval = 0.02", "poll_interval = 0.02\nstep_ms = 50"))
  out = tmp_path / "out"
  with _running_job(config, out) as job:
    deadline = time.monotonic() + 240
    while not (out / "config.json").exists():  # checked and recorded: the TOML may go
      assert job.poll() is None and time.monotonic() < deadline, "no config.json"
      time.sleep(0.02)
    config.unlink()  # long before a learner process has imported JAX
    pids = []
    while len(pids) < 2:
      assert job.poll() is None and time.monotonic() < deadline, "no learners joined"
      try:
        learners = gmjax.mail.open(str(out / "run")).learners()
        pids = [r.pid for r in learners.values() if isinstance(r.pid, int)]
      except (FileNotFoundError, ValueError):
        pass  # the run is being created
      time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
  assert job.returncode == 130, err
  assert "stopped (SIGTERM)" in err and "--resume" in err and "Traceback" not in err, err
  deadline = time.monotonic() + 10
  while any(_alive(pid) for pid in pids):
    assert time.monotonic() < deadline, f"learners {pids} outlived the job"
    time.sleep(0.1)


@contextlib.contextmanager
def _running_job(config, out):
  """``gmjax train CONFIG --out OUT --quiet`` in a session of its own (stderr piped),
  killed with its learners if the test leaves it running."""
  job = subprocess.Popen(  # pylint: disable=consider-using-with
      [sys.executable, "-m", "gmjax.app.cli", "train", str(config), "--out", str(out),
       "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
      start_new_session=True)
  try:
    yield job
  finally:
    if job.poll() is None:
      os.killpg(job.pid, signal.SIGKILL)
      job.wait()


def _alive(pid):
  from gmjax.app import outdir  # pylint: disable=g-import-not-at-top
  return outdir._alive(pid)  # pylint: disable=protected-access


def test_a_job_started_under_nohup_keeps_ignoring_hangups():
  # The job's handler replaced nohup's: closing the terminal stopped the job.
  from gmjax.app import stops  # pylint: disable=g-import-not-at-top

  before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
  try:
    with stops.stopped_by_signals():
      assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
      assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # stops the learners
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGHUP, before)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_learner_that_fails_ends_the_job(tmp_path):
  # The job waited for the other learners to train to the end before it said a learner
  # had failed.
  config = tmp_path / "tiny.toml"
  config.write_text(TINY.replace("steps = 8", "steps = 2000").replace(
      "eval_every = 4", "eval_every = 1000").replace("[model]", "baseline = false\n[model]"))
  out = tmp_path / "out"
  with _running_job(config, out) as job:
    deadline = time.monotonic() + 300
    metrics = out / "metrics-learner-1.jsonl"
    while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
      assert job.poll() is None and time.monotonic() < deadline, "learner-1 never stepped"
      time.sleep(0.1)
    children = (pathlib.Path(f"/proc/{job.pid}/task/{job.pid}/children")
                .read_text().split())
    learner = next(int(c) for c in children if "--name\0learner-1\0" in
                   pathlib.Path(f"/proc/{c}/cmdline").read_text())
    os.kill(learner, signal.SIGKILL)
    killed = time.monotonic()
    _, err = job.communicate(timeout=120)
  assert job.returncode == 1, err
  assert "learners failed: [('learner-1', -9)] (stopped: learner-0)" in err, err
  assert time.monotonic() - killed < 60
  steps = [json.loads(line).get("step") for line in
           (out / "metrics-learner-0.jsonl").read_text().splitlines()]
  assert max(s for s in steps if s is not None) < 2000


@pytest.mark.parametrize("signum, said", [(signal.SIGTERM, "SIGTERM"),
                                          (signal.SIGINT, "Ctrl-C")])
def test_a_signal_while_the_config_is_read_stops_the_job(tmp_path, monkeypatch, capsys,
                                                         signum, said):
  # The handlers came after the config, corpus and model checks: a SIGTERM there ended
  # the command with exit 143 and no word (and Ctrl-C there said "stopped ()").
  from gmjax.app import cli, config as config_lib  # pylint: disable=g-import-not-at-top

  class Unhandled(Exception):
    pass

  def unhandled(signum, frame):  # pylint: disable=unused-argument
    raise Unhandled(signum)

  load = config_lib.load

  def load_then_terminated(path):
    cfg = load(path)
    os.kill(os.getpid(), signum)
    time.sleep(1)  # delivered before this returns
    return cfg

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  monkeypatch.setattr(config_lib, "load", load_then_terminated)
  previous = signal.signal(signal.SIGTERM, unhandled)
  # Ctrl-C as a terminal delivers it: a pytest started in the background ignores SIGINT,
  # which the job then ignores too (as ``nohup`` asks).
  previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    assert cli.main(["train", str(config), "--out", str(tmp_path / "out")]) == 130
  finally:
    signal.signal(signal.SIGTERM, previous)
    signal.signal(signal.SIGINT, previous_interrupt)
  assert f"gmjax train: stopped ({said})" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_a_stop_before_force_deleted_the_old_run_offers_no_resume(tmp_path, monkeypatch,
                                                                  capsys):
  # Ctrl-C in --force before the old run was deleted printed "continue the run with:
  # ... --resume", which then refused: the run was another config's, not this job's.
  from gmjax.app import cli, config as config_lib, model, outdir  # pylint: disable=g-import-not-at-top
  import gmjax  # pylint: disable=g-import-not-at-top

  old, new = tmp_path / "old.toml", tmp_path / "new.toml"
  old.write_text(TINY)
  new.write_text(TINY.replace("steps = 8", "steps = 12"))
  out = tmp_path / "out"
  out.mkdir()
  cfg = config_lib.load(str(old))
  (out / "config.json").write_text(json.dumps(cfg.to_json()))
  gmjax.mail.create(str(out / "run"), model.build(cfg.model, seed=cfg.seed)[1], cfg.diloco)
  check_new_run = outdir.check_new_run

  def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # delivered before this returns
    return check_new_run(*args, **kwargs)

  monkeypatch.setattr(outdir, "check_new_run", interrupted)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    assert cli.main(["train", str(new), "--out", str(out), "--quiet", "--force"]) == 130
  finally:
    signal.signal(signal.SIGINT, previous)
  err = capsys.readouterr().err
  assert "stopped (Ctrl-C)" in err and "--resume" not in err, err
  assert outdir.resumable(cfg, out) and not outdir.resumable(config_lib.load(str(new)), out)


@pytest.mark.parametrize("signum, said", [(signal.SIGINT, ""), (signal.SIGTERM, "SIGTERM")])
def test_a_stop_in_the_baseline_waits_for_the_end_of_its_step(signum, said):
  # Ctrl-C while the baseline compiled or stepped (in the job's own process) raised
  # inside XLA's work, and the job died of a segmentation fault (exit 139) on its way
  # out. The stop is now noted, and raised between steps.
  from gmjax.app import stops  # pylint: disable=g-import-not-at-top

  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt, match=f"^{said}$"):
      with stops.deferred() as check:
        check()
        os.kill(os.getpid(), signum)
        time.sleep(0.5)  # delivered: noted, not raised
        check()
    with pytest.raises(KeyboardInterrupt):  # one after the last check is not lost
      with stops.deferred():
        os.kill(os.getpid(), signum)
        time.sleep(0.5)
  finally:
    signal.signal(signal.SIGINT, previous)


def test_links_and_runs_as_the_output_folder_are_named(tmp_path, capsys):
  # --force on an <out>/run that is a link: a raw traceback (rmtree refuses links) after
  # "deleting the previous run"; an --out that is a run itself: a second job's run,
  # config and states written inside the first run; a link to nothing: "[Errno 17]".
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  target = tmp_path / "elsewhere" / "run"
  target.mkdir(parents=True)
  (target / "manifest.json").write_text("{}")
  out = tmp_path / "out"
  out.mkdir()
  (out / "run").symlink_to(target)
  assert cli.main(["train", str(config), "--out", str(out), "--force", "--quiet"]) == 2
  err = capsys.readouterr()
  assert f"{out / 'run'} is a link to {target}" in err.err and "deleting" not in err.out
  assert (target / "manifest.json").read_text() == "{}" and (out / "run").is_symlink()
  assert cli.main(["train", str(config), "--out", str(target), "--quiet"]) == 2
  err = capsys.readouterr().err
  assert f"output folder {target} (--out" in err and "is a run itself" in err, err
  assert sorted(os.listdir(target)) == ["manifest.json"]
  (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
  assert cli.main(["train", str(config), "--out", str(tmp_path / "dangling")]) == 2
  err = capsys.readouterr().err
  assert f"is a link to {tmp_path / 'nowhere'}, which does not exist" in err, err


def test_one_data_parallel_worker_sends_nothing(tmp_path):
  # The baseline of a one-learner job was said to send a full gradient a step.
  from gmjax.app import cli, config as config_lib, model, train  # pylint: disable=g-import-not-at-top

  config = tmp_path / "one.toml"
  config.write_text(TINY.replace("learners = 2", "learners = 1"))
  cfg = config_lib.load(config)
  _, params = model.build(cfg.model, seed=0)
  sent = train.bytes_by_learner(cfg, params, [], ["learner-0"])
  assert sent["baseline"] == 0
  assert "| baseline | 5.0000 | 1.000 | 0.00 MiB | - |" in cli.results_table(
      {"learner-0": 5.0, "baseline": 5.0}, sent)
  config.write_text(TINY)
  two = config_lib.load(config)
  assert train.bytes_by_learner(two, params, [], ["learner-0", "learner-1"])["baseline"] > 0


def test_a_contribution_that_came_after_its_round_closed_counts_as_sent(tmp_path):
  # The bytes a learner sent were counted from the round records' participants and
  # rejections: a contribution published after its round had closed without it (a
  # learner that came back late) was uploaded all the same, and not counted.
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.app import config as config_lib, model, train  # pylint: disable=g-import-not-at-top
  from gmjax.mail import contributions  # pylint: disable=g-import-not-at-top

  config = tmp_path / "tiny.toml"
  config.write_text(TINY)
  cfg = config_lib.load(config)
  _, params = model.build(cfg.model, seed=0)
  run = gmjax.mail.create(str(tmp_path / "run"), params, cfg.diloco)
  plan = run.plan
  for round_, learner in ((0, "learner-0"), (0, "learner-1"), (1, "learner-1")):
    names = plan[run.manifest.schedule.fragment_of(round_)]
    delta = {n: np.zeros(run.schema.subset([n]).parameters[0].shape, np.float32)
             for n in names}
    run.store.put(f"rounds/{round_}/{learner}.safetensors", contributions.dumps(
        delta, learner=learner, round_=round_, fragment=run.manifest.schedule.fragment_of(
            round_), base_version=0, local_step=2, steps=2, tokens=2, step_seconds=0.01,
        final=False, precision=None, key=None))
  run.store.put("rounds/1/notes.txt", b"not a contribution")
  assert run.rounds() == []  # no round closed: every one of them came late
  assert sorted(train.published(run)) == [(0, "learner-0"), (0, "learner-1"),
                                          (1, "learner-1")]
  sent = train.bytes_by_learner(cfg, params, train.published(run), ["learner-0", "learner-1"])
  schema = cfg.diloco.cut(gmjax.Schema.from_tree(params))
  size = [cfg.diloco.delta_layout(schema.subset(n)).nbytes for n in plan]
  assert sent["learner-0"] == size[0] and sent["learner-1"] == size[0] + size[1] > 0
  # bytes.png draws the same contributions, at the steps of their rounds (it counted the
  # committed rounds' participants: nothing here).
  lines = train._bytes_sent(cfg, params, train.published(run), ["learner-0", "learner-1"])
  schedule = run.manifest.schedule
  assert [v for k, v in lines.items() if k.startswith("learner-1: DiLoCo")] == [
      [(schedule.step_of(0), size[0]), (schedule.step_of(1), size[0] + size[1])]]
  assert [v for k, v in lines.items() if k.startswith("learner-0: DiLoCo")] == [
      [(schedule.step_of(0), size[0])]]
