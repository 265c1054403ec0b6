"""Learners joining mid-run and leaving: the run adapts and does not stall."""

import time

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import layout
from gmjax.mail import states

import mail_support as ms


def _slow_train(run, name, index, steps, out, sleep=0.01):
  learner = run.join(name, poll_interval=ms.POLL, wait_timeout=60)
  params = learner.pull(ms.params0())
  out[f"{name}:start"] = (learner.step_count, learner.first_round, dict(params))
  goal = ms.target(index)
  for _ in range(steps):
    params = learner.step(ms.inner(params, goal))
    time.sleep(sleep)
  out[name] = learner.close(params)


@pytest.mark.timeout(120)
def test_join_mid_run_and_leave(tmp_path):
  url = str(tmp_path / "run")
  # quorum_size=2: while both are live a round waits for both, so membership is exact.
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2),
                    keep_versions=None)  # every round's record is checked
  out = {}
  threads = ms.Threads()
  threads.start(_slow_train, mail.open(url), "early", 0, 30, out)
  ms.wait_for(lambda: run.store.exists(layout.commit(0, 3)), 60, "round 2's commit")
  late_threads = ms.Threads()
  # The same goal as "early": with another one, the late learner's first deltas (far from
  # its goal) can be more than OUTLIER_FACTOR times those of "early" (near its goal by
  # then), and the closer rightly rejects them, depending on when "late" joins.
  late_threads.start(_slow_train, mail.open(url), "late", 0, 7, out)  # leaves mid-interval
  late_threads.join(timeout=100)
  threads.join(timeout=100)

  start_step, first_round, pulled = out["late:start"]
  assert start_step % 2 == 0 and start_step >= 6
  assert first_round == start_step // 2  # the first round after the newest commit
  version = start_step // 2
  theta = states.load_state(run.store, run.commit(0, version), 1 << 30).theta
  for name in theta:
    np.testing.assert_array_equal(pulled[name], theta[name])

  rounds = run.rounds()
  assert [r.round for r in rounds] == list(range(15))
  late = [r.round for r in rounds if "late" in {p.learner for p in r.participants}]
  # 7 steps: 3 rounds + 1 final. Its first round may have closed before its heartbeat
  # said it was live (then it publishes nothing there and merges the commit).
  assert late and late == list(range(late[0], first_round + 4)), late
  assert first_round <= late[0] <= first_round + 1, (first_round, late)
  final = rounds[late[-1]]
  assert final.final == ("late",)
  late_weight = {p.learner: p.steps for p in final.participants}["late"]
  assert late_weight == 1  # the one step trained since its last round
  assert all("early" in {p.learner for p in r.participants} for r in rounds)
  assert run.learners()["late"].status == "closed"
  assert run.learners()["early"].status == "closed"


def test_batch_size_follows_live_learners(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, global_batch_size=64))
  first = mail.open(url).join("one", poll_interval=0.02)
  first.pull(ms.params0())
  second = mail.open(url).join("two", poll_interval=0.02)
  second.pull(ms.params0())
  ms.wait_for(lambda: first.batch_size == 32, 10, "both learners to be seen")
  second.close(ms.params0())
  ms.wait_for(lambda: first.batch_size == 64, 10, "the closed learner to drop out")
  first.close(ms.params0())
  run = mail.create(str(tmp_path / "r2"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("x", poll_interval=0.02)
  assert learner.batch_size is None
  learner.close(learner.pull(ms.params0()))
