"""A learner's life: start-up through a storage outage, failure, leaving, timings."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import gmjax
from gmjax import mail

import mail_faulty
import mail_support as ms


def _python(script, *args):
  """Runs ``script`` in a Python process of its own, with these tests' helpers."""
  env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
  return subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                        text=True, timeout=100, check=False, env=env)


def _threads_of(name):
  return [t.name for t in threading.enumerate() if t.is_alive() and t.name.endswith(f"-{name}")]


@pytest.mark.timeout(120)
def test_failed_background_marks_the_heartbeat_and_close_cleans_up(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  run = mail.open(url)
  # Uploading a contribution fails for good (not a transient error): the worker dies.
  run.store = mail_faulty.FaultyStore(
      run.store, lambda op, path: op == "put" and path.startswith("rounds/"),
      error=lambda: PermissionError("injected: bucket is read-only"))
  learner = run.join("w0", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  params = learner.step(params)
  with pytest.raises(mail.LearnerClosed):
    learner.step(params)  # publishes round 0 and waits for its commit
  ms.wait_for(lambda: run.learners()["w0"].status == "failed", 30, "a failed heartbeat")
  assert "PermissionError" in run.learners()["w0"].error
  with pytest.raises(mail.LearnerClosed):
    learner.step(params)
  with pytest.raises(mail.LearnerClosed):
    learner.close(params)
  assert _threads_of("w0") == []
  assert run.learners()["w0"].status == "failed"
  learner.close(params)  # closing again is a no-op


@pytest.mark.timeout(120)
def test_exit_flushes_and_always_cleans_up(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  with mail.open(url).join("w0", poll_interval=ms.POLL) as learner:
    params = learner.pull(ms.params0())
    for _ in range(3):  # round 0 at step 2, then one step more
      params = learner.step(ms.inner(params, ms.target(0)))
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1]
  assert rounds[1].final == ("w0",) and rounds[1].participants[0].steps == 1
  assert run.learners()["w0"].status == "closed" and _threads_of("w0") == []

  with pytest.raises(RuntimeError, match="training broke"):
    with mail.open(url).join("w1", poll_interval=ms.POLL) as learner:
      params = learner.step(learner.pull(ms.params0()))
      raise RuntimeError("training broke")
  assert [r.round for r in run.rounds()] == [0, 1]  # no flush after an error
  assert run.learners()["w1"].status == "closed" and _threads_of("w1") == []


@pytest.mark.timeout(180)
def test_quorum_time_excludes_the_grace_period(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2),
                    keep_versions=None)  # every round's record is checked
  # A live learner that never trains: every round closes on the quorum of one, after
  # the grace period (at least 30 polls; in round 0 busy's start-up timeout, 2 s).
  idle = mail.open(url).join("idle", poll_interval=ms.POLL)
  idle.pull(ms.params0())
  try:
    ms.train(mail.open(url), "busy", 0, 12, startup_timeout=2.0)
  finally:
    idle.close(ms.params0())
  rounds = run.rounds()
  assert [r.round for r in rounds] == list(range(6))
  assert all(r.live == ("busy", "idle") for r in rounds)  # each waited out the grace
  grace_floor = 30 * ms.POLL
  assert all(r.quorum_seconds is not None and r.quorum_seconds < grace_floor
             for r in rounds)
  assert all(r.estimates.quorum < grace_floor for r in rounds)


@pytest.mark.timeout(180)
def test_learner_survives_a_storage_outage_at_start_up(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  flaky = mail.open(url)
  # Every storage call fails for 3 s from the learner's first heartbeat on: five times
  # the run's first timeout (30 polls of 0.02 s), well inside the default
  # startup_timeout.
  flaky.store = mail_faulty.FaultyStore(flaky.store, mail_faulty.outage(
      3.0, starts=lambda op, path: op == "put" and path.startswith("learners/")))
  out = {}
  ms.train(flaky, "w0", 0, 4, out=out)
  assert flaky.store.failures > 0
  assert [r.round for r in run.rounds()] == [0, 1]
  assert run.learners()["w0"].status == "closed"


def test_startup_timeout_is_checked(tmp_path):
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  with pytest.raises(ValueError, match="startup_timeout"):
    run.join("w0", startup_timeout=0)


@pytest.mark.timeout(120)
def test_an_error_in_a_with_block_leaves_at_once_with_that_error(tmp_path):
  # The block waited for the round in flight, up to wait_timeout, and then replaced the
  # user's error with RoundTimeout.
  import time  # pylint: disable=g-import-not-at-top

  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, overlap_steps=None))
  slow = run.join("slow", poll_interval=ms.POLL)  # live, never steps: round 0 waits
  slow.pull(ms.params0())
  with pytest.raises(ValueError, match="bad batch") as raised:
    with run.join("fast", poll_interval=ms.POLL, wait_timeout=30) as learner:
      params = learner.pull(ms.params0())
      for _ in range(2):  # publishes round 0, which waits for "slow"
        params = learner.step(ms.inner(params, ms.target(0)))
      started = time.monotonic()
      raise ValueError("bad batch")
  assert time.monotonic() - started < 10 and raised.value.__context__ is None
  assert run.learners()["fast"].status == "closed" and _threads_of("fast") == []
  slow.close(None)


