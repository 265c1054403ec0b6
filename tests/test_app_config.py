"""The demo job's TOML configuration: the shipped configs load, bad ones are refused."""

import pathlib

import pytest

from gmjax.app import config as config_lib
from gmjax.core.diloco import DiLoCo

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_configs_load(path):
  cfg = config_lib.load(path)
  assert cfg.learners >= 1 and cfg.diloco.sync_every > 0
  assert cfg.steps >= cfg.diloco.sync_every  # every shipped job reaches a round


def _write(tmp_path, text):
  path = tmp_path / "c.toml"
  path.write_text(text)
  return path


BASE = """
[train]
learners = 2
steps = 4
batch_size = 2
learning_rate = 1e-3
[diloco]
sync_every = 2
"""


def test_defaults_and_name(tmp_path):
  cfg = config_lib.load(_write(tmp_path, BASE))
  assert cfg.name == "c" and cfg.out == "runs/c" and cfg.diloco.sync_every == 2


def test_out_under_home_is_where_the_run_lies(tmp_path, monkeypatch):
  # The run's store expanded "~" while the job's outputs, lock and checks for a run
  # already there took it literally (./~/...): a second job joined the first's run.
  import dataclasses  # pylint: disable=g-import-not-at-top

  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  cfg = config_lib.load(_write(tmp_path, BASE.replace("[train]", "[train]\nout = '~/runs/x'")))
  assert cfg.out == str(tmp_path / "home" / "runs" / "x")
  assert dataclasses.replace(cfg, out="~/y").out == str(tmp_path / "home" / "y")  # --out
  assert config_lib.TrainConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    "text, message",
    [
        (BASE.replace("learners = 2", "learners = 0"), "learners"),
        (BASE.replace("learners = 2", "learners = 'two'"), "learners"),
        (BASE + "bogus = 1\n", "bogus"),
        (BASE.replace("sync_every = 2", "sync_every = 2\nfragments = 3"), "fragments"),
        (BASE.replace("sync_every = 2", "sync_every = 2\ndelta_precision = 'F3'"), "delta_precision"),
        (BASE + "[extra]\n", "extra"),
        (BASE.replace("sync_every = 2", ""), r"needs sync_every .*e\.g\. sync_every = 20"),
        ("[train\n", "TOML"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, text, message):
  with pytest.raises(ValueError, match=message):
    config_lib.load(_write(tmp_path, text))


@pytest.mark.parametrize("table, wrong, right", [
    ("diloco", "sync_evry", "sync_every"), ("train", "learnres", "learners"),
    ("model", "d_modl", "d_model")])
def test_an_unknown_key_is_named_with_the_closest_known_one(tmp_path, table, wrong, right):
  text = (BASE.replace(f"[{table}]\n", f"[{table}]\n{wrong} = 1\n") if f"[{table}]" in BASE
          else BASE + f"[{table}]\n{wrong} = 1\n")
  with pytest.raises(ValueError, match=rf"\[{table}\]: unknown key '{wrong}'; did you mean"
                                       rf" '{right}'\?"):
    config_lib.load(_write(tmp_path, text))


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="quickstart"):
    config_lib.load("no/such/file.toml")
  with pytest.raises(ValueError, match="is a folder; pass a TOML file"):
    config_lib.load(tmp_path)  # was "not found"
  # A raw UnicodeDecodeError, naming no file; a byte order mark, an unexplained error.
  (tmp_path / "latin.toml").write_bytes(BASE.encode().replace(b"[train]", b"# \xff\n[train]"))
  with pytest.raises(ValueError, match=r"latin\.toml' is not UTF-8 text .* save it as UTF-8"):
    config_lib.load(tmp_path / "latin.toml")
  (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf" + BASE.encode())
  with pytest.raises(ValueError, match=r"is not valid TOML: .*byte order mark"):
    config_lib.load(tmp_path / "bom.toml")


@pytest.mark.parametrize("old, new, message", [
    ("learners = 2", "learners = 0", r"\[train\] learners = 0 must be >= 1"),
    ("steps = 4", "steps = -3", r"\[train\] steps = -3 must be >= 1"),
    ("batch_size = 2", "batch_size = 0", r"\[train\] batch_size = 0 must be >= 1"),
    ("steps = 4", "steps = 4\neval_every = 0", r"\[train\] eval_every = 0 must be >= 1"),
    ("steps = 4", "steps = 4\neval_batches = 0", r"\[train\] eval_batches = 0 must be >= 1"),
    ("steps = 4", "steps = 4\neval_batches = 1000000000", r"\[train\] eval_batches ="
     r" 1000000000 is too many: the held-out windows would hold .* set eval_batches <= \d+"),
    ("steps = 4", "steps = 4\ncorpus_bytes = 0", r"\[train\] corpus_bytes = 0 must be >= 1"),
    ("steps = 4", "steps = 4\nwarmup_steps = -1", r"\[train\] warmup_steps = -1 must be >= 0"),
    ("steps = 4", "steps = 4\nseed = -1", r"\[train\] seed = -1 must be >= 0"),
    ("learning_rate = 1e-3", "learning_rate = 0.0", r"\[train\] learning_rate = 0.0 must be"
     r" a finite number > 0"),
    ("learning_rate = 1e-3", "learning_rate = nan", r"\[train\] learning_rate = nan"),
    ("steps = 4", "steps = 4\npoll_interval = 0", r"\[train\] poll_interval = 0.0 must be"),
    ("steps = 4", "steps = 4\nweight_decay = -0.1", r"\[train\] weight_decay = -0.1 must be"),
    ("steps = 4", "steps = 4\nout = ''", r"\[train\] out = '' must not be empty"),
    ("[diloco]", "[model]\nseq_len = 100000\n[diloco]",
     r"\[model\] seq_len = 100000 is too long for the demo model.*set seq_len <= \d+"),
    ("[diloco]", "[model]\nseq_len = 0\n[diloco]", r"\[model\] seq_len = 0 must be a positive"),
    ("[diloco]", "[model]\nd_model = '64'\n[diloco]", r'\[model\] d_model = "64" must be a'
     r" positive whole number; e\.g\. d_model = 64"),
    ("[diloco]", "[model]\nvocab = 100\n[diloco]", r"\[model\] vocab = 100 is too small.*256"),
    ("[diloco]", "[model]\nd_model = 30\nheads = 4\n[diloco]",
     r"\[model\] heads = 4 does not divide d_model = 30.*e.g. 3"),
    ("sync_every = 2", "sync_every = 2\nouter = 'custom'", r"\[diloco\] outer = 'custom'"),
    ("sync_every = 2", "sync_every = 2\nouter_momentum = 1.5", r"\[diloco\].*outer_momentum"),
    ("steps = 4", "steps = 4\nseq_len = 64", r"\[train\]: unknown key 'seq_len'; it belongs in"
     r" \[model\]"),
    # A value of the wrong type, spelled as in the TOML file, with one of the right type.
    ("steps = 4", 'steps = "4"', r'\[train\] steps = "4" must be a whole number; e\.g\.'
     r" steps = 240"),
    ("steps = 4", "steps = true", r"\[train\] steps = true must be a whole number"),
    ("steps = 4", "steps = 4\nbaseline = 1", r"\[train\] baseline = 1 must be true or false;"
     r" e\.g\. baseline = true"),
    ("learning_rate = 1e-3", 'learning_rate = "1e-3"', r'\[train\] learning_rate = "1e-3" must'
     r" be a number; e\.g\. learning_rate = 0\.003"),
    ("steps = 4", "steps = 4\nlearner_speeds = 0.5", r"\[train\] learner_speeds = 0\.5 must be"
     r" a list; e\.g\. learner_speeds = \[1, 1, 0\.5, 0\.25\]"),
    ("learners = 2\n", "", r"\[train\] lacks learners; set it, e\.g\. learners = 2"),
    # Accepted before, and failing after the job had started or written its files:
    ("steps = 4", "steps = 4\nseed = 2147483647", r"\[train\] seed = 2147483647 must be"
     r" below 2\*\*31 - learners = 2147483646"),
    ("[diloco]", "[model]\nvocab = 1000000000\n[diloco]", r"\[model\] makes a model of"
     r" 129,000,104,192 parameters, over the demo job's 1,073,741,824"),
    ("steps = 4", "steps = 4\nout = 'gs://bucket/x'", r"\[train\] out = 'gs://bucket/x' must"
     r" be a local folder"),
    ("[train]", "train = 1\n[other]", r"unknown tables \['other'\]"),
    # A thousand learner processes on one machine; a fix that named seq_len <= 0.
    ("learners = 2", "learners = 1000", r"\[train\] learners = 1000 must be at most 64:"),
    ("steps = 4", "steps = 4\nstep_ms = 1e300", r"\[train\] step_ms = 1e\+300 must be at"
     r" most 3600000 \(an hour a step"),
    ("steps = 4", "steps = 4\npoll_interval = 1e9", r"\[train\] poll_interval = 1000000000\.0"
     r" must be at most 60"),
    ("batch_size = 2", "batch_size = 1000000000", r"\[train\] batch_size = 1000000000 is too"
     r" large for the demo model.*at any seq_len; lower batch_size"),
    ("learners = 2", 'learners = 2\nlearner_speeds = [1, "a"]', r'learner_speeds = \[1, "a"\]:'
     r' "a" is not a finite number'),
])
def test_every_value_is_checked_with_a_fix(tmp_path, old, new, message):
  with pytest.raises(ValueError, match=message) as error:
    config_lib.load(_write(tmp_path, BASE.replace(old, new, 1)))
  assert "\n" not in str(error.value)


def test_seq_len_is_checked_against_what_the_batch_allows(tmp_path):
  long = BASE.replace("[diloco]", "[model]\nseq_len = 5000\n[diloco]")
  config_lib.load(_write(tmp_path, long.replace("[train]", "[train]\nbaseline = false")))
  with pytest.raises(ValueError, match=r"at batch 4 \(the baseline's"):
    config_lib.load(_write(tmp_path, long))


@pytest.mark.parametrize("old, new, message", [
    ("steps = 4", "steps = 4\ncorpus_bytes = 100",
     r"\[model\] seq_len = 64: with \[train\] corpus_bytes = 100, each of the 2 learners'"
     r" shards holds 0 training tokens.*raise corpus_bytes"),
    ("[diloco]", "[model]\nseq_len = 1000\n[diloco]\n", None),
])
def test_check_data_names_a_corpus_too_short(tmp_path, old, new, message):
  cfg = config_lib.load(_write(tmp_path, BASE.replace(old, new, 1)))
  if message is None:
    config_lib.check_data(cfg)
    return
  with pytest.raises(ValueError, match=message):
    config_lib.check_data(cfg)


def test_train_refuses_before_starting_anything(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  config = _write(tmp_path, BASE.replace("[diloco]", "[model]\nseq_len = 100000\n[diloco]"))
  out = tmp_path / "out"
  result = subprocess.run(
      [sys.executable, "-m", "gmjax.app.cli", "train", str(config), "--out", str(out)],
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2, result.stderr
  assert result.stderr.startswith("gmjax train: config [model] seq_len = 100000")
  assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
  assert not out.exists()  # no file written, no learner started


@pytest.mark.parametrize("speeds, message", [
    ("[1]", r"learner_speeds = \[1\] has 1 values for learners = 2; give one speed per"),
    ("[1, 0]", r"learner_speeds = \[1, 0\]: 0 is not a finite number > 0"),
    ("[1, -0.5]", r"-0.5 is not a finite number > 0"),
    ("[1, nan]", r"nan is not a finite number > 0"),
    ("[1, true]", r"\[1, true\]: true is not a finite number > 0"),  # spelled as in TOML
    ("[1, '0.5']", r'"0.5" is not a finite number > 0'),
    ("0.5", r"\[train\] learner_speeds = 0.5 must be a list"),
    # A slowdown of 1e300: the learner's sleep overflowed (a traceback from each).
    ("[1, 1e-300]", r"would take 1e\+300 times the fastest's step time, over 1000"),
])
def test_learner_speeds_are_checked_with_a_fix(tmp_path, speeds, message):
  text = BASE.replace("steps = 4", f"steps = 4\nlearner_speeds = {speeds}")
  with pytest.raises(ValueError, match=message) as error:
    config_lib.load(_write(tmp_path, text))
  assert "\n" not in str(error.value)


def test_learner_speeds_set_each_learners_slowdown_against_the_fastest(tmp_path):
  cfg = config_lib.load(_write(tmp_path, BASE.replace(
      "learners = 2", "learners = 3\nlearner_speeds = [2, 1, 0.5]")))
  assert cfg.learner_speeds == (2.0, 1.0, 0.5)
  assert [cfg.slowdown(i) for i in range(3)] == [1.0, 2.0, 4.0]
  assert cfg.to_json()["learner_speeds"] == [2.0, 1.0, 0.5]
  plain = config_lib.load(_write(tmp_path, BASE))
  assert plain.learner_speeds is None and plain.slowdown(1) == 1.0
  # A config without speeds records as configs did before the key (--resume compares).
  assert "learner_speeds" not in plain.to_json()


def test_adaptive_steps_reaches_diloco(tmp_path):
  text = BASE.replace("sync_every = 2", "sync_every = 2\nadaptive_steps = true")
  assert config_lib.load(_write(tmp_path, text)).diloco.adaptive_steps is True


def test_a_config_with_outer_options_records_itself(tmp_path):
  # The run's record of its configuration (TrainConfig.to_json, written before training)
  # failed on the options' read-only mapping.
  text = BASE.replace("[diloco]\n", "[diloco]\nouter_options = { learning_rate = 0.5 }\n")
  cfg = config_lib.load(_write(tmp_path, text))
  assert cfg.to_json()["diloco"]["outer_options"] == {"learning_rate": 0.5}


@pytest.mark.parametrize("text, table", [
    ("train = 1\n[model]\n[diloco]\nsync_every = 2\n", "train = 1"),
    (BASE + "\nmodel = 3\n", None),
    ("model = 3\n" + BASE, "model = 3"),
    ("diloco = [1]\n[train]\nlearners = 2\nsteps = 4\nbatch_size = 2\nlearning_rate = 1e-3\n",
     "diloco = [1]"),
])
def test_a_table_that_is_not_a_table_is_named(tmp_path, text, table):
  # Raw AttributeError and TypeError tracebacks before.
  try:
    config_lib.load(_write(tmp_path, text))
  except ValueError as error:
    message = str(error)
  else:
    raise AssertionError("accepted")
  if table is not None:
    assert f"{table} must be a table; write it as [" in message, message


def test_outlier_screening_turns_off_with_false(tmp_path):
  # TOML has no null: outlier_factor = false is None, the screening of norms off.
  from gmjax.app import cli  # pylint: disable=g-import-not-at-top
  text = BASE.replace("sync_every = 2", "sync_every = 2\noutlier_factor = false")
  cfg = config_lib.load(_write(tmp_path, text))
  assert cfg.diloco.outlier_factor is None and "no outlier screening" in cli.settings_line(cfg)
  text = BASE.replace("sync_every = 2", "sync_every = 2\noutlier_factor = 4")
  cfg = config_lib.load(_write(tmp_path, text))
  assert cfg.diloco.outlier_factor == 4 and "outliers past 4x" in cli.settings_line(cfg)
  # So does every other field that takes None: overlap_steps = None (a merge when the
  # commit arrives) could not be set at all.
  text = BASE.replace("sync_every = 2", "sync_every = 2\noverlap_steps = false\n"
                      "quorum_size = false\ndelta_precision = false\ncommit_precision = false")
  cfg = config_lib.load(_write(tmp_path, text))
  assert cfg.diloco.overlap_steps is None and cfg.diloco.quorum_size is None
  assert cfg.diloco.delta_precision is None and cfg.diloco.commit_precision is None
  assert "overlap None" in cli.settings_line(cfg)
  # The settings line names the outer arguments the optimizer is built with: it said
  # "η 0.7" (outer_learning_rate's default) where outer_options set the rate to 0.9.
  text = BASE.replace("sync_every = 2", "sync_every = 2\nouter_options = {learning_rate = 0.9}")
  assert "outer sgd η 0.9 μ 0.9 Nesterov" in cli.settings_line(config_lib.load(_write(
      tmp_path, text)))
  text = BASE.replace("sync_every = 2", "sync_every = 2\nouter = 'adam'\nouter_options = "
                      "{b1 = 0.8, learning_rate = {schedule = 'constant_schedule', value = 0.5}}")
  line = cli.settings_line(config_lib.load(_write(tmp_path, text)))
  assert ('outer adam η {"schedule": "constant_schedule", "value": 0.5} {\'b1\': 0.8}'
          in line), line
  text = BASE.replace("sync_every = 2", "sync_every = 2\nnesterov = false")
  assert config_lib.load(_write(tmp_path, text)).diloco.nesterov is False
  with pytest.raises(ValueError, match=r"outlier_factor must be a number above 1 or None, got 0\.5"):
    config_lib.load(_write(tmp_path, BASE.replace("sync_every = 2",
                                                  "sync_every = 2\noutlier_factor = 0.5")))
