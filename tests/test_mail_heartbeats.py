"""Heartbeats: a malformed, unsigned or forged one is ignored and reported, never fatal."""

import json

import pytest

import gmjax
from gmjax import mail
from gmjax.mail import heartbeats
from gmjax.mail import signing

import mail_support as ms

MALFORMED = {
    "abc": b'{"name":"abc","status":"live","seq":1,"first_round":"abc"}',
    "nulls": b'{"name":"nulls","status":null,"seq":null,"first_round":null,"final_rounds":null}',
    "five": b'{"name":"five","status":"closing","seq":1,"final_rounds":5}',
    "listed": b"[1, 2, 3]",
    "inf": b'{"name":"inf","status":"live","seq":1,"first_round":1e400}',
    "digits": b'{"name":"digits","status":"live","seq":1,"first_round":' + b"9" * 5000 + b"}",
    "bytes": b'{"name":"bytes","status":"live","seq":1}\xff',
    "truth": b'{"name":"truth","status":"live","seq":true,"first_round":true}',
    "other": b'{"name":"a0","status":"live","seq":1,"first_round":0}',
    "nested": b'{"name":"nested","status":"live","seq":1,"versions":' + b"[" * 5000 + b"]" * 5000
              + b"}",
    "lossy": b'{"name":"lossy","status":"live","seq":1,"first_round":0,"loss":"low"}',
    "huge": b'{"name":"huge","status":"live","seq":1,"pad":"' + b"x" * (2 << 20) + b'"}',
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_parse_rejects_malformed_heartbeats(name):
  with pytest.raises(heartbeats.BadHeartbeat) as caught:
    heartbeats.parse(name, MALFORMED[name][: heartbeats.MAX_HEARTBEAT_BYTES], key=None)
  assert isinstance(caught.value, ValueError)
  assert len(caught.value.reason) < 200 and caught.value.reason.isascii()


def test_parse_accepts_what_a_learner_writes():
  record = {"name": "w0", "status": "live", "seq": 3, "first_round": 2, "final_rounds": [],
            "step": 7, "versions": {"0": 1}, "loss": None, "last_seen": "2024-01-01T00:00:00"}
  assert heartbeats.parse("w0", heartbeats.dumps(record, None), key=None) == record
  signed = heartbeats.dumps(record, b"k")
  assert heartbeats.parse("w0", signed, key=b"k")["seq"] == 3
  with pytest.raises(heartbeats.BadHeartbeat, match="signature"):
    heartbeats.parse("w0", signed, key=b"other")
  with pytest.raises(heartbeats.BadHeartbeat, match="signature"):
    heartbeats.parse("w0", heartbeats.dumps(record, None), key=b"k")


@pytest.mark.timeout(120)
def test_malformed_heartbeats_do_not_stop_a_run(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2))
  for name, data in MALFORMED.items():
    run.store.put(f"learners/{name}.json", data)
  run.store.put("learners/not a name.json", b"{}")
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, mail.open(url), f"a{m}", m, 6)
  threads.join(timeout=100)
  assert [r.round for r in run.rounds()] == [0, 1, 2]
  bad = {b["learner"]: b["reason"] for b in run.status()["bad_heartbeats"]}
  assert set(MALFORMED) | {"'not a name'"} <= set(bad), bad
  assert set(run.learners()) == {"a0", "a1"}


@pytest.mark.timeout(120)
def test_keyed_run_signs_heartbeats_and_ignores_unsigned_and_forged(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2), key="k")
  honest = {"status": "live", "seq": 1, "first_round": 0}
  run.store.put("learners/ghost.json", json.dumps({"name": "ghost", **honest}).encode())
  forged = {"name": "forger", **honest}
  forged[signing.SIGNATURE] = signing.sign_record(b"wrong", forged)
  run.store.put("learners/forger.json", json.dumps(forged).encode())
  for name in ("ghost", "forger"):  # a payload signed with the right key, a name not known
    run.store.put(f"rounds/0/{name}.safetensors", gmjax.mail.contributions.dumps(
        {n: ms.params0()[n] * 0 for n in run.plan[0]}, learner=name, round_=0, fragment=0,
        base_version=0, local_step=2, steps=2, tokens=2, step_seconds=0.01, final=False,
        precision=None, key=run.signing_key))
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, mail.open(url, key="k"), f"a{m}", m, 4)
  threads.join(timeout=100)
  rounds = run.rounds()
  reasons = {x.learner: x.reason for x in rounds[0].rejected}
  assert "unknown learner" in reasons["ghost"] and "unknown learner" in reasons["forger"]
  bad = {b["learner"]: b["reason"] for b in run.status()["bad_heartbeats"]}
  assert "signature" in bad["ghost"] and "signature" in bad["forger"]
  for name in ("a0", "a1"):
    record = json.loads(run.store.get(f"learners/{name}.json"))
    assert signing.record_signature_ok(run.signing_key, record)
