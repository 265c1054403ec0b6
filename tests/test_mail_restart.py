"""A learner that keeps its own state in a state_dir across a kill and a restart."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import states

import mail_restart_worker as rw
import mail_support as ms

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mail_restart_worker.py")


def _spawn(url, name, state_dir, steps, pause_at, out):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return subprocess.Popen(
      [sys.executable, WORKER, url, name, str(state_dir), str(steps), str(pause_at), str(out)],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def _read_until(process, prefix):
  """The process's first output line starting with ``prefix`` (its output as an error)."""
  seen = []
  for line in process.stdout:
    seen.append(line)
    if line.startswith(prefix):
      return line.strip()
  process.wait(timeout=30)
  raise AssertionError(f"no {prefix!r} line; exit {process.returncode}:\n{''.join(seen)}")


def _finish(process):
  out, _ = process.communicate(timeout=120)
  assert process.returncode == 0, out
  return out


def _theta(url):
  run = mail.open(url)
  version = run.newest_versions()[0]
  return version, states.load_theta(run.store, run.commit(0, version), 1 << 30)


def _assert_bits_equal(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    x, y = np.asarray(a[name]), np.asarray(b[name])
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes(), (name, x, y)


@pytest.mark.timeout(180)
def test_a_killed_and_restarted_learner_ends_bit_identical_to_an_uninterrupted_one(tmp_path):
  config = gmjax.DiLoCo(sync_every=3)
  reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
  for url in (reference, killed):
    mail.create(url, rw.params0(), config)
  state_dir = tmp_path / "state"
  uninterrupted = _spawn(reference, "a", tmp_path / "state-ref", 12, -1, tmp_path / "ref.npz")
  first = _spawn(killed, "a", state_dir, 12, 8, tmp_path / "unused.npz")
  try:
    # Rounds commit at steps 3 and 6; steps 7 and 8 die with the process.
    assert _read_until(first, "paused") == "paused 8"
  finally:
    ms.kill(first)
  assert first.returncode == -signal.SIGKILL
  second = _spawn(killed, "a", state_dir, 12, -1, tmp_path / "killed.npz")
  assert _read_until(second, "restored") == "restored 6 exact=True step=6"
  _finish(second)
  _finish(uninterrupted)

  ref_params, killed_params = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "killed.npz")
  _assert_bits_equal(dict(ref_params), dict(killed_params))
  (ref_version, ref_theta), (version, theta) = _theta(reference), _theta(killed)
  assert ref_version == version == 4
  _assert_bits_equal(ref_theta, theta)
  _assert_bits_equal(theta, dict(killed_params))  # mixing 0: the learner ends on Θ
  # Every round had the learner: the restarted process trained round 2 again.
  rounds = mail.open(killed).rounds()
  assert [[p.learner for p in r.participants] for r in rounds] == [["a"]] * 4


def _state(seed):
  rng = np.random.default_rng(seed)
  return {"mu": rng.standard_normal((4, 3)).astype(np.float32),
          "count": np.asarray(seed, np.int32)}


def _train(learner, params, steps, first_seed):
  states_ = []
  for i in range(steps):
    state = _state(first_seed + i)
    states_.append(state)
    params = learner.step(ms.inner(params, ms.target(0)), state=state,
                          position={"offset": first_seed + i + 1})
  return params, states_


@pytest.mark.timeout(120)
def test_saves_at_each_applied_commit_and_restores_the_newest(tmp_path):
  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params = learner.pull(ms.params0())
  assert learner.restore(_state(0)) is None  # nothing saved yet
  params, given = _train(learner, params, 4, 10)
  learner.close(params)
  assert sorted(os.listdir(state_dir)) == ["2", "4"]  # the steps of the rounds it merged

  # A process killed during a save leaves a temporary directory: it is not a save.
  os.makedirs(state_dir / "6.orbax-checkpoint-tmp-1234" / "state")
  (state_dir / "6.orbax-checkpoint-tmp-1234" / "state" / "junk").write_bytes(b"torn")

  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params = learner.pull(ms.params0())
  with pytest.raises(ValueError, match=r"holds a saved state; call learner.restore"):
    learner.step(params, state=_state(0))
  restored = learner.restore(_state(0))
  assert restored.exact and restored.position == {"offset": 14}
  _assert_bits_equal(restored.state, given[3])
  assert isinstance(restored.state["mu"], np.ndarray)
  assert (learner.step_count, learner.local_step) == (4, 4)
  params, _ = _train(learner, params, 2, 20)
  learner.close(params)
  assert [r.round for r in run.rounds()] == [0, 1, 2]
  assert sorted(n for n in os.listdir(state_dir) if n.isdigit()) == ["4", "6"]


