"""Two closers racing on one round: one commit, and both end up with it."""

import threading

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import closer as closer_lib
from gmjax.mail import contributions
from gmjax.mail import heartbeats
from gmjax.mail import states

import mail_support as ms


@pytest.mark.timeout(60)
@pytest.mark.parametrize("url_kind", ["local", "memory"])
def test_two_closers_race(tmp_path, monkeypatch, url_kind):
  url = str(tmp_path / "run") if url_kind == "local" else f"memory://race-{id(tmp_path)}"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  names = run.plan[0]
  for index, learner in enumerate(("l0", "l1")):
    joined = run.join(learner, poll_interval=0.02)
    joined.close(joined.pull(ms.params0()))
    delta = {n: np.full(ms.params0()[n].shape, index + 1.0, np.float32) for n in names}
    run.store.put(f"rounds/0/{learner}.safetensors", contributions.dumps(
        delta, learner=learner, round_=0, fragment=0, base_version=0, local_step=2,
        steps=2, tokens=2, step_seconds=0.01, final=False, precision=None, key=None))

  barrier = threading.Barrier(2)
  attempts = []
  write_commit = states.write_commit

  def racing_write_commit(store, record, key, **options):
    attempts.append(record.closer)
    barrier.wait(timeout=20)  # both have aggregated and saved: now race for the name
    return write_commit(store, record, key, **options)

  monkeypatch.setattr(states, "write_commit", racing_write_commit)
  results = {}

  def close(name):
    closer = closer_lib.Closer(run.store, run.manifest, None, name, 0.02)
    roster = heartbeats.Roster(run.store)
    roster.refresh()
    watch = closer.watch(0)
    closer.scan(watch, roster.known)
    results[name] = closer.close(watch, roster)

  threads = [threading.Thread(target=close, args=(n,)) for n in ("c0", "c1")]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert sorted(attempts) == ["c0", "c1"]
  assert results["c0"] == results["c1"]  # the winner's record, for both
  winner = results["c0"]
  assert winner.closer in ("c0", "c1")
  assert [p.learner for p in winner.participants] == ["l0", "l1"]
  versions = [e for e in run.store.list("fragments/0") if e.endswith(".commit.json")]
  assert versions == ["0.commit.json", "1.commit.json"]
  state_dirs = [e for e in run.store.list("fragments/0") if e.startswith("1-")]
  assert state_dirs == [winner.state.rsplit("/", 1)[-1]]  # the loser cleaned up
  assert [r.round for r in run.rounds()] == [0]
