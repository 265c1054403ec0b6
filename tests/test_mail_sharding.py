"""``pull`` and ``step`` keep the parameters' shardings; a learner may be a JAX job."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import gmjax
from gmjax import mail
from gmjax.mail import states

import mail_support as ms


def _same(tree, shardings):
  return all(tree[k].sharding.is_equivalent_to(shardings[k], tree[k].ndim) for k in tree)


@pytest.mark.timeout(120)
def test_pull_and_step_keep_the_sharding(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  shardings = {"a": NamedSharding(mesh, PartitionSpec("x")),
               "b": NamedSharding(mesh, PartitionSpec()),
               "c": jax.sharding.SingleDeviceSharding(jax.devices()[3])}
  like = {k: jax.device_put(v, shardings[k]) for k, v in ms.params0().items()}
  learner = mail.open(url).join("w0", poll_interval=ms.POLL)
  params = learner.pull(like)
  assert _same(params, shardings)
  for _ in range(2):  # round 0 is merged on step 2
    params = learner.step(jax.tree.map(lambda x: x * 0.5, params))
  assert learner.versions == {0: 1}
  assert _same(params, shardings)
  mixed = learner.close({**params, "c": np.asarray(params["c"])})
  assert isinstance(mixed["c"], np.ndarray)  # numpy stays numpy


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("settings", [{}, dict(outer_delay=1, eager=True)],
                         ids=["diloco", "eager"])
def test_a_two_process_jax_job_is_one_learner(tmp_path, settings):
  config = gmjax.DiLoCo(sync_every=2, **settings)
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), config)
  outs = [str(tmp_path / f"p{i}.json") for i in range(2)]
  seen = ms.two_process_job(url, 5, outs)
  assert [s["primary"] for s in seen] == [True, False]
  assert all(s["pull_sharding"] and s["step_sharding"] for s in seen)
  assert seen[0]["final"] == seen[1]["final"]
  # One learner: one heartbeat, and it alone contributed (rounds 0, 1 and a final 2).
  assert list(run.learners()) == ["job"]
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2]
  assert all([p.learner for p in r.participants] == ["job"] for r in rounds)
  theta = states.load_state(run.store, run.commit(0, 3), 1 << 30).theta
  for name, value in seen[0]["final"].items():
    np.testing.assert_array_equal(np.asarray(value, np.float32), theta[name])
  # The same learner in one process (numpy, unsharded) commits the same Θ each round:
  # the delayed (and eager) starts are the job's own, not each process's.
  alone = mail.create(str(tmp_path / "alone"), ms.params0(), config)
  ms.train(alone, "job", 0, 5)
  for version in (1, 2, 3):
    expected = states.load_state(alone.store, alone.commit(0, version), 1 << 30).theta
    got = states.load_state(run.store, run.commit(0, version), 1 << 30).theta
    for name in expected:
      np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7,
                                 err_msg=f"{name} at version {version}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_processes_of_a_job_that_join_apart_start_from_the_same_versions(tmp_path):
  # Each process read the run's newest versions itself: process 1, joining 2 s after
  # process 0 while another learner committed rounds, pulled a newer Θ, and the job's
  # parameters were one global array of two versions (its replicated leaves differed
  # from process to process), a round apart from then on.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=None)
  stop = threading.Event()

  def solo():
    learner = run.join("solo", poll_interval=ms.POLL)
    params = learner.pull(ms.params0())
    while not stop.is_set():
      params = learner.step(ms.inner(params, ms.target(1)))
    learner.close(params)

  thread = threading.Thread(target=solo)
  thread.start()
  try:
    ms.wait_for(lambda: run.newest_versions()[0] >= 3, 60, "the solo learner's rounds")
    outs = [str(tmp_path / f"p{i}.json") for i in range(2)]
    seen = ms.two_process_job(url, 4, outs, env={"JOIN_DELAY": "2"})
  finally:
    stop.set()
    thread.join(60)
  assert seen[0]["pulled"] == seen[1]["pulled"], [s["pulled"] for s in seen]
  assert seen[0]["pulled_params"] == seen[1]["pulled_params"]
  assert seen[0]["final"] == seen[1]["final"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_processes_of_a_job_with_different_state_dirs_are_refused_at_join(tmp_path):
  # Each process's own state_dir (two machines' local /tmp): the first save waited for
  # the other processes in Orbax forever.
  url, state_dir = str(tmp_path / "run"), str(tmp_path / "state")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  outs = [str(tmp_path / f"p{i}.json") for i in range(2)]
  logs = ms.two_process_job(url, 4, outs, state_dir, env={"OWN_STATE_DIR": "1"},
                            fails=True)
  for i, log in enumerate(logs):
    assert (f"join(state_dir='{state_dir}-{i}') in process {i}: processes [1] of this"
            " learner passed another state_dir than process 0's") in log, log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_process_job_keeps_its_state_in_a_state_dir(tmp_path):
  url, state_dir = str(tmp_path / "run"), str(tmp_path / "state")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  seen = []
  for steps in (4, 0):  # trains 4 steps (saves at 2 and 4), then rejoins and restores
    outs = [str(tmp_path / f"p{i}-{steps}.json") for i in range(2)]
    seen.append(ms.two_process_job(url, steps, outs, state_dir))
  assert all("restored" not in s for s in seen[0])
  for s in seen[1]:  # both processes get the state handed at step 4, sharded as given
    assert s["restored"]["position"] == 4 and s["restored"]["exact"]
    assert s["restored"]["step_count"] == 4 and s["restored"]["sharding"]
    assert s["restored"]["m"] == seen[0][0]["handed"]
