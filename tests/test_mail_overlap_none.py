"""overlap_steps=None with mixing 0: a contribution counts only the steps its delta holds.

A learner merges a commit at the first step after it lands, and the merge replaces the
fragment's parameters by Θ: the steps trained before it are gone from the next delta, so
they are gone from its steps and tokens too, and a step that would publish a fragment
merged at that very step publishes at the next one instead.

Two learners are driven step by step from one thread over a ``memory://`` run, one a few
steps ahead of the other, so that where the ahead one merges is fixed by the run's
``in_flight`` bound, not by timing. Every contribution's steps are checked against the
steps the learner trained since its last merge of that fragment (seen in
``learner.versions`` after each step), and the committed Θ against plain numpy DiLoCo
driven by the reported steps and tokens (``mail_support.records_reference``).
"""

import contextlib
import time
import uuid

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import states

import mail_support as ms

POLL = 0.01
TOKENS = {"m0": 1, "m1": 3}


class Driven:
  """A learner stepped by the test, with the local steps at which it merged each fragment."""

  def __init__(self, run, name):
    self.name = name
    self.learner = run.join(name, poll_interval=POLL, wait_timeout=30.0)
    self.goal = ms.target(int(name[1:]))
    self.merges = {f: [] for f in range(len(run.plan))}
    self.step_counts = []  # step_count after each step
    self.params = None

  def step(self):
    before = self.learner.versions
    self.params = self.learner.step(ms.inner(self.params, self.goal), tokens=TOKENS[self.name])
    for f, version in self.learner.versions.items():
      if version > before[f]:
        self.merges[f].append(self.learner.local_step)
    self.step_counts.append(self.learner.step_count)


def _drive(config, head_start, rounds):
  """m0 trains ``head_start`` steps, then m1 as many, then both in turn until each has
  published round ``rounds − 1``; both close."""
  url = f"memory://overlap-none-{uuid.uuid4().hex}"
  run = mail.create(url, ms.params0(), config, keep_versions=None)
  last = run.manifest.schedule.step_of(rounds - 1)
  with contextlib.ExitStack() as stack:
    driven = []
    for name in ("m0", "m1"):
      driven.append(Driven(run, name))
      stack.enter_context(driven[-1].learner)
    for d in driven:  # both are live before either publishes round 0
      d.params = d.learner.pull(ms.params0())
    for d in driven:
      for _ in range(head_start):
        d.step()
    while any(d.learner.step_count < last for d in driven):
      for d in driven:
        if d.learner.step_count < last:
          d.step()
  return run, {d.name: d for d in driven}


def _check_counts_and_theta(run, driven, rounds):
  """Every contribution counts the steps since its learner's last merge of the fragment
  (or its previous contribution to it), and Θ is what those counts give in numpy."""
  schedule = run.manifest.schedule
  records = run.rounds()
  assert [r.round for r in records] == list(range(rounds))
  previous = {(name, f): 0 for name in driven for f in range(schedule.fragments)}
  for record in records:
    f = record.fragment
    assert record.rejected == () and record.outer_step, record
    assert sorted(p.learner for p in record.participants) == sorted(driven)
    total = sum(p.tokens for p in record.participants)
    for p in record.participants:
      name, published = p.learner, p.local_step
      # A merge at the publishing step itself comes after the publish (one before it
      # puts the publish off to the next step), so it is not in this contribution.
      merged = [m for m in driven[name].merges[f] if m < published]
      start = max([previous[name, f], *merged])
      assert p.steps == published - start >= 1, (record.round, p, driven[name].merges)
      assert p.tokens == p.steps * TOKENS[name]
      assert p.weight == pytest.approx(p.tokens / total, rel=1e-6)
      previous[name, f] = published
  expected = ms.records_reference(run.config, run.plan, records,
                                  {name: d.goal for name, d in driven.items()})
  for f, version in run.newest_versions().items():
    theta = states.load_theta(run.store, run.commit(f, version), 1 << 30)
    for leaf in run.plan[f]:
      np.testing.assert_allclose(theta[leaf], expected[leaf], rtol=2e-5, atol=2e-6,
                                 err_msg=f"fragment {f}, leaf {leaf}")
  return records


def _contribution(records, round_, name):
  return next(p for p in records[round_].participants if p.learner == name)