@pytest.mark.timeout(120)
def test_two_learners_keep_their_own_state_and_refuse_each_others(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learners = [run.join(f"a{i}", poll_interval=ms.POLL, state_dir=tmp_path / f"s{i}")
              for i in range(2)]
  params = [learner.pull(ms.params0()) for learner in learners]
  given, errors = {}, []

  def train(i):
    try:
      out, given[i] = _train(learners[i], params[i], 4, 100 * (i + 1))
      learners[i].close(out)
    except Exception as error:  # pylint: disable=broad-except
      errors.append(error)

  threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=100)
  assert not errors, errors
  assert [[p.learner for p in r.participants] for r in run.rounds()] == [["a0", "a1"]] * 2
  for i in range(2):
    learner = run.join(f"a{i}", poll_interval=ms.POLL, state_dir=tmp_path / f"s{i}")
    learner.pull(ms.params0())
    restored = learner.restore(_state(0))
    _assert_bits_equal(restored.state, given[i][3])
    learner.close(None)

  with pytest.raises(mail.StateDirMismatch, match=r"learner 'a0' of run .*not of learner 'a1'"):
    run.join("a1", poll_interval=ms.POLL, state_dir=tmp_path / "s0")
  other = mail.create(str(tmp_path / "other"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  with pytest.raises(mail.StateDirMismatch, match=r"give each learner of each run its own"):
    other.join("a0", poll_interval=ms.POLL, state_dir=tmp_path / "s0")
  # The same URL created again is another run.
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(url)
  again = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  with pytest.raises(mail.StateDirMismatch):
    again.join("a0", poll_interval=ms.POLL, state_dir=tmp_path / "s0")


@pytest.mark.timeout(120)
def test_a_run_that_moved_on_gets_the_state_back_with_a_warning(tmp_path, caplog):
  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params, given = _train(learner, learner.pull(ms.params0()), 2, 1)
  learner.close(params)
  ms.train(run, "b", 1, 2)  # version 2 commits while a is away
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  learner.pull(ms.params0())
  with caplog.at_level(logging.WARNING, logger="gmjax.mail.learner"):
    restored = learner.restore(_state(0))
  assert not restored.exact and restored.position == {"offset": 3}
  _assert_bits_equal(restored.state, given[1])
  assert "versions are not those of its save" in caplog.text
  assert (learner.step_count, learner.local_step) == (4, 2)
  learner.close(None)


def test_bad_state_dirs_and_arguments_are_refused(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match=r"state_dir=.*file.* is a file; pass a directory"):
    run.join("a", state_dir=tmp_path / "file")
  with pytest.raises(ValueError, match=r"state_dir='s3://b/x'.*not s3://"):
    run.join("a", state_dir="s3://b/x")
  with pytest.raises(ValueError, match=r"non-empty"):
    run.join("a", state_dir="")
  with pytest.raises(TypeError, match=r"state_dir must be"):
    run.join("a", state_dir=3)
  # Any learner, with a state_dir or not: an ordinary script took process_count=2, and
  # process 1 of it was a silent non-primary that timed out rounds later; in a real job
  # another count hung its processes' collectives.
  for index, count in ((0, 2), (1, 2), (1, 1)):
    with pytest.raises(ValueError, match=rf"process_index={index}, process_count={count} are"
                                         r" not this JAX job's \(0 of 1\)"):
      run.join("a", process_index=index, process_count=count)
  with pytest.raises(ValueError, match=r"process_count=2 are not this JAX job's"):
    run.join("a", state_dir=tmp_path / "s", process_index=0, process_count=2)
  learner = run.join("a", poll_interval=ms.POLL, state_dir=tmp_path / "s")
  params = learner.pull(ms.params0())
  with pytest.raises(ValueError, match=r"pass step\(params, state=opt_state"):
    learner.step(params)
  learner.step(params, state=_state(1))
  with pytest.raises(ValueError, match=r"the position must be JSON"):
    learner.step(params, state=_state(1), position=object())
  learner.close(None)
  plain = run.join("b", poll_interval=ms.POLL)
  params = plain.pull(ms.params0())
  with pytest.raises(ValueError, match=r"needs join\(\.\.\., state_dir=\.\.\.\)"):
    plain.step(params, state=_state(1))
  with pytest.raises(ValueError, match=r"restore\(\) needs join"):
    plain.restore(_state(1))
  plain.close(None)


@pytest.mark.timeout(120)
def test_error_feedback_residuals_come_back_with_the_state(tmp_path):
  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  config = gmjax.DiLoCo(sync_every=2, delta_precision="I4", error_feedback=0.9)
  run = mail.create(url, ms.params0(), config)
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params, _ = _train(learner, learner.pull(ms.params0()), 4, 1)
  residuals = {f: {n: a.copy() for n, a in r.items()} for f, r in learner._residuals.items()}
  assert any(np.any(a != 0) for r in residuals.values() for a in r.values())
  learner.close(params)
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  learner.pull(ms.params0())
  assert learner.restore(_state(0)).exact
  assert sorted(learner._residuals) == sorted(residuals)
  for f in residuals:
    _assert_bits_equal(learner._residuals[f], residuals[f])
  learner.close(None)


# Saves states numbered 1, 2, ... and SIGKILLs itself inside Orbax's save of DIE_AT, after
# the save's files are written and before the rename that completes it.
_SAVER = """
import os, signal, sys
import numpy as np
from orbax.checkpoint._src.path import atomicity
from gmjax.mail import learner_state
path, die_at = sys.argv[1], int(sys.argv[2])
saving = 0
finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize_or_die(self, *args, **kwargs):
  if saving == die_at:
    print("dying", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
  return await finalize(self, *args, **kwargs)
atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die
state_dir = learner_state.StateDir(path, ("run-id", "url"), "a")
for saving in range(1, die_at + 1):
  counters = learner_state.SavedCounters(saving, saving, {0: saving}, (0,), (0,), 0)
  state_dir.save(saving, counters, {"m": np.full((256, 64), saving, np.float32)}, saving, None)
"""


@pytest.mark.timeout(120)
def test_a_process_killed_during_a_save_leaves_the_previous_one(tmp_path):
  from gmjax.mail import learner_state  # pylint: disable=g-import-not-at-top

  path = str(tmp_path / "state")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  saver = subprocess.run([sys.executable, "-c", _SAVER, path, "3"], capture_output=True,
                         text=True, env=env, timeout=100, check=False)
  assert saver.returncode == -signal.SIGKILL and "dying" in saver.stdout, saver.stderr[-2000:]
  assert [n for n in os.listdir(path) if n.startswith("3.orbax-checkpoint-tmp")]  # torn
  like = {"m": np.zeros((256, 64), np.float32)}
  state_dir = learner_state.StateDir(path, ("run-id", "url"), "a")
  assert state_dir.latest_step() == 2
  counters, state, position, _ = state_dir.restore(like, None)
  assert (counters.local_step, position, counters.versions) == (2, 2, {0: 2})
  _assert_bits_equal(state, {"m": np.full((256, 64), 2, np.float32)})
  # Saving goes on over the torn save.
  state_dir.save(3, counters, {"m": np.full((256, 64), 3, np.float32)}, 3, None)
  _, state, position, _ = state_dir.restore(like, None)
  assert position == 3 and np.all(state["m"] == 3)
  state_dir.close()


@pytest.mark.timeout(120)
def test_a_save_counts_the_rounds_in_flight(tmp_path):
  from gmjax.mail import learner_state  # pylint: disable=g-import-not-at-top

  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  # Round 1 (fragment 1, step 4) may not be published while round 0 (step 2) is in flight
  # (in_flight = 1): round 0 is merged at step 4 (a save), and round 1 is in flight then.
  run = mail.create(url, ms.params0(),
                    gmjax.DiLoCo(sync_every=4, fragments=2, overlap_steps=3))
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params, given = _train(learner, learner.pull(ms.params0()), 5, 1)
  own = learner._state_dir
  saved = learner_state.StateDir(own.path, (own.run_id, own.run_url), "a")
  counters, state, position, _ = saved.restore(_state(0), None)
  saved.close()
  assert (counters.step_count, counters.outstanding, position) == (4, 1, {"offset": 5})
  assert counters.versions == {0: 1, 1: 0}
  _assert_bits_equal(state, given[3])
  learner.close(params)


@pytest.mark.timeout(120)
def test_restore_refuses_a_like_that_is_not_shaped_like_the_save(tmp_path):
  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params, given = _train(learner, learner.pull(ms.params0()), 2, 10)
  learner.close(params)

  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params = learner.pull(ms.params0())
  transposed = {"mu": np.zeros((3, 4), np.float32), "count": np.asarray(0, np.int32)}
  with pytest.raises(ValueError, match=r"restore\(like\).*'mu'.*\(3, 4\).*\(4, 3\)"):
    learner.restore(transposed)
  # A like of other dtypes would have the save cast to them, silently.
  narrowed = {"mu": np.zeros((4, 3), ml_dtypes.bfloat16), "count": np.asarray(0, np.int32)}
  with pytest.raises(ValueError, match=r"restore\(like\).*leaf \['mu'\] of like has shape"
                     r" \(4, 3\) bfloat16, the save shape \(4, 3\) float32"):
    learner.restore(narrowed)
  renamed = {"m": np.zeros((4, 3), np.float32), "count": np.asarray(0, np.int32)}
  with pytest.raises(ValueError, match=r"restore\(like\).*like has 2 leaves \['count'\],"
                     r" \['m'\]; the save 2 \['count'\], \['mu'\]"):
    learner.restore(renamed)
  with pytest.raises(ValueError, match=r"restore\(like\).*like has 1 leaves \['mu'\]; the save 2"):
    learner.restore({"mu": np.zeros((4, 3), np.float32)})
  assert (learner.step_count, learner.local_step) == (2, 0)  # nothing taken back yet
  # A refused restore leaves steps locked (they saved over the save, and Orbax refused
  # the save of a step it held).
  with pytest.raises(ValueError, match=r"holds a saved state; call learner.restore"):
    learner.step(params, state=_state(0), position=0)
  restored = learner.restore(_state(0))  # the right like still restores the save
  assert restored.exact and restored.position == {"offset": 12}
  _assert_bits_equal(restored.state, given[1])
  assert learner.local_step == 2
  learner.close(params)


@pytest.mark.timeout(120)
def test_a_lone_learner_stopped_before_merging_its_own_round_restores_inexactly(
    tmp_path, caplog):
  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, overlap_steps=1))
  with pytest.raises(RuntimeError, match="stopped"):
    with run.join("a", poll_interval=ms.POLL, state_dir=state_dir) as learner:
      # Round 0 publishes at step 2 and merges at 3 (a save); round 1 publishes at 4.
      _train(learner, learner.pull(ms.params0()), 4, 10)
      while run.newest_versions() != {0: 2}:  # round 1 commits, not yet merged
        time.sleep(0.01)
      raise RuntimeError("stopped")  # before the step that would merge it
  assert sorted(n for n in os.listdir(state_dir) if n.isdigit()) == ["3"]
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  learner.pull(ms.params0())
  with caplog.at_level(logging.WARNING, logger="gmjax.mail.learner"):
    restored = learner.restore(_state(0))
  # Alone in its run, yet the run moved on past its save: its own round committed.
  assert not restored.exact and "the run's versions are not those of its save" in caplog.text
  assert restored.position == {"offset": 13}
  assert (learner.step_count, learner.local_step) == (4, 3)
  learner.close(None)


