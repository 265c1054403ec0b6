"""The demo job's TOML configuration: the shipped configs load, bad ones are refused."""

import pathlib

import pytest

from gmjax.app import config as config_lib

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_configs_load(path):
  cfg = config_lib.load(path)
  assert cfg.learners >= 1 and cfg.steps >= cfg.diloco.sync_every


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


@pytest.mark.parametrize(
    "text, message",
    [
        (BASE.replace("learners = 2", "learners = 0"), "learners"),
        (BASE.replace("learners = 2", "learners = 'two'"), "learners"),
        (BASE + "bogus = 1\n", "bogus"),
        (BASE.replace("sync_every = 2", "sync_every = 2\nfragments = 3"), "fragments"),
        (BASE.replace("sync_every = 2", "sync_every = 2\ndelta_precision = 'F3'"), "delta_precision"),
        (BASE + "[extra]\n", "extra"),
        (BASE.replace("sync_every = 2", ""), "sync_every"),
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


def test_missing_file():
  with pytest.raises(FileNotFoundError, match="quickstart"):
    config_lib.load("no/such/file.toml")


@pytest.mark.parametrize(
    "path", sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.toml")),
    ids=lambda p: p.name)
def test_shipped_configs_load(path):
  cfg = config_lib.load(path)
  assert cfg.steps > 0 and cfg.learners >= 1
  assert cfg.diloco.sync_every > 0
