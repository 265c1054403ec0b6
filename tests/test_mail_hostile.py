"""Hostile files planted at a run's normal paths are rejected and recorded, and the run goes
on: headers nested deep, huge deltas, absurd reported fields, files that are not files,
and attacker text far too long to copy into records."""

import json
import os
import struct
import threading

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import states
from gmjax.core import guards
from gmjax.core.codec import layout as payload_layout
from gmjax.core.wire import Wire
from gmjax.mail import contributions

import mail_support as ms


def _values(run, fill=0.0):
  return {n: np.full(ms.params0()[n].shape, fill, np.float32) for n in run.plan[0]}


def _payload(run, round_, learner, values=None, *, key=None, steps=2, tokens=4,
             step_seconds=0.01):
  return contributions.dumps(
      values or _values(run), learner=learner, round_=round_, fragment=0,
      base_version=round_, local_step=2, steps=steps, tokens=tokens,
      step_seconds=step_seconds, final=False, precision=run.config.delta_precision, key=key)


def _mole(run, key=None, name="mole"):
  """A learner that joined and left, so its name is known to the run."""
  mole = mail.open(run.url, key=key).join(name, poll_interval=ms.POLL)
  mole.close(mole.pull(ms.params0()))


def _train_pair(url, key=None, steps=6, tokens=2):
  out = {}
  threads = ms.Threads()
  together = threading.Barrier(2, timeout=60)
  for m in range(2):
    threads.start(ms.train, mail.open(url, key=key), f"a{m}", m, steps, out=out,
                  tokens=tokens, together=together)
  threads.join(timeout=100)
  return out


def _reasons(record):
  return {x.learner: x.reason for x in record.rejected}


def _finite(run):
  for record in run.rounds():
    theta = states.load_theta(run.store, run.commit(record.fragment, record.version), 1 << 30)
    assert all(np.isfinite(v).all() for v in theta.values()), record.round


@pytest.mark.timeout(120)
def test_deep_header_of_an_unknown_learner_in_a_keyed_run_is_rejected_unread(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2), key="k")
  deep = b"[" * 1500 + b"]" * 1500  # inside the size bound, past json's recursion limit
  run.store.put("rounds/0/stranger.safetensors", struct.pack("<Q", len(deep)) + deep)
  _train_pair(url, key="k", steps=4)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1]
  # Its name never joined: rejected from the listing, before a byte of it is parsed
  # (contributions.check parses deep headers within bounds: test_contribution_header_bounds).
  assert "never joined" in _reasons(rounds[0])["stranger"]
  assert all(len(r.participants) == 2 for r in rounds)


@pytest.mark.timeout(120)
def test_huge_finite_delta_is_an_outlier_and_never_aggregated(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2))
  _mole(run)
  run.store.put("rounds/0/mole.safetensors", _payload(run, 0, "mole", _values(run, 3e38)))
  # Finite, in range, 1000x the others' norm per step: still an outlier.
  run.store.put("rounds/1/mole.safetensors", _payload(run, 1, "mole", _values(run, 300.0)))
  _train_pair(url, steps=6)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2]
  for round_ in (0, 1):
    reason = _reasons(rounds[round_])["mole"]
    assert "outlier" in reason and f"{guards.OUTLIER_FACTOR:g}x" in reason, reason
  assert all(sorted(p.learner for p in r.participants) == ["a0", "a1"] for r in rounds)
  _finite(run)


@pytest.mark.timeout(120)
def test_a_tiny_delta_makes_no_honest_delta_an_outlier(tmp_path):
  # Of three, each delta was judged by the lower median of the *other two*: the tiny
  # one. Both honest deltas were rejected, and the tiny one was aggregated alone.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=3))
  _mole(run)
  for round_ in (0, 1):
    run.store.put(f"rounds/{round_}/mole.safetensors",
                  _payload(run, round_, "mole", _values(run, 1e-6)))
  _train_pair(url, steps=6)
  rounds = run.rounds()
  for record in rounds[:2]:
    assert sorted(p.learner for p in record.participants) == ["a0", "a1", "mole"], (
        _reasons(record))
  _finite(run)