@pytest.mark.timeout(120)
def test_a_save_that_recorded_no_dtypes_is_checked_on_paths_and_shapes(tmp_path):
  import json  # pylint: disable=g-import-not-at-top

  from gmjax.mail import learner_state  # pylint: disable=g-import-not-at-top

  path = str(tmp_path / "state")
  counters = learner_state.SavedCounters(1, 1, {0: 1}, (0,), (0,), 0)
  state_dir = learner_state.StateDir(path, ("run-id", "url"), "a")
  state_dir.save(1, counters, {"m": np.full((2, 3), 1.5, np.float32)}, 1, None)
  state_dir.close()
  meta_file = os.path.join(path, "1", "meta", "metadata")
  with open(meta_file) as f:
    meta = json.load(f)
  assert meta["state_leaves"] == [["['m']", [2, 3], "float32"]]
  meta["state_leaves"] = [leaf[:2] for leaf in meta["state_leaves"]]  # as saved before
  with open(meta_file, "w") as f:
    json.dump(meta, f)
  state_dir = learner_state.StateDir(path, ("run-id", "url"), "a")
  _, state, _, _ = state_dir.restore({"m": np.zeros((2, 3), np.float32)}, None)
  _assert_bits_equal(state, {"m": np.full((2, 3), 1.5, np.float32)})
  with pytest.raises(ValueError, match=r"leaf \['m'\] of like has shape \(3, 2\), the save"
                     r" shape \(2, 3\)\."):
    state_dir.restore({"m": np.zeros((3, 2), np.float32)}, None)
  state_dir.close()