@pytest.mark.timeout(120)
def test_close_leaves_rounds_that_do_not_commit_and_returns(tmp_path, caplog):
  # It raised RoundTimeout after wait_timeout, losing the params merged so far.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, overlap_steps=None,
                                                    flush_on_close=False))
  slow = run.join("slow", poll_interval=ms.POLL)
  slow.pull(ms.params0())
  learner = run.join("fast", poll_interval=ms.POLL, wait_timeout=1.0)
  params = learner.pull(ms.params0())
  for _ in range(2):
    params = learner.step(ms.inner(params, ms.target(0)))
  closed = learner.close(params)
  for name, value in params.items():
    np.testing.assert_array_equal(np.asarray(closed[name]), np.asarray(value))
  assert "leaving without the rounds still in flight" in caplog.text
  assert run.learners()["fast"].status == "closed" and _threads_of("fast") == []
  slow.close(None)


@pytest.mark.timeout(120)
def test_close_with_wrong_params_leaves_the_learner_open_for_a_right_close(tmp_path):
  # The learner was marked closed before the params were checked: the corrected close
  # returned at once and its trained steps were never published.
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=4))
  learner = run.join("a", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  for _ in range(3):
    params = learner.step(ms.inner(params, ms.target(0)))
  with pytest.raises(ValueError, match="shape"):
    learner.close({n: np.zeros(7, np.float32) for n in params})
  assert run.learners()["a"].status == "live"
  learner.close(params)
  assert [(r.round, [(p.learner, p.steps) for p in r.participants])
          for r in run.rounds()] == [(0, [("a", 3)])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait_timeout", [60.0, 1.0])
def test_close_waits_for_its_final_round_as_step_waits(tmp_path, monkeypatch, caplog,
                                                       wait_timeout):
  # close waited one run timeout (about 1 s here) for its final round, not wait_timeout,
  # and said so at INFO: a final commit slower than that was left out of what it returned.
  import time  # pylint: disable=g-import-not-at-top
  from gmjax.mail import states  # pylint: disable=g-import-not-at-top

  save = states.save_state
  def slow_final_commit(store, fragment, state, nonce):
    if state.version == 2:  # round 1, the final round of one step
      time.sleep(3.0)
    return save(store, fragment, state, nonce)
  monkeypatch.setattr(states, "save_state", slow_final_commit)
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  _, closed = ms.train(run, "w0", 0, 3, wait_timeout=wait_timeout)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1] and rounds[1].final == ("w0",)
  newest = states.load_theta(run.store, run.commit(0, 2), 1 << 30)
  before = states.load_theta(run.store, run.commit(0, 1), 1 << 30)
  unmerged = ms.inner(before, ms.target(0))  # the one step past version 1
  expected = newest if wait_timeout > 3.0 else unmerged
  for name, value in expected.items():
    np.testing.assert_allclose(np.asarray(closed[name]), value, rtol=1e-6)
  warned = [r for r in caplog.records if r.levelname == "WARNING"
            and "final round 1 not committed" in r.getMessage()]
  assert len(warned) == (wait_timeout < 3.0), caplog.text


@pytest.mark.timeout(120)
def test_an_interrupted_close_stops_the_threads_and_a_second_one_finishes(tmp_path):
  # Ctrl-C in close()'s cleanup left its threads running and its heartbeat "closing"
  # for good (the name taken until the process ended); a second close did nothing.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("w0", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  stop = learner._worker.stop  # pylint: disable=protected-access

  def interrupted(timeout):
    learner._worker.stop = stop  # pylint: disable=protected-access
    raise KeyboardInterrupt

  learner._worker.stop = interrupted  # pylint: disable=protected-access
  with pytest.raises(KeyboardInterrupt):
    learner.close(params)
  assert run.learners()["w0"].status == "closed"  # the heartbeat part still ran
  learner.close(params)  # finishes what the interrupt stopped
  assert _threads_of("w0") == []
  again = run.join("w0", poll_interval=ms.POLL)
  again.close(again.pull(ms.params0()))


@pytest.mark.timeout(120)
def test_a_script_that_ends_without_close_exits_cleanly_and_publishes(tmp_path):
  # Its threads were still in XLA or a storage write at the interpreter's finalization:
  # the process aborted ("terminate called ...", exit -6) and the contribution was lost.
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, overlap_steps=None))
  child = (
      "import sys\n"
      "import gmjax\n"
      "import mail_support as ms\n"
      "learner = gmjax.mail.open(sys.argv[1]).join('w0', poll_interval=0.02)\n"
      "params = learner.pull(ms.params0())\n"
      "for _ in range(2):\n"
      "  params = learner.step(ms.inner(params, ms.target(0)))\n"
      "raise RuntimeError('training crashed')\n")
  result = _python(child, url)
  assert result.returncode == 1, result.stderr[-2000:]
  assert "training crashed" in result.stderr and "terminate called" not in result.stderr
  run = mail.open(url)
  assert [p.learner for p in run.rounds()[0].participants] == ["w0"]
  assert run.learners()["w0"].status == "closed"
  # A learner trained by a thread Python waits for at exit is closed after it, not
  # under it when the main thread ends.
  threaded = (
      "import sys, threading, time\n"
      "import gmjax\n"
      "import mail_support as ms\n"
      "pulled = threading.Event()\n"
      "def train():\n"
      "  learner = gmjax.mail.open(sys.argv[1]).join('w1', poll_interval=0.02)\n"
      "  params = learner.pull(ms.params0())\n"
      "  pulled.set()\n"
      "  time.sleep(1.0)  # the main thread has ended by now\n"
      "  for _ in range(2):\n"
      "    params = learner.step(ms.inner(params, ms.target(1)))\n"
      "  print('trained', flush=True)\n"
      "threading.Thread(target=train).start()\n"
      "pulled.wait()\n")
  result = _python(threaded, url)
  assert result.returncode == 0 and "trained" in result.stdout, result.stderr[-2000:]
  assert mail.open(url).learners()["w1"].status == "closed"