def test_quantized_delta_that_decodes_to_infinity_is_rejected(tmp_path):
  config = gmjax.DiLoCo(sync_every=2, delta_precision="F8_E4M3")
  run = mail.create(str(tmp_path / "run"), ms.params0(), config)
  schema = run.schema.subset(run.plan[0])
  entries = {}
  for spec in payload_layout(schema, "F8_E4M3").parameters:
    if spec.name.endswith(".scale"):
      entries[spec.name] = np.full(spec.shape, 3e38, np.float32)
    else:  # e4m3 code 0x7E is 448
      entries[spec.name] = np.full(spec.shape, 0x7E, np.uint8).view(
          gmjax.core.schema.NUMPY_DTYPES["F8_E4M3"])
  data = _payload(run, 0, "mole", entries)
  with pytest.raises(mail.ContributionRejected, match="decodes to NaN or Inf"):
    contributions.check(data, file_name="mole.safetensors", round_=0, fragment=0,
                        base_version=0, schema=schema, wire=Wire("F8_E4M3"),
                        known={"mole"}, key=None, max_steps=2)


def _check_i2(run, data):
  return contributions.check(data, file_name="mole.safetensors", round_=0, fragment=0,
                             base_version=0, schema=run.schema.subset(run.plan[0]),
                             wire=Wire("I2"), known={"mole"}, key=None, max_steps=2)


def _i2_entries(run, code_bytes):
  """I2 entries of the first fragment: every code byte ``code_bytes``, every scale 0.5."""
  entries = {}
  for spec in payload_layout(run.schema.subset(run.plan[0]), "I2").parameters:
    if spec.name.endswith(".scale"):
      entries[spec.name] = np.full(spec.shape, 0.5, np.float32)
    else:
      entries[spec.name] = np.full(spec.shape, code_bytes, np.uint8)
  return entries


def test_i2_code_entry_of_the_wrong_size_is_rejected(tmp_path):
  config = gmjax.DiLoCo(sync_every=2, delta_precision="I2")
  run = mail.create(str(tmp_path / "run"), ms.params0(), config)
  name = run.plan[0][0]
  size = int(np.prod(ms.params0()[name].shape))
  for wrong in (-(-size // 2), -(-size // 4) + 1, size):  # I4's size, one byte more, F8's
    entries = _i2_entries(run, 0)
    entries[name] = np.zeros((wrong,), np.uint8)
    with pytest.raises(mail.ContributionRejected,
                       match=rf"entry '{name}' has shape \({wrong},\), expected"
                       rf" \({-(-size // 4)},\)"):
      _check_i2(run, _payload(run, 0, "mole", entries))


def test_i2_minus_two_codes_decode_as_defined_and_pass(tmp_path):
  # -2 (0b10) is never encoded; a payload of them decodes to -2 · scale, as I4's -8 does,
  # and is judged like any other delta (finite; the closer weighs its norm).
  config = gmjax.DiLoCo(sync_every=2, delta_precision="I2")
  run = mail.create(str(tmp_path / "run"), ms.params0(), config)
  checked = _check_i2(run, _payload(run, 0, "mole", _i2_entries(run, 0b10101010)))
  count = sum(int(np.prod(ms.params0()[n].shape)) for n in run.plan[0])
  np.testing.assert_allclose(checked.norm_per_step, np.sqrt(count) / 2, rtol=1e-12)
  schema = run.schema.subset(run.plan[0])
  decoded = gmjax.decode(dict(checked.contribution.tensors), schema, "I2")
  for name, value in decoded.items():
    np.testing.assert_array_equal(np.asarray(value), -1.0, err_msg=name)


@pytest.mark.timeout(120)
def test_outer_step_that_is_not_finite_is_skipped_and_the_run_goes_on(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  learner = run.join("solo", poll_interval=ms.POLL, wait_timeout=60)
  params = learner.pull(ms.params0())
  for step in range(6):
    params = ms.inner(params, ms.target(0))
    if step == 1:  # the only delta of round 0 is 3e38: finite, but the outer step is not
      params = {k: np.full_like(v, -3e38) for k, v in params.items()}
    params = learner.step(params)
  learner.close(params)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2]
  assert "not finite" in rounds[0].extra["skipped"] and rounds[0].outer_step is False
  assert [p.learner for p in rounds[0].participants] == ["solo"]
  assert all("skipped" not in r.extra and r.outer_step for r in rounds[1:])
  theta0, theta1 = (states.load_theta(run.store, run.commit(0, v), 1 << 30) for v in (0, 1))
  for name in theta0:
    np.testing.assert_array_equal(theta0[name], theta1[name])
  _finite(run)


@pytest.mark.timeout(120)
def test_reported_fields_are_bounded(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2))
  _mole(run)
  run.store.put("rounds/0/mole.safetensors", _payload(run, 0, "mole", step_seconds=1e300))
  run.store.put("rounds/1/mole.safetensors", _payload(run, 1, "mole", tokens=10**30))
  run.store.put("rounds/2/mole.safetensors", _payload(run, 2, "mole", tokens=2 * 2**20))
  run.store.put("rounds/3/mole.safetensors", _payload(run, 3, "mole", steps=10**6))
  _train_pair(url, steps=8, tokens=2)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2, 3]
  assert any("step_seconds" in c["field"] and c["learner"] == "mole"
             for c in rounds[0].extra["clamped"])
  for record in rounds:
    assert record.estimates.step <= contributions.MAX_STEP_SECONDS
  assert "tokens" in _reasons(rounds[1])["mole"]
  weights = {p.learner: p.weight for p in rounds[2].participants}
  # 2 tokens a step for a0 and a1: mole's 2**20 a step is cut to 10x that.
  assert weights["mole"] == pytest.approx(10 / 12)
  assert {c["field"]: c["used"] for c in rounds[2].extra["clamped"]} == {"tokens": 40}
  assert "steps" in _reasons(rounds[3])["mole"]
  assert run.status()["timeout_seconds"] < 3600