@pytest.mark.timeout(60)
def test_a_merge_mid_round_leaves_only_the_steps_after_it():
  # Two fragments, rounds at steps 2, 4, 6, ...; in_flight=1: publishing round r merges
  # round r − 1 (waiting for it if needed). m0 trains 3 steps before m1 publishes round
  # 0, so it merges fragment 0 at its step 4, halfway between its rounds 0 and 2.
  config = gmjax.DiLoCo(sync_every=4, fragments=2, overlap_steps=None, in_flight=1,
                        quorum_size=2, flush_on_close=False)
  run, driven = _drive(config, head_start=3, rounds=6)
  records = _check_counts_and_theta(run, driven, rounds=6)
  assert driven["m0"].merges[0][0] == 4
  # Steps 5 and 6, not the 4 since its round 0: steps 3 and 4 went with the merge.
  assert _contribution(records, 2, "m0").steps == 2
  assert _contribution(records, 2, "m0").tokens == 2 * TOKENS["m0"]


@pytest.mark.timeout(60)
def test_a_merge_at_the_publishing_step_puts_the_publish_off_one_step():
  # One fragment, rounds at steps 4, 8, 12, ...; in_flight=1. m0 trains 7 steps before
  # m1 publishes round 0, so it merges round 0 at its step 8, which would publish round
  # 1: with nothing of its own left in the fragment it publishes round 1 at step 9, one
  # step's worth, and its step count stays at 7 meanwhile.
  config = gmjax.DiLoCo(sync_every=4, overlap_steps=None, in_flight=1, quorum_size=2,
                        flush_on_close=False)
  run, driven = _drive(config, head_start=7, rounds=4)
  records = _check_counts_and_theta(run, driven, rounds=4)
  assert driven["m0"].merges[0][0] == 8
  assert driven["m0"].step_counts[6:9] == [7, 7, 8]
  first = _contribution(records, 1, "m0")
  assert (first.local_step, first.steps, first.tokens) == (9, 1, TOKENS["m0"])
  for d in driven.values():
    assert d.learner.step_count == run.manifest.schedule.step_of(3)


@pytest.mark.timeout(60)
def test_an_exact_restore_counts_from_the_pull(tmp_path):
  # Two fragments, rounds at steps 128 (fragment 0) and 256 (fragment 1). A learner alone
  # publishes round 0, merges its commit (and saves) a step or more later, leaves and
  # comes back: the restore is exact, but pull replaced fragment 1 by Θ as well, so its
  # round 1 counts the steps after the restore, not the ones since the start.
  config = gmjax.DiLoCo(sync_every=256, fragments=2, overlap_steps=None,
                        flush_on_close=False)
  run = mail.create(f"memory://overlap-none-{uuid.uuid4().hex}", ms.params0(), config,
                    keep_versions=None)
  goal, opt_state = ms.target(0), {"m": np.zeros((2,), np.float32)}
  learner = run.join("m0", poll_interval=POLL, wait_timeout=30.0, state_dir=tmp_path)
  params = learner.pull(ms.params0())
  for _ in range(128):
    params = learner.step(ms.inner(params, goal), state=opt_state, position=0)
  ms.wait_for(lambda: run.newest_versions()[0] == 1, 30, "round 0's commit")
  while learner.versions[0] == 0:  # its next steps merge round 0, well before step 256
    time.sleep(0.05)
    params = learner.step(ms.inner(params, goal), state=opt_state, position=0)
  merged = learner.local_step
  assert merged < 256
  learner.close(params)
  learner = run.join("m0", poll_interval=POLL, wait_timeout=30.0, state_dir=tmp_path)
  params = learner.pull(ms.params0())
  restored = learner.restore(opt_state)
  assert restored.exact and learner.step_count == learner.local_step == merged
  while learner.step_count < 256:
    params = learner.step(ms.inner(params, goal), state=opt_state, position=0)
  learner.close(params)
  records = run.rounds()
  assert [r.round for r in records] == [0, 1]
  assert [p.steps for p in records[1].participants] == [256 - merged]
  expected = ms.records_reference(config, run.plan, records, {"m0": goal})
  for f, version in run.newest_versions().items():
    theta = states.load_theta(run.store, run.commit(f, version), 1 << 30)
    for leaf in run.plan[f]:
      np.testing.assert_allclose(theta[leaf], expected[leaf], rtol=2e-5, atol=2e-6,
                                 err_msg=f"fragment {f}, leaf {leaf}")