@pytest.mark.timeout(120)
def test_a_state_orbax_cannot_save_is_refused_before_the_step_counts(tmp_path):
  # Orbax refused it at the save, after the step had merged a commit the caller never got.
  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params = learner.pull(ms.params0())
  for bad, shown in (({"m": "abc"}, r"state\['m'\] is str 'abc'.*cannot be saved; pass"),
                     ({"m": [np.zeros(2), object()]}, r"state\['m'\]\[1\] is object.*pass"),
                     # Taken, then refused by Orbax at the save:
                     ({"m": 2**70}, r"state\['m'\] is int 1180591620717411303424.*within"
                                   r" int64"),
                     ({"m": np.zeros((0, 3))}, r"state\['m'\] is an empty array \(shape"
                                               r" \(0, 3\)\), which Orbax cannot save")):
    with pytest.raises(ValueError, match=shown):
      learner.step(params, state=bad, position=0)
    assert (learner.step_count, learner.local_step) == (0, 0)
  state = {"m": np.zeros(2, np.float32), "count": np.int32(0), "lr": 0.1,
           "bf": jnp.zeros(2, jnp.bfloat16)}
  for position in range(1, 3):
    params = learner.step(params, state=state, position=position)
  learner.close(params)
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  learner.pull(ms.params0())
  assert learner.restore(state).position == 2
  # No step was taken: the messages said "before the first step()" all the same.
  with pytest.raises(ValueError, match=r"restore\(state\) once, after pull\(\)"):
    learner.restore(state)
  with pytest.raises(ValueError, match=r"\(or a restore\(\), which goes on from a saved"):
    learner.pull(ms.params0())
  learner.close(params)