def test_estimates_are_clamped():
  estimates = gmjax.Estimates.from_json({"step": 1e300, "quorum": float("nan"), "sync": -3})
  assert estimates.step == gmjax.core.schedule.MAX_ESTIMATE_SECONDS
  assert estimates.quorum is None and estimates.sync == 0.0
  assert estimates.timeout(0.02) <= 9 * gmjax.core.schedule.MAX_ESTIMATE_SECONDS
  assert gmjax.Estimates().updated(step=1e300).step == gmjax.core.schedule.MAX_ESTIMATE_SECONDS


@pytest.mark.timeout(120)
def test_files_that_are_not_payloads_are_rejected_without_reading_them(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2))
  for name in ("mole", "fifo", "zero", "dir"):  # known: their files are read
    _mole(run, name=name)
  folder = tmp_path / "run" / "rounds" / "0"
  folder.mkdir(parents=True)
  os.mkfifo(folder / "fifo.safetensors")
  os.symlink("/dev/zero", folder / "zero.safetensors")
  os.mkdir(folder / "dir.safetensors")
  with open(folder / "mole.safetensors", "wb") as f:
    f.truncate(3 << 30)  # sparse: 3 GiB on paper, nothing on disk
  _train_pair(url, steps=4)
  reasons = _reasons(run.rounds()[0])
  for name in ("fifo", "zero", "dir"):
    assert "not a regular file" in reasons[name], reasons
  assert "holds 3221225472 bytes" in reasons["mole"], reasons


@pytest.mark.timeout(120)
def test_attacker_text_is_quoted_short_in_records(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2))
  _mole(run)
  run.store.put("rounds/0/mole.safetensors", _payload(run, 0, "\u00e9\n" * 300))
  run.store.put("rounds/0/huge.safetensors", _payload(run, 0, "x" * (30 << 20)))
  bad_name = "rounds/0/" + "\u00e9" * 100 + ".safetensors"
  run.store.put(bad_name, b"")
  _train_pair(url, steps=4)
  record = run.rounds()[0]
  assert len(json.dumps(record.to_json())) < 16384
  for rejected in record.rejected:
    text = rejected.learner + rejected.reason
    assert text.isascii() and len(rejected.reason) < 300, rejected
  committed = tmp_path / "run" / "fragments" / "0" / "1.commit.json"
  assert committed.stat().st_size < 32768


