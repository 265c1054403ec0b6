"""The typed round record: its JSON keeps the commit file's shape, byte for byte."""

import copy
import json
import pickle

import numpy as np

import pytest

import gmjax
from gmjax import mail
from gmjax.core.schedule import MAX_ESTIMATE_SECONDS
from gmjax.mail import layout
from gmjax.mail.records import RoundRecord

import mail_support as ms

ROUND_KEYS = [
    "round", "fragment", "version", "step", "participants", "rejected", "final",
    "outer_step", "cosine", "estimates", "live", "closer", "state", "update", "theta",
    "sha256", "state_files", "state_names", "theta_sha256", "opened_at", "quorum_seconds",
    "sync_seconds", "wait_seconds", "grace_seconds", "takeover_seconds", "committed_at",
]
CREATE_KEYS = [k for k in ROUND_KEYS if k not in (
    "opened_at", "quorum_seconds", "sync_seconds", "wait_seconds", "grace_seconds",
    "takeover_seconds")]


@pytest.fixture(scope="module", params=[None, "secret"], ids=["plain", "keyed"])
def trained(request, tmp_path_factory):
  url = str(tmp_path_factory.mktemp("records") / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, commit_precision="BF16"),
                    key=request.param)
  ms.train(mail.open(url, key=request.param), "w0", 0, 4)
  return mail.open(url, key=request.param), request.param


def _raw(run, version):
  return run.store.get(layout.commit(0, version))


def test_round_trip_is_byte_for_byte(trained):
  run, key = trained
  signature = ["signature"] if key else []
  for version in range(3):
    data = _raw(run, version)
    parsed = json.loads(data)
    assert list(parsed) == (CREATE_KEYS if version == 0 else ROUND_KEYS) + signature
    record = RoundRecord.from_json(parsed)
    assert json.dumps(record.to_json(), indent=1).encode() == data
  rounds = run.rounds()
  assert all(isinstance(r, RoundRecord) and "signature" not in r.extra for r in rounds)
  assert [r.round for r in rounds] == [0, 1]
  assert rounds[0].participants[0].learner == "w0" and rounds[0].estimates.sync is not None
  for record in rounds:  # the JSON on storage, less the signature
    stored = json.loads(_raw(run, record.version))
    stored.pop("signature", None)
    assert record.to_json() == stored


def test_typed_records_round_trip_and_run_returns_them(trained):
  run, key = trained
  for version in range(3):
    record = run.commit(0, version)
    assert isinstance(record, RoundRecord) and record.version == version
    assert ("signature" in record.extra) == (key is not None)
    assert RoundRecord.from_json(record.to_json()) == record
  beats = run.learners()
  assert list(beats) == ["w0"] and isinstance(beats["w0"], mail.Heartbeat)
  beat = beats["w0"]
  assert beat.name == "w0" and beat.status == "closed" and beat.trained == 4
  assert mail.Heartbeat.from_json(beat.to_json()) == beat
  # to_json gives the heartbeat file's fields and values (the signature is kept).
  assert beat.to_json() == json.loads(run.store.get(layout.heartbeat("w0")))


def test_records_copy_and_pickle(trained):
  # Their mappings were read-only proxies, which copy.deepcopy and pickle refused (a
  # record could not be sent to another process).
  run, _ = trained
  for record in (*run.rounds(), *run.learners().values()):
    assert copy.deepcopy(record) == record
    assert pickle.loads(pickle.dumps(record)) == record
    with pytest.raises(TypeError, match="read-only"):
      record.extra["x"] = 1