@pytest.mark.timeout(120)
def test_numpy_and_jax_positions_are_saved_as_the_numbers_they_hold(tmp_path):
  # A data loader's step kept as np.int64 was refused as "not JSON".
  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params = learner.pull(ms.params0())
  with pytest.raises(ValueError, match=r"the position must be JSON"):
    learner.step(params, state=_state(1), position=np.float32("nan"))
  assert learner.local_step == 0
  for i in range(1, 3):
    position = {"step": np.int64(i), "shards": jnp.arange(2) + i, "lr": np.float32(0.5)}
    params = learner.step(params, state=_state(i), position=position)
  learner.close(params)
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  learner.pull(ms.params0())
  position = learner.restore(_state(0)).position
  assert position == {"step": 2, "shards": [2, 3], "lr": 0.5}
  assert type(position["step"]) is int
  learner.close(params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 2])
def test_goodput_after_a_restore_counts_the_steps_of_this_join(tmp_path, fragments):
  # trained counted the restored local_step, committed only this join's rounds: a
  # learner whose every step was committed showed 50% goodput after one restart.
  url, state_dir = str(tmp_path / "run"), tmp_path / "state"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=4, fragments=fragments))
  for stop in (16, 32):
    learner = mail.open(url).join("w", poll_interval=ms.POLL, state_dir=state_dir)
    params = learner.pull(ms.params0())
    state, position = _state(0), 0
    restored = learner.restore(state)
    if restored is not None:
      state, position = restored.state, restored.position
    while position < stop:
      position += 1
      params = learner.step(ms.inner(params, ms.target(0)), state=state, position=position)
    learner.close(params)
  pace = run.status()["learners"][0]
  assert pace["trained"] == 16, pace  # this join's steps (its save carried none here)
  if fragments == 1:  # every step of it reached a committed round
    assert (pace["committed_steps"], pace["goodput"]) == (16, 1.0), pace


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["record", "arrays", "both saves", "meta item",
                                    "state item", "both saves' arrays"])