@pytest.mark.parametrize("shape", [[1] * 65, [0, 2**70]])
def test_a_shape_numpy_cannot_hold_is_a_rejection_not_a_crash(shape, tmp_path):
  # A joined learner's file whose header names a shape numpy refuses (65 dimensions, or a
  # dimension past 2^63 beside a 0): rejected, where numpy's own ValueError would have
  # escaped the check and stopped the closer.
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2))
  size = 1 if all(d == 1 for d in shape) else 0
  header = json.dumps({"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, size]}})
  data = struct.pack("<Q", len(header)) + header.encode() + b"\0" * size
  with pytest.raises(mail.ContributionRejected, match="bad shape"):
    contributions.check(data, file_name="mole.safetensors", round_=0, fragment=0,
                        base_version=0, schema=run.schema.subset(run.plan[0]),
                        wire=Wire("F32"), known={"mole"}, key=None, max_steps=2)


def test_hostile_records_are_rejected_as_corrupt_not_raised():
  # Each raised its own exception before: hmac's TypeError for a non-ASCII signature,
  # RecursionError for a deep manifest, OverflowError for a 400-digit step time (and for
  # os.kill of a huge pid), TypeError for an unhashable incarnation.
  from gmjax.mail import heartbeats, manifest, signing  # pylint: disable=g-import-not-at-top

  key = b"k" * 32
  record = {"name": "m", "status": "live", "seq": 1}
  for signature in ("é", 7, None, "00" * 32):
    assert not signing.record_signature_ok(key, {**record, "signature": signature})
    assert not signing.payload_signature_ok(key, {}, {"signature": signature})
  assert signing.record_signature_ok(key, {**record,
                                           "signature": signing.sign_record(key, record)})
  for bad in ({"signature": "é"}, {"step_seconds": 10**400}, {"idle_seconds": 1e300},
              {"pid": 2**70}, {"pid": -1}, {"incarnation": []}, {"incarnation": "x" * 999},
              {"beat_seconds": "1"}, {"beat_seconds": -1.0}, {"beat_seconds": 10**400}):
    data = json.dumps({**record, **bad}).encode()
    with pytest.raises(heartbeats.BadHeartbeat):
      heartbeats.parse("m", data, key if "signature" in bad else None)
  with pytest.raises(mail.CorruptRecord, match="does not parse"):
    manifest.Manifest.loads(b"[" * 100_000)


@pytest.mark.timeout(120)
def test_a_planted_commit_that_readers_cannot_parse_is_superseded(tmp_path):
  # It had every field the slot check asked for, not all a reader parses: the closer took
  # it as another closer's commit of version 1, and every reader then failed on it.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  run.store.put("fragments/0/1.commit.json", json.dumps(
      {"round": 0, "fragment": 0, "version": 1, "step": 2, "participants": [],
       "rejected": [], "state": "x", "state_files": {}, "state_names": {}, "sha256": {},
       "theta_sha256": "", "committed_at": ""}).encode())
  learner = run.join("w", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  for _ in range(4):
    params = learner.step(params, tokens=4)
  learner.close(params)
  rounds = run.rounds()
  assert [(r.round, r.version) for r in rounds] == [(0, 1), (1, 2)]
  assert rounds[0].extra["supersedes"] == ["fragments/0/1.commit.json"]
  assert mail.verify(run) == []  # the superseded slot is the record's, not damage


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero"])
def test_a_fifo_or_device_in_place_of_theta_is_read_past(planted, tmp_path):
  # Θ was read without a bound: a FIFO there blocked pull for good, a link to /dev/zero
  # read forever. Now it is not a regular file: pull reads the checkpoint instead.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), key="k")
  path = os.path.join(url, run.commit(0, 0).theta)
  os.unlink(path)
  if planted == "fifo":
    os.mkfifo(path)
  else:
    os.symlink("/dev/zero", path)
  learner = mail.open(url, key="k").join("w", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  for name, value in ms.params0().items():
    np.testing.assert_array_equal(np.asarray(params[name]), value)
  learner.close(params)


def _max_file_bytes(run):
  return states.max_file_bytes(run.manifest.schema, run.manifest.config)


@pytest.mark.timeout(60)
def test_a_huge_object_in_place_of_theta_is_refused_unread(tmp_path, caplog):
  # Θ was read whole, whatever its size: an object of many GiB planted there was
  # downloaded into every learner's memory before it was found not to parse.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), key="k")
  assert 64 << 20 < _max_file_bytes(run) < 65 << 20  # tiny parameters, Orbax's allowance
  path = os.path.join(url, run.commit(0, 0).theta)
  os.truncate(path, _max_file_bytes(run) + 1)  # sparse: no disk, but read whole, memory
  learner = mail.open(url, key="k").join("w", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  for name, value in ms.params0().items():
    np.testing.assert_array_equal(np.asarray(params[name]), value)
  learner.close(params)
  assert f"more than {_max_file_bytes(run)} bytes" in caplog.text, caplog.text


@pytest.mark.timeout(60)
def test_a_huge_object_in_place_of_a_checkpoint_file_is_named_unread(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  record = run.commit(0, 0)
  name = sorted(record.state_files)[-1]
  os.truncate(os.path.join(url, record.state, name), _max_file_bytes(run) + 1)
  problems = mail.verify(url)
  assert any(f"{name}" in p and f"more than {_max_file_bytes(run)} bytes" in p
             for p in problems), problems
  with pytest.raises(mail.CorruptRecord, match=r"more than"):
    states.load_state(run.store, record, _max_file_bytes(run))


@pytest.mark.timeout(120)
def test_a_damaged_update_file_sends_the_learner_to_the_checkpoint(tmp_path, caplog):
  # A learner rebuilding Θ from the previous one and the update file raised the
  # update's CorruptRecord out of its worker instead of reading the committed Θ.
  url = str(tmp_path / "run")
  config = gmjax.DiLoCo(sync_every=2, commit_precision="BF16")
  run = mail.create(url, ms.params0(), config)
  ms.train(run, "a", 0, 2)
  record = run.commit(0, 1)
  expected = states.load_theta(run.store, record, _max_file_bytes(run))
  learner = run.join("b", poll_interval=ms.POLL)
  learner.pull(ms.params0())
  worker = learner._worker  # pylint: disable=protected-access
  worker.closer.states.clear()  # it holds Θ of version 0, not the closer's state
  theta0 = states.load_theta(run.store, run.commit(0, 0), 1 << 30)
  for damage in (lambda f: f.write(b"\0" * 64), lambda f: f.truncate(_max_file_bytes(run) + 1)):
    with open(os.path.join(url, record.update), "r+b") as f:
      damage(f)
    worker._thetas[0] = (0, theta0)  # pylint: disable=protected-access
    theta = worker._fetch(record)  # pylint: disable=protected-access
    for name, value in expected.items():
      np.testing.assert_array_equal(theta[name], value)
  learner.close(None)
  assert "update file of fragment 0 version 1 is damaged" in caplog.text, caplog.text
  assert f"more than {_max_file_bytes(run)} bytes" in caplog.text, caplog.text


def _precious(folder, *names):
  folder.mkdir()
  for name in names:
    (folder / name).write_bytes(b"precious")
    os.utime(folder / name, (1e9, 1e9))  # a day old and more: retention's age


@pytest.mark.timeout(120)
def test_folders_of_the_run_replaced_by_links_keep_the_run_inside(tmp_path):
  # <run>/rounds replaced by a link to a user's folder: pruning deleted the folder's
  # "1" (a round's name) and contributions were written there. A planted
  # learners/<name>.claims link: compaction deleted the files it pointed to.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=2)
  rounds_outside, claims_outside = tmp_path / "data", tmp_path / "other"
  _precious(rounds_outside, "1", "2")
  _precious(claims_outside, "1", "2", "3")
  os.symlink(rounds_outside, os.path.join(url, "rounds"))
  os.makedirs(os.path.join(url, "learners"), exist_ok=True)
  os.symlink(claims_outside, os.path.join(url, "learners", "ghost.claims"))
  out = _train_pair(url, steps=10)
  assert sorted(out) == ["a0", "a1"]
  assert sorted(os.listdir(rounds_outside)) == ["1", "2"]
  assert sorted(os.listdir(claims_outside)) == ["1", "2", "3"]
  assert not os.path.islink(os.path.join(url, "rounds"))
  assert max(r.round for r in run.rounds()) >= 3
  problems = mail.verify(url)  # the planted link is damage, reported
  assert len(problems) == 1 and problems[0].startswith(
      "learners/ghost.claims: is not a regular file"), problems