@pytest.mark.timeout(120)
def test_a_round_record_lists_who_was_live_when_it_closed(tmp_path, monkeypatch):
  # "live" was read after the checkpoint's save: a save longer than the liveness timeout
  # (2 s here) left it empty while the learner trained on.
  import time  # pylint: disable=g-import-not-at-top
  from gmjax.mail import states  # pylint: disable=g-import-not-at-top

  save = states.save_state
  monkeypatch.setattr(states, "save_state",
                      lambda *a, **k: (time.sleep(2.5), save(*a, **k))[1])
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  ms.train(run, "w0", 0, 4)
  assert [r.live for r in run.rounds()] == [("w0",), ("w0",)]


@pytest.mark.timeout(60)
def test_a_second_thread_calling_step_while_one_steps_is_refused(tmp_path):
  # Two threads stepping one learner published contributions of wrong step counts
  # ("metadata steps='4' is outside [1, 2]"), then crashed inside the learner
  # ("pop from empty list") or waited out wait_timeout.
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("w", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  params = learner.step(ms.inner(params, ms.target(0)))
  inside, release = threading.Event(), threading.Event()

  class Held(np.ndarray):  # a leaf whose read waits: the step holds the learner meanwhile
    def __array__(self, *args, **kwargs):
      inside.set()
      release.wait(30)
      return np.asarray(self.view(np.ndarray), *args[:1])

  held = {k: np.asarray(v).view(Held) for k, v in ms.inner(params, ms.target(0)).items()}
  out = {}
  first = threading.Thread(target=lambda: out.update(p=learner.step(held)), name="first")
  first.start()
  assert inside.wait(30)
  with pytest.raises(RuntimeError, match=r"step\(\) called in thread 'MainThread' while"
                                         r" step\(\) runs in thread 'first'; a Learner"
                                         r" takes one call at a time"):
    learner.step(params)
  release.set()
  first.join(30)
  assert learner.local_step == 2 and "p" in out
  # Between a call taking the learner and naming itself, a second call raised TypeError
  # (unpacking the holder, not yet set) instead of its RuntimeError.
  taken, done = threading.Event(), threading.Event()
  holder = threading.Thread(target=lambda: (learner._calling.acquire(), taken.set(),  # pylint: disable=protected-access
                                            done.wait(30), learner._calling.release()))  # pylint: disable=protected-access
  holder.start()
  assert taken.wait(30)
  with pytest.raises(RuntimeError, match=r"while another call runs in another thread"):
    learner.step(out["p"])
  done.set()
  holder.join(30)
  learner.close(out["p"])
  assert [len(r.participants) for r in run.rounds()] == [1]
