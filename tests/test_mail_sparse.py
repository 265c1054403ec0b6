"""Sparse (top-k) contributions by mail: honest ones decode to their kept values; hostile
ones (indices out of range, repeated or unsorted within a chunk, entries of the wrong
count or dtype) are rejected with the reason and recorded, never aggregated."""

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.core import sparse
from gmjax.core.codec import to_numpy
from gmjax.core.wire import Wire
from gmjax.mail import contributions

import mail_support as ms

# Chunks of 4 keeping 2: leaf a (12 values) keeps 2+2+2, b (5) 2+1, c (4) 2.
CONFIG = gmjax.DiLoCo(sync_every=2, quorum_size=2, delta_precision="I4", delta_topk=2,
                      delta_chunk=4)


def _honest(run, seed=0):
  schema = run.schema.subset(run.plan[0])
  rng = np.random.default_rng(seed)
  values = {s.name: rng.standard_normal(s.shape).astype(np.float32)
            for s in schema.parameters}
  entries = Wire("I4", 2, 4).encode(values, schema)
  return values, to_numpy(entries, run.config.delta_layout(schema))


def _payload(run, entries, round_=0, learner="mole"):
  return contributions.dumps(
      entries, learner=learner, round_=round_, fragment=0, base_version=round_,
      local_step=2, steps=2, tokens=4, step_seconds=0.01, final=False,
      precision=run.config.delta_precision, key=None)


def _check(run, data):
  return contributions.check(
      data, file_name="mole.safetensors", round_=0, fragment=0, base_version=0,
      schema=run.schema.subset(run.plan[0]), wire=Wire("I4", 2, 4), known={"mole"},
      key=None, max_steps=2)


def _spoiled(entries, name, value):
  entries = dict(entries)
  entries[name] = value
  return entries


def test_honest_sparse_contribution_passes_and_decodes(tmp_path):
  run = mail.create(str(tmp_path / "run"), ms.params0(), CONFIG)
  values, entries = _honest(run)
  assert entries["a.index"].dtype == np.uint8 and entries["a.index"].shape == (6,)
  assert entries["b.index"].tolist() == sparse.select(values["b"], 2, 4)[1].tolist()
  checked = _check(run, _payload(run, entries))
  schema = run.schema.subset(run.plan[0])
  decoded = Wire("I4", 2, 4).decode(dict(checked.contribution.tensors), schema)
  for name, value in values.items():
    # Two of each chunk of four survive, the others are zero.
    kept = np.asarray(decoded[name]).reshape(-1)
    flat = value.reshape(-1)
    for start in range(0, flat.size, 4):
      piece = np.abs(flat[start:start + 4])
      top = np.sort(np.argsort(-piece, kind="stable")[:2])
      assert np.flatnonzero(kept[start:start + 4]).tolist() == [
          i for i in top if kept[start + i] != 0], name
  norm = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in decoded.values()))
  np.testing.assert_allclose(checked.norm_per_step, norm / 2, rtol=1e-6)


@pytest.mark.parametrize("name,value,reason", [
    ("a.index", np.array([0, 4, 1, 2, 0, 3], np.uint8),
     r"entry 'a.index': index 4 at position 1 is out of range for chunk 0 of 4 values"),
    ("b.index", np.array([0, 1, 1], np.uint8),
     r"entry 'b.index': index 1 at position 2 is out of range for chunk 1 of 1 values"),
    ("a.index", np.array([1, 1, 0, 2, 0, 3], np.uint8),
     r"entry 'a.index': index 1 at position 1 repeats"),
    ("c.index", np.array([3, 2], np.uint8),
     r"entry 'c.index': index 2 at position 1 is below the index before it in chunk 0"),
    ("a.index", np.array([0, 1, 2, 3, 0, 1, 2], np.uint8),
     r"entry 'a.index' has shape \(7,\), expected \(6,\)"),
    ("a.index", np.array([0, 1, 0, 1, 0, 1], np.uint16),
     r"entry 'a.index' is uint16, expected U8"),
    ("a", np.zeros(4, np.uint8), r"entry 'a' has shape \(4,\), expected \(3,\)"),
    ("a.scale", np.zeros(2, np.float32), r"entry 'a.scale' has shape \(2,\), expected \(1,\)"),
])
def test_hostile_sparse_entries_rejected_with_the_reason(tmp_path, name, value, reason):
  run = mail.create(str(tmp_path / "run"), ms.params0(), CONFIG)
  _, entries = _honest(run)
  with pytest.raises(mail.ContributionRejected, match=reason):
    _check(run, _payload(run, _spoiled(entries, name, value)))


def test_dense_payload_in_a_sparse_run_is_rejected(tmp_path):
  run = mail.create(str(tmp_path / "run"), ms.params0(), CONFIG)
  schema = run.schema.subset(run.plan[0])
  dense = to_numpy(Wire("I4").encode(dict(ms.params0()), schema), gmjax.layout(schema, "I4"))
  with pytest.raises(mail.ContributionRejected, match=r"layout mismatch: missing \['a.index'"):
    _check(run, _payload(run, dense))


@pytest.mark.timeout(120)
def test_hostile_sparse_payloads_are_recorded_and_never_aggregated(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), CONFIG)
  mole = mail.open(run.url).join("mole", poll_interval=ms.POLL)
  mole.close(mole.pull(ms.params0()))
  _, entries = _honest(run)
  planted = [
      _spoiled(entries, "a.index", np.array([0, 9, 0, 1, 0, 1], np.uint8)),
      _spoiled(entries, "a.index", np.array([2, 2, 0, 1, 0, 1], np.uint8)),
      _spoiled(entries, "b.index", np.array([0, 1, 0, 0], np.uint8)),
  ]
  for round_, spoiled in enumerate(planted):
    run.store.put(f"rounds/{round_}/mole.safetensors", _payload(run, spoiled, round_))
  out = {}
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, mail.open(url), f"a{m}", m, 6, out=out, tokens=2)
  threads.join(timeout=100)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2]
  reasons = [{x.learner: x.reason for x in r.rejected}["mole"] for r in rounds]
  assert "out of range" in reasons[0]
  assert "repeats" in reasons[1]
  assert "has shape (4,), expected (3,)" in reasons[2]
  assert all(sorted(p.learner for p in r.participants) == ["a0", "a1"]
             for r in rounds)