def test_unknown_fields_are_kept_known_ones_are_checked(trained):
  run, _ = trained
  parsed = json.loads(_raw(run, 1))
  parsed["skipped"] = True
  record = RoundRecord.from_json(parsed)
  assert record.extra["skipped"] is True and record.to_json()["skipped"] is True
  for field, bad in [("version", "1"), ("participants", {}), ("outer_step", 1),
                     ("cosine", "x"), ("state_files", {"a": 3}), ("estimates", {"step": "x"})]:
    broken = dict(parsed, **{field: bad})
    with pytest.raises(mail.CorruptRecord, match=field):
      RoundRecord.from_json(broken, where=field)
  for field in ("round", "theta_sha256", "sha256", "quorum_seconds"):
    broken = {k: v for k, v in parsed.items() if k != field}
    with pytest.raises(mail.CorruptRecord, match=field):
      RoundRecord.from_json(broken)
  broken = dict(parsed, participants=[{"learner": "w0", "steps": 2}])
  with pytest.raises(mail.CorruptRecord, match="local_step"):
    RoundRecord.from_json(broken)


def test_integers_past_a_floats_range_are_a_corrupt_record_not_an_overflow(trained):
  # JSON integers are unbounded: a reader that takes one as a float must not raise
  # OverflowError, which no reader of a commit catches.
  run, _ = trained
  parsed = json.loads(_raw(run, 1))
  huge = 10**400
  record = RoundRecord.from_json(dict(parsed, estimates={"step": huge}))
  assert record.estimates.step == MAX_ESTIMATE_SECONDS  # a number, at the clamp's top
  assert RoundRecord.from_json(dict(parsed, estimates={"step": -huge})).estimates.step == 0
  for broken in (dict(parsed, quorum_seconds=huge), dict(parsed, cosine=-huge),
                 dict(parsed, participants=[dict(parsed["participants"][0], weight=huge)])):
    with pytest.raises(mail.CorruptRecord, match="past a float's range"):
      RoundRecord.from_json(broken)


def test_commit_of_a_version_or_fragment_that_is_not_there_says_which(tmp_path):
  url = f"memory://records-missing-{tmp_path.name}"
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=2)
  learner = run.join("w0", poll_interval=0.01)
  params = learner.pull(ms.params0())
  for _ in range(6):  # versions 1, 2, 3 commit; keep_versions=2 prunes 0 and 1
    params = learner.step(ms.inner(params, ms.target(0)))
  learner.close(params)
  assert run.commit(0, 3).version == 3
  with pytest.raises(FileNotFoundError,
                     match=r"version 7 of fragment 0 is not committed.*2 to 3.*newest"):
    run.commit(0, 7)
  with pytest.raises(FileNotFoundError,
                     match=r"version 0 of fragment 0 is not committed.*keep_versions=2"):
    run.commit(0, 0)
  with pytest.raises(ValueError, match=r"fragment=1 .*has 1 fragment"):
    run.commit(1, 0)
  with pytest.raises(ValueError, match=r"version=-1 .*non-negative"):
    run.commit(0, -1)
  with pytest.raises(TypeError, match=r"fragment must be an int, got str '0'"):
    run.commit("0", 3)
  assert run.commit(np.int64(0), np.int64(3)).version == 3  # numpy integers are ints


def test_commit_step_checks_its_fragment_and_version_as_commit_does(tmp_path):
  # On a two-fragment run commit_step(2, 1) answered 6, the step of fragment 0's version
  # 2, and commit_step(0, -1) a step of -6, with no word.
  run = mail.create(f"memory://records-step-{tmp_path.name}", ms.params0(),
                    gmjax.DiLoCo(sync_every=4, fragments=2), keep_versions=2)
  assert [run.commit_step(f, v) for f in (0, 1) for v in (0, 1, 2)] == [0, 2, 6, 0, 4, 8]
  assert run.commit_step(np.int64(1), np.int64(2)) == 8
  with pytest.raises(ValueError, match=r"fragment=2 .*has 2 fragment"):
    run.commit_step(2, 1)
  with pytest.raises(ValueError, match=r"version=-1 .*non-negative"):
    run.commit_step(0, -1)
  with pytest.raises(TypeError, match=r"version must be an int, got float 1.0"):
    run.commit_step(0, 1.0)