def test_a_save_damaged_after_it_was_made_is_passed_over(tmp_path, damage, caplog):
  # A torn file in the newest save (a bad disk, after the save completed) made join
  # raise a raw JSONDecodeError, and restore a tensorstore error, though the save
  # before it was intact: the learner could rejoin only by deleting both. A save
  # missing an item raised Orbax's KeyError, and no save that restored a
  # FileNotFoundError without a fix.
  import shutil  # pylint: disable=g-import-not-at-top
  from gmjax.mail import learner_state  # pylint: disable=g-import-not-at-top

  path = str(tmp_path / "state")
  state_dir = learner_state.StateDir(path, ("run-id", "url"), "a")
  for step in (1, 2):
    counters = learner_state.SavedCounters(step, step, {0: step}, (0,), (0,), 0)
    state_dir.save(step, counters, {"m": np.full((64, 32), step, np.float32)}, step, None)
  state_dir.close()
  steps = ("1", "2") if damage.startswith("both") else ("2",)
  for step in steps:
    if damage in ("meta item", "state item"):
      shutil.rmtree(os.path.join(path, step, damage.split()[0]))
    elif "arrays" in damage:
      for root, _, files in os.walk(os.path.join(path, step, "state")):
        for name in files:
          if name != "_METADATA":
            os.truncate(os.path.join(root, name), 0)
    else:
      record = os.path.join(path, step, "meta", "metadata")
      os.truncate(record, os.path.getsize(record) // 2)
  if damage == "both saves":
    with pytest.raises(gmjax.mail.CorruptRecord, match="no save of learner 'a' is intact"):
      learner_state.StateDir(path, ("run-id", "url"), "a")
    return
  state_dir = learner_state.StateDir(path, ("run-id", "url"), "a")
  if damage == "both saves' arrays":
    with pytest.raises(gmjax.mail.CorruptRecord, match=r"no save of learner 'a' restores"
                       r" \(local steps \[2, 1\]\); delete the state_dir"):
      state_dir.restore({"m": np.zeros((64, 32), np.float32)}, None)
    return
  counters, state, position, _ = state_dir.restore({"m": np.zeros((64, 32), np.float32)},
                                                   None)
  assert (counters.local_step, position) == (1, 1)
  # Each warning names the damage in a line, not in tensorstore's 3 KB spec.
  warned = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
  assert warned and max(map(len, warned)) < 600, warned
  assert len(warned) == 1, warned  # once, not again at restore
  _assert_bits_equal(state, {"m": np.full((64, 32), 1, np.float32)})
  # The learner trains on from step 1, and its next save lands on the damaged one's
  # step (Orbax refused to save over it: every restart then failed at that save).
  counters = learner_state.SavedCounters(2, 2, {0: 2}, (0,), (0,), 0)
  state_dir.save(2, counters, {"m": np.full((64, 32), 7, np.float32)}, 7, None)
  state_dir.close()
  state_dir = learner_state.StateDir(path, ("run-id", "url"), "a")
  counters, state, position, _ = state_dir.restore({"m": np.zeros((64, 32), np.float32)},
                                                   None)
  assert (counters.local_step, position) == (2, 7)
  _assert_bits_equal(state, {"m": np.full((64, 32), 7, np.float32)})
  state_dir.close()


@pytest.mark.timeout(120)
def test_a_save_that_fails_in_a_step_is_logged_and_the_step_returns_the_merge(
    tmp_path, caplog):
  # A save that raised inside step() (a full disk) lost the commit the step had merged:
  # the caller kept its unmerged parameters, the learner its merged anchor, and the
  # next delta carried three steps' progress into Θ (3.5 where the run gives 3.0).
  import shutil  # pylint: disable=g-import-not-at-top

  zeros = {"w": np.zeros((4, 2), np.float32)}
  run = mail.create(str(tmp_path / "run"), zeros, gmjax.DiLoCo(
      sync_every=2, outer_learning_rate=0.5, outer_momentum=0.0, nesterov=False))
  state_dir = tmp_path / "state"
  learner = run.join("a", poll_interval=ms.POLL, state_dir=state_dir)
  params = learner.pull(zeros)
  for i in range(1, 7):  # rounds at steps 2, 4 and 6; each step adds 1
    if i == 4:  # the state_dir's disk goes away
      shutil.rmtree(state_dir)
      state_dir.write_text("")
    with caplog.at_level(logging.WARNING, logger="gmjax.mail.learner"):
      params = learner.step({"w": params["w"] + 1.0}, state={"m": np.ones(3, np.float32)},
                            position=i)
    if i == 4:
      warning, = [r.getMessage() for r in caplog.records
                  if "its state was not saved in state_dir" in r.getMessage()]
      # The storage's error is quoted short (tensorstore's run to kilobytes).
      assert len(warning) < 600 and "\n" not in warning, warning
      assert learner.versions == {0: 2} and float(params["w"][0, 0]) == 2.0  # merged
  learner.close(params)
  assert [[p.steps for p in r.participants] for r in run.rounds()] == [[2]] * 3
  _, theta = _theta(run.url)
  np.testing.assert_array_equal(theta["w"], np.full((4, 2), 3.0, np.float32))


@pytest.mark.timeout(120)
def test_a_learner_does_not_save_over_another_learners_save(tmp_path, caplog):
  # Two learners given one empty state_dir at once each deleted (Orbax's keep-two) or
  # saved over the other's saves: on restart one of them had lost its state.
  from gmjax.mail import learner_state  # pylint: disable=g-import-not-at-top

  path = str(tmp_path / "state")
  dirs = [learner_state.StateDir(path, ("run-id", "url"), name) for name in ("a", "b")]
  counters = learner_state.SavedCounters(2, 2, {0: 1}, (0,), (0,), 0)
  dirs[1].save(2, counters, {"m": np.ones(3, np.float32)}, 2, None)
  with pytest.raises(mail.StateDirMismatch, match=r"holds the state of learner 'b'"):
    dirs[0].save(2, counters, {"m": np.zeros(3, np.float32)}, 2, None)
  with pytest.raises(mail.StateDirMismatch, match=r"holds the state of learner 'b'"):
    dirs[0].save(4, counters, {"m": np.zeros(3, np.float32)}, 4, None)
  for state_dir in dirs:
    state_dir.close()
  again = learner_state.StateDir(path, ("run-id", "url"), "b")
  _, state, position, _ = again.restore({"m": np.zeros(3, np.float32)}, None)
  assert position == 2 and state["m"].tolist() == [1.0, 1.0, 1.0]
  again.close()


@pytest.mark.parametrize("where", ["in", "at", "file-url"])
def test_a_state_dir_inside_the_run_is_refused(tmp_path, where):
  # Orbax wrote its step folders among the run's round folders and pruned them as its
  # own; the closer logged them as rejected contributions.
  url = str(tmp_path / "run")
  run = mail.create(url if where != "file-url" else "file://" + url, ms.params0(),
                    gmjax.DiLoCo(sync_every=2))
  state_dir = {"in": tmp_path / "run" / "rounds", "at": tmp_path / "run",
               "file-url": tmp_path / "run" / "s"}[where]
  with pytest.raises(ValueError, match=r"lies inside the run's storage"):
    run.join("a", state_dir=state_dir)
  run.join("a", state_dir=tmp_path / "runs-state").close(None)  # beside it is fine
