"""The closer's jitted step compiles at join, once per run, whatever the contribution count."""

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.core import aggregator
from gmjax.mail import closer as closer_lib
from gmjax.mail import contributions
from gmjax.mail import heartbeats
from gmjax.mail import layout

import mail_support as ms


def _contribute(run, params, round_, learner, value):
  delta = {n: np.full(params[n].shape, value, np.float32) for n in run.plan[0]}
  delta = {k: np.asarray(v) for k, v in gmjax.encode(delta, "I4").items()}
  run.store.put(layout.contribution(round_, learner), contributions.dumps(
      delta, learner=learner, round_=round_, fragment=0, base_version=round_, local_step=2,
      steps=2, tokens=2, step_seconds=0.01, final=False, precision="I4", key=None))


@pytest.mark.timeout(120)
def test_close_compiles_once_for_any_count(tmp_path):
  # A schema no other test uses, so the jit cache starts without it.
  params = {**ms.params0(), "d": np.zeros((7,), np.float32)}
  run = mail.create(str(tmp_path / "run"), params, gmjax.DiLoCo(
      sync_every=2, delta_precision="I4"))
  learners = ["l0", "l1", "l2"]
  before = aggregator._close._cache_size()  # pylint: disable=protected-access
  for name in learners:
    joined = run.join(name, poll_interval=ms.POLL)
    joined.close(joined.pull(params))
    # pull returns once the closer is compiled, before any round is due.
    assert aggregator._close._cache_size() > before  # pylint: disable=protected-access
  closer = closer_lib.Closer(run.store, run.manifest, None, "c", ms.POLL)
  roster = heartbeats.Roster(run.store)
  roster.refresh()
  closer.grow(len(learners))  # as a learner's worker does at join
  compiled = aggregator._close._cache_size()  # pylint: disable=protected-access
  for round_, count in enumerate((1, 2, 3, 1)):
    for index in range(count):
      _contribute(run, params, round_, learners[index], 0.1 * (index + 1))
    watch = closer.watch(round_)
    closer.scan(watch, roster.known)
    record = closer.close(watch, roster)
    assert len(record.participants) == count and record.version == round_ + 1
    assert (record.cosine is None) == (count == 1)
  assert aggregator._close._cache_size() == compiled  # pylint: disable=protected-access


def test_padding_leaves_the_result_unchanged():
  params = ms.params0()
  config = gmjax.DiLoCo(sync_every=2, delta_precision="F8_E4M3")
  schema = gmjax.Schema.from_tree(params)
  fragment = aggregator.DiLoCoAggregator(config, schema)
  state = fragment.initial_state(params)
  rng = np.random.default_rng(0)
  found = []
  for name in ("a", "b"):
    delta = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
    entries = {k: np.asarray(v) for k, v in gmjax.encode(delta, "F8_E4M3").items()}
    found.append(gmjax.Contribution(name, 2, 2, 3, 0.0, False, entries))
  exact = fragment.close_round(state, found)
  padded = fragment.close_round(state, found, capacity=8)
  for name in exact.state.theta:
    np.testing.assert_array_equal(exact.state.theta[name], padded.state.theta[name])
  for name in exact.state.outer:
    np.testing.assert_array_equal(exact.state.outer[name], padded.state.outer[name])
  assert exact.cosine == padded.cosine and exact.participants == padded.participants
