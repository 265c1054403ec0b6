"""Creating and opening runs: exclusive manifest, version 0, typed errors, names, keys."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import states

import mail_support as ms


def test_create_stores_version_zero(tmp_path):
  url = str(tmp_path / "run")
  config = gmjax.DiLoCo(sync_every=4, fragments=2)
  run = mail.create(url, ms.params0(), config)
  manifest = json.loads(open(os.path.join(url, "manifest.json"), encoding="utf-8").read())
  assert manifest["format"] == "gmjax/1" and manifest["auth"] is None
  assert manifest["plan"] == [list(names) for names in run.plan]
  assert run.rounds() == []
  for fragment, names in enumerate(run.plan):
    record = run.commit(fragment, 0)
    assert record.round is None and record.version == 0
    state = states.load_state(run.store, record, 1 << 30)
    for name in names:
      np.testing.assert_array_equal(state.theta[name], ms.params0()[name])
      np.testing.assert_array_equal(state.outer[f"momentum.{name}"], 0)
  assert run.status()["versions"] == {0: 0, 1: 0}


def test_create_twice(tmp_path):
  url = str(tmp_path / "run")
  config = gmjax.DiLoCo(sync_every=4)
  mail.create(url, ms.params0(), config)
  again = mail.create(url, ms.params0(), config)  # same configuration: the run itself
  assert again.config == config
  # Each difference is named with both values (only the field's name before).
  with pytest.raises(mail.RunExists, match=r"algorithm \(sync_every: stored 4, given 8\)"):
    mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=8))
  with pytest.raises(mail.RunExists, match=r"schema \(leaf '\S+': stored F32\[\d.*given absent"):
    mail.create(url, {"other": np.zeros(3, np.float32)}, config)
  with pytest.raises(mail.RunExists, match="key"):
    mail.create(url, ms.params0(), config, key="secret")
  with pytest.raises(FileExistsError):  # RunExists is a FileExistsError
    mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))


def test_open_missing_run(tmp_path):
  with pytest.raises(mail.RunNotFound, match="no run"):
    mail.open(str(tmp_path / "nothing"))
  with pytest.raises(FileNotFoundError):
    mail.open("memory://no-such-run")


def test_keys(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=4), key=b"k1")
  assert "k1" not in open(os.path.join(url, "manifest.json"), encoding="utf-8").read()
  with pytest.raises(mail.AuthenticationError, match="pass its key"):
    mail.open(url)
  with pytest.raises(mail.AuthenticationError, match="not the key"):
    mail.open(url, key="k2")
  assert mail.open(url, key="k1").key == b"k1"
  plain = str(tmp_path / "plain")
  mail.create(plain, ms.params0(), gmjax.DiLoCo(sync_every=4))
  with pytest.raises(PermissionError, match="without a key"):
    mail.open(plain, key="k1")


@pytest.mark.parametrize("key", ["", b""])
def test_an_empty_key_is_named_as_empty(tmp_path, key):
  # key="" said "must be non-empty bytes or str, got bytes": the str was encoded first.
  with pytest.raises(ValueError, match=r"key=(''|b'') is empty: pass a non-empty str or"):
    mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=4), key=key)
  with pytest.raises(TypeError, match=r"key must be non-empty bytes or str, got int"):
    mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=4), key=5)


@pytest.mark.parametrize("name", ["", "-lead", ".hidden", "a/b", "a b", "x" * 65, "é"])
def test_bad_learner_names(tmp_path, name):
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=4))
  with pytest.raises(ValueError, match="not a valid learner name"):
    run.join(name)


def test_learner_name_type_and_good_names(tmp_path):
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=4))
  with pytest.raises(TypeError, match="name must be a str"):
    run.join(7)
  for name in ["a", "Worker-3", "node_1.gpu-0", "9" * 64]:
    learner = run.join(name, poll_interval=0.02)
    learner.close(learner.pull(ms.params0()))


def test_bad_arguments(tmp_path):
  with pytest.raises(TypeError, match="gmjax.DiLoCo"):
    mail.create(str(tmp_path / "r1"), ms.params0(), {"sync_every": 4})
  run = mail.create(str(tmp_path / "r2"), ms.params0(), gmjax.DiLoCo(sync_every=4))
  with pytest.raises(ValueError, match="poll_interval"):
    run.join("a", poll_interval=0)
  learner = run.join("b", poll_interval=0.02)
  with pytest.raises(ValueError, match="pull"):
    learner.step(ms.params0())
  with pytest.raises(ValueError, match="schema"):
    learner.pull({"a": np.zeros((4, 3), np.float32)})
  learner.close(ms.params0())
  with pytest.raises(mail.LearnerClosed):
    learner.step(ms.params0())


def test_memory_run_with_jax_arrays():
  url = f"memory://create-test-{os.getpid()}"
  params = {k: jnp.asarray(v) for k, v in ms.params0().items()}
  run = mail.create(url, params, gmjax.DiLoCo(sync_every=2))
  learner = mail.open(url).join("solo", poll_interval=0.02)
  pulled = learner.pull(params)
  assert all(isinstance(v, type(params["a"])) for v in pulled.values())
  for _ in range(4):
    pulled = learner.step({k: v * 0.5 for k, v in pulled.items()})
  learner.close(pulled)
  assert [r.round for r in run.rounds()] == [0, 1]
  assert run.learners()["solo"].status == "closed"


@pytest.mark.parametrize("loss", [np.ones(3, np.float32), "0.5", [0.5], True,
                                  np.bool_(False)])
def test_a_loss_that_is_not_a_number_is_refused_before_the_step_counts(loss):
  url = f"memory://create-loss-{os.getpid()}-{type(loss).__name__}-{id(loss)}"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("solo", poll_interval=0.01)
  params = learner.pull(ms.params0())
  params = learner.step(params, loss=1.0)
  # The step that would publish round 0: refused whole, before it counts or publishes.
  with pytest.raises(ValueError,
                     match=r"loss must be None or a real number, got .*pass one number"):
    learner.step(params, loss=loss)
  assert (learner.step_count, learner.local_step) == (1, 1)
  assert run.rounds() == []
  params = learner.step(params, loss=jnp.float32(0.25))  # a scalar array is a number
  assert learner.step_count == 2
  learner.close(params)
  assert [r.round for r in run.rounds()] == [0]
  assert [p.steps for p in run.rounds()[0].participants] == [2]
  assert run.learners()["solo"].loss == 0.25


@pytest.mark.parametrize("argument,value,error,match", [
    ("poll_interval", float("inf"), ValueError, r"poll_interval must be a positive, finite"
     r" number of seconds, got inf"),
    ("startup_timeout", np.nan, ValueError, r"startup_timeout must be a positive number of"
     r" seconds, got nan"),
    ("wait_timeout", "5", TypeError, r"wait_timeout must be None .* got str '5'"),
    ("process_index", "0", TypeError, r"process_index must be None .* an int, got str '0'"),
    ("process_count", 1.0, TypeError, r"process_count must be None .* an int, got float"),
    ("process_count", 0, ValueError, r"process_count=0 are not this JAX job.s \(0 of 1\)"),
])
def test_join_refuses_bad_timeouts_and_process_numbers(argument, value, error, match):
  url = f"memory://create-join-{os.getpid()}-{argument}-{type(value).__name__}"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  with pytest.raises(error, match=match):
    run.join("a", **{"poll_interval": 0.01, argument: value})
  assert run.learners() == {}  # refused before it claimed the name or beat
  # numpy numbers are numbers; an endless wait is allowed (an endless poll is not).
  learner = run.join("a", poll_interval=np.float32(0.01), wait_timeout=np.inf,
                     startup_timeout=np.float64(np.inf))
  learner.close(learner.pull(ms.params0()))


@pytest.mark.parametrize("tokens", [np.array([3, 4]), object(), float("nan"), float("inf"),
                                    -1, 2.5, True])
def test_tokens_that_are_not_a_count_are_refused_naming_tokens(tokens):
  url = f"memory://create-tokens-{os.getpid()}-{type(tokens).__name__}-{tokens!s:.8}"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("solo", poll_interval=0.01)
  params = learner.pull(ms.params0())
  with pytest.raises(ValueError, match=r"tokens must be a non-negative int or None, got"):
    learner.step(params, tokens=tokens)
  assert (learner.step_count, learner.local_step) == (0, 0)
  for count in (np.int64(3), jnp.asarray(5), 7.0):  # integers in any form count
    params = learner.step(params, tokens=count)
  learner.close(params)
  assert [[p.tokens for p in r.participants] for r in run.rounds()] == [[8], [7]]


def test_create_refuses_an_empty_leaf_before_writing_anything(tmp_path):
  url = str(tmp_path / "run")
  params = {**ms.params0(), "unused": np.zeros((0, 3), np.float32)}
  with pytest.raises(ValueError, match=r"leaf 'unused' .*shape \(0, 3\).*no elements"):
    mail.create(url, params, gmjax.DiLoCo(sync_every=2))
  assert not os.path.exists(url)  # no half-created run
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))  # the URL is still free
  assert run.newest_versions() == {0: 0}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_create_refuses_non_finite_parameters_before_writing_anything(tmp_path, bad):
  # Θ at version 0 would hold them, and every learner's first delta (anchor − θ) would be
  # non-finite: each contribution refused, no round ever committed.
  url = str(tmp_path / "run")
  params = ms.params0()
  name = sorted(params)[-1]
  params[name] = np.asarray(params[name]).copy()
  params[name].reshape(-1)[-1] = bad
  with pytest.raises(ValueError, match=rf"leaf {name!r} holds 1 NaN or Inf value"):
    mail.create(url, params, gmjax.DiLoCo(sync_every=2))
  assert not os.path.exists(url)


@pytest.mark.parametrize("change,match", [
    ({"l5": np.zeros(4, np.float32)}, r"leaf 'l5' is F32 \(4,\), the run's F32 \(3,\)"),
    ({"l5": np.zeros(3, np.float16)}, r"leaf 'l5' is F16 \(3,\), the run's F32 \(3,\)"),
    ({"l9": np.zeros(3, np.float32)}, r"like has 'l9', which the run does not"),
    ({"l5": None}, r"like lacks 'l5'"),
])
def test_pull_names_the_leaves_that_differ_from_the_run(change, match):
  params = {f"l{i}": np.zeros(3, np.float32) for i in range(6)}
  url = f"memory://create-pull-{os.getpid()}-{sorted(change)[0]}-{id(change)}"
  run = mail.create(url, params, gmjax.DiLoCo(sync_every=2))
  learner = run.join("a", poll_interval=0.01)
  like = {k: v for k, v in {**params, **change}.items() if v is not None}
  with pytest.raises(ValueError, match=r"pull\(like\): like does not match the run's"
                     r" parameters: " + match):
    learner.pull(like)
  learner.close(learner.pull(params))


@pytest.mark.parametrize("leaf,match", [
    (np.zeros((4, 3), np.int32), r"leaf 'a' has dtype int32, but gmjax parameters must be"),
    (np.zeros((4, 3), np.float16), r"leaf 'a' has dtype float16, expected float32"),
    (np.full((4, 3), "a"), r"leaf 'a' has dtype <U1, but gmjax parameters must be"),
])
def test_step_refuses_params_of_another_dtype_before_the_step_counts(leaf, match):
  # Accepted before: integer parameters committed Θ as int32 zeros, F16 ones merged as
  # F16, and strings failed at the publishing step after it had counted.
  url = f"memory://create-dtype-{os.getpid()}-{leaf.dtype}"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("solo", poll_interval=0.01)
  params = learner.pull(ms.params0())
  with pytest.raises(ValueError, match=match):
    learner.step({**params, "a": leaf})
  assert (learner.step_count, learner.local_step) == (0, 0)
  params = learner.step({**params, "a": params["a"].astype(np.float64)})  # taken as F32
  learner.close(params)


def test_tokens_past_what_a_closer_accepts_are_refused_naming_tokens():
  # 2**40 tokens were accepted, and the closer then rejected every contribution.
  url = f"memory://create-many-tokens-{os.getpid()}"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("solo", poll_interval=0.01)
  params = learner.pull(ms.params0())
  with pytest.raises(ValueError, match=r"tokens must be at most 2\*\*30 a step, got"
                     r" 1099511627776.*not a running total"):
    learner.step(params, tokens=2**40)
  assert (learner.step_count, learner.local_step) == (0, 0)
  for _ in range(2):
    params = learner.step(params, tokens=2**30)
  learner.close(params)
  assert [[p.tokens for p in r.participants] for r in run.rounds()] == [[2**31]]


def test_a_loss_that_is_not_finite_is_kept_as_none():
  # Written as NaN, which JSON has no value for (strict readers refuse the heartbeat).
  url = f"memory://create-nan-loss-{os.getpid()}"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("solo", poll_interval=0.01)
  params = learner.step(learner.pull(ms.params0()), loss=float("nan"))
  learner.close(params)
  beat = run.learners()["solo"]
  assert beat.loss is None
  json.dumps(beat.to_json(), allow_nan=False)


@pytest.mark.parametrize("where", ["afile", "afile/run"])
def test_create_at_a_file_names_it(tmp_path, where):
  # It told the user to call gmjax.mail.create, which they had just called.
  (tmp_path / "afile").write_text("kept")
  with pytest.raises(ValueError, match=rf"url '.*{where}': .*afile is a file; pass a folder"):
    mail.create(str(tmp_path / where), ms.params0(), gmjax.DiLoCo(sync_every=2))
  assert (tmp_path / "afile").read_text() == "kept"


def test_a_path_for_the_url_is_the_runs_url_as_a_str(tmp_path):
  # A pathlib.Path was kept as the run's url: the first state save in step failed
  # ("PosixPath is not JSON serializable") after the step had counted, and so did
  # json.dumps(run.status()).
  run = mail.create(tmp_path / "run", ms.params0(), gmjax.DiLoCo(sync_every=2))
  assert run.url == str(tmp_path / "run") == mail.open(tmp_path / "run").url
  json.dumps(run.status())
  learner = run.join("a", poll_interval=ms.POLL, state_dir=tmp_path / "state")
  params = learner.pull(ms.params0())
  for step in range(2):  # the second applies round 0's commit and saves the state
    params = learner.step(params, state={"count": np.int32(step)}, position=step)
  learner.close(params)
  assert mail.open(str(tmp_path / "run")).rounds()[0].round == 0


def test_pull_of_no_parameters_names_pull():
  # pull(None) said only "Schema.from_tree got a tree with no array leaves."
  run = mail.create(f"memory://create-pull-none-{os.getpid()}", ms.params0(),
                    gmjax.DiLoCo(sync_every=2))
  learner = run.join("a", poll_interval=0.01)
  for like in (None, {}):
    with pytest.raises(ValueError, match=r"^pull\(like\): .*no array leaves.*run.schema"):
      learner.pull(like)
  learner.close(learner.pull(ms.params0()))
