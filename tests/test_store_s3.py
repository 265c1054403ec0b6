"""The store and a small mail run against a real S3 API on loopback (the moto server).

moto's server (``moto[server]``) serves the S3 REST API on 127.0.0.1; s3fs talks to it
through ``endpoint_url``. Nothing is mocked: requests go over HTTP to the server, which
keeps the objects and enforces ``If-None-Match: *`` on ``PutObject``.
"""

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import store as store_lib

import mail_support as ms

s3fs = pytest.importorskip("s3fs")

BUCKET = "gmjax-test"  # made by conftest's s3_options


@pytest.fixture
def options(s3_options):
  return s3_options


def _url():
  return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


def _race(creators, key):
  """Each callable tries to create ``key`` at once; returns the indices that succeeded."""
  barrier = threading.Barrier(len(creators))
  wins, errors = [], []

  def racer(i):
    barrier.wait()
    try:
      if creators[i](key, f"writer {i}".encode()):
        wins.append(i)
    except FileExistsError:
      pass
    except Exception as error:  # pylint: disable=broad-except
      errors.append(error)

  threads = [threading.Thread(target=racer, args=(i,)) for i in range(len(creators))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert not errors, errors
  return wins


@pytest.mark.timeout(120)
def test_server_enforces_if_none_match(options):
  """The emulator refuses a conditional put of an existing key, also under a race of 8
  separate clients: exactly one PutObject with If-None-Match: * succeeds."""
  clients = [s3fs.S3FileSystem(skip_instance_cache=True, **options) for _ in range(8)]
  prefix = f"{BUCKET}/{uuid.uuid4().hex[:8]}"

  def conditional(client):
    def put(key, data):
      client.call_s3("put_object", Bucket=BUCKET, Key=f"{prefix[len(BUCKET) + 1:]}/{key}",
                     Body=data, IfNoneMatch="*")
      return True
    return put

  for round_ in range(3):
    wins = _race([conditional(c) for c in clients], f"{round_}.commit.json")
    assert len(wins) == 1, wins
    assert clients[0].cat_file(f"{prefix}/{round_}.commit.json") == f"writer {wins[0]}".encode()


@pytest.mark.timeout(120)
def test_store_operations(options):
  store = store_lib.open_store(_url(), storage_options=options)
  assert type(store).__name__ == "S3Store"
  store.put("a/b/one.json", b"1")
  store.put("a/b/one.json", b"11")
  store.put("a/two.bin", b"2")
  assert store.get("a/b/one.json") == b"11"
  assert store.list("a") == ["b", "two.bin"]
  assert store.list("missing") == []
  with pytest.raises(FileNotFoundError):
    store.get("a/nothing")
  assert store.create("c/0.commit.json", b"mine")
  assert not store.create("c/0.commit.json", b"theirs")
  assert store.create("c/0.commit.json", b"mine")  # a retried create that had landed
  assert store.get("c/0.commit.json") == b"mine"
  store.delete("a/b")
  assert store.list("a") == ["two.bin"]


def test_list_dated_dates_objects_by_the_storage_clock(options):
  ms.check_dated_listing(store_lib.open_store(_url(), storage_options=options))


def test_a_replaced_object_shows_a_new_marker(options):
  # A closer reads a rejected contribution again once its ETag changes.
  store = store_lib.open_store(_url(), storage_options=options)
  store.put("rounds/0/a0.safetensors", b"junk")
  first = store.list_marked("rounds/0")
  store.put("rounds/0/a0.safetensors", b"real")  # the same size
  second = store.list_marked("rounds/0")
  assert list(first) == list(second) == ["a0.safetensors"]
  assert first["a0.safetensors"] != second["a0.safetensors"]
  assert store.list_marked("rounds/0") == second


@pytest.mark.timeout(120)
def test_exclusive_create_race(options):
  url = _url()
  stores = [store_lib.open_store(url, storage_options=options) for _ in range(8)]
  for round_ in range(3):
    wins = _race([s.create for s in stores], f"fragments/0/{round_}.commit.json")
    assert len(wins) == 1, wins
    assert stores[0].get(f"fragments/0/{round_}.commit.json") == f"writer {wins[0]}".encode()


@pytest.mark.timeout(180)
def test_mail_run_over_s3(options):
  url = _url()
  config = gmjax.DiLoCo(sync_every=3, fragments=2, quorum_size=2, commit_precision="F8_E4M3")
  run = mail.create(url, ms.params0(), config, key="s3-secret", storage_options=options)
  out = {}
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, mail.open(url, key="s3-secret", storage_options=options),
                  f"s{m}", m, 6, out=out, poll=0.05)
  threads.join(timeout=150)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1, 2, 3, 4]
  assert all(len(r.participants) == 2 and not r.rejected for r in rounds)
  for name in out["s0"]:
    np.testing.assert_array_equal(out["s0"][name], out["s1"][name])
  late = mail.open(url, key="s3-secret", storage_options=options).join("late",
                                                                       poll_interval=0.05)
  params = late.pull(ms.params0())
  late.close(params)
  for name in params:
    np.testing.assert_array_equal(params[name], out["s0"][name])
  assert mail.verify(url, key="s3-secret", storage_options=options) == []


@pytest.mark.timeout(120)
def test_junk_at_a_learners_next_contribution_path_never_stands_for_it(options):
  url = _url()
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2),
                    storage_options=options)
  for round_ in range(2):  # a1 is slow: a0 closes, and finds the junk before a1's delta
    run.store.put(f"rounds/{round_}/a1.safetensors", b"junk")

  def body(name, index):
    learner = mail.open(url, storage_options=options).join(name, poll_interval=0.05,
                                                           wait_timeout=30)
    params = learner.pull(ms.params0())
    for _ in range(4):
      if name == "a1":
        time.sleep(0.3)
      params = learner.step(ms.inner(params, ms.target(index)))
    learner.close(params)

  threads = ms.Threads()
  for index in range(2):
    threads.start(body, f"a{index}", index)
  threads.join(timeout=90)
  rounds = run.rounds()
  assert [r.round for r in rounds] == [0, 1]
  assert all(sorted(p.learner for p in r.participants) == ["a0", "a1"]
             and not r.rejected for r in rounds), rounds


@pytest.mark.timeout(120)
def test_a_run_needs_rights_on_its_own_prefix_only(options, monkeypatch):
  # The probe of conditional writes went to <bucket>/.gmjax-probe/, outside the run:
  # credentials limited to the run's prefix could not create a commit.
  boto3 = pytest.importorskip("boto3")
  moto_settings = pytest.importorskip("moto.settings")
  from gmjax.mail.store import s3 as s3_store  # pylint: disable=g-import-not-at-top

  iam = boto3.client("iam", endpoint_url=options["endpoint_url"], region_name="us-east-1",
                     aws_access_key_id="x", aws_secret_access_key="x")
  user, prefix = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]
  iam.create_user(UserName=user)
  iam.put_user_policy(UserName=user, PolicyName="runs-only", PolicyDocument=json.dumps({
      "Version": "2012-10-17", "Statement": [
          {"Effect": "Allow", "Action": ["s3:*"],
           "Resource": [f"arn:aws:s3:::{BUCKET}/{prefix}/*"]},
          {"Effect": "Allow", "Action": ["s3:ListBucket"],
           "Resource": [f"arn:aws:s3:::{BUCKET}"]}]}))
  key = iam.create_access_key(UserName=user)["AccessKey"]
  limited = dict(options, key=key["AccessKeyId"], secret=key["SecretAccessKey"])
  monkeypatch.setattr(s3_store, "_PROBED", set())  # probe again, with these rights
  monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # enforce them
  store = store_lib.open_store(f"s3://{BUCKET}/{prefix}/run", storage_options=limited,
                               retry_seconds=5)
  assert store.create("fragments/0/0.commit.json", b"c")
  assert not store.create("fragments/0/0.commit.json", b"d")
  with pytest.raises(PermissionError):  # the policy holds outside the prefix
    store_lib.open_store(f"s3://{BUCKET}/elsewhere", storage_options=limited,
                         retry_seconds=5).put("x", b"x")


@pytest.mark.timeout(120)
def test_an_empty_object_reads_as_empty(options):
  # A ranged read of an empty object is answered 416; readers raised OSError on it (one
  # planted empty heartbeat stopped every learner).
  store = store_lib.open_store(_url(), storage_options=options)
  store.put("learners/ghost.json", b"")
  assert store.read("learners/ghost.json", 100) == b"" and store.get("learners/ghost.json") == b""


@pytest.mark.timeout(120)
def test_deleting_from_a_run_whose_name_is_a_pattern_touches_no_other_run(options):
  base = _url()
  other = store_lib.open_store(base + "-a", storage_options=options)
  mine = store_lib.open_store(base + "-?", storage_options=options)
  for store in (other, mine):
    store.put("rounds/0/x.safetensors", b"1")
  mine.put("rounds/1/*", b"planted")
  mine.put("rounds/1/y.safetensors", b"2")
  mine.delete("rounds/0")
  mine.delete("rounds/1/*")
  assert other.list("rounds/0") == ["x.safetensors"] and mine.list("rounds/0") == []
  assert mine.list("rounds/1") == ["y.safetensors"]


@pytest.mark.timeout(120)
def test_a_prefix_named_like_an_object_does_not_hide_its_replacement(options):
  # s3fs lists the prefix after the object; keyed by name, its details replaced the
  # object's, and a contribution written over planted junk kept the junk's marker.
  store = store_lib.open_store(_url(), storage_options=options)
  store.put("rounds/0/a1.safetensors", b"junk")
  store.put("rounds/0/a1.safetensors/x", b"planted")
  before = store.list_marked("rounds/0")["a1.safetensors"]
  store.put("rounds/0/a1.safetensors", b"the learner's own")
  assert store.list_marked("rounds/0")["a1.safetensors"] != before


@pytest.mark.timeout(120)
def test_a_url_with_a_version_is_refused_and_deletes_nothing(options):
  # s3fs read "?versionId=1" as an object's version: every file of the run went to one
  # key, and the probe's delete removed the user's object at the run's prefix.
  fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
  data = f"{BUCKET}/{uuid.uuid4().hex[:8]}/data.csv"
  fs.pipe_file(data, b"kept")
  with pytest.raises(ValueError, match=r"names an object's version \('\?versionId=1'\)"
                     r".*drop it"):
    mail.create(f"s3://{data}?versionId=1", ms.params0(), gmjax.DiLoCo(sync_every=2),
                storage_options=options)
  assert fs.cat_file(data) == b"kept"
  for url in ("s3://", "s3:///run"):
    with pytest.raises(ValueError, match=r"names no bucket; give s3://BUCKET/RUN"):
      mail.open(url, storage_options=options)


@pytest.mark.timeout(120)
def test_a_missing_bucket_is_named(options):
  # create raised s3fs's "The specified bucket does not exist" without the URL; open
  # said to create the run, which then failed so.
  url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
  with pytest.raises(FileNotFoundError, match=r"create s3://no-such-bucket-.*/run/manifest"
                     r"\.json: the bucket 'no-such-bucket-.*' does not exist .* create it"):
    mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), storage_options=options)
  with pytest.raises(mail.RunNotFound, match=r"the bucket .* does not exist"):
    mail.open(url, storage_options=options)
  with pytest.raises(mail.RunNotFound, match=r"\(no manifest\.json\); create one"):
    mail.open(_url(), storage_options=options)  # the bucket is there, the run is not
  with pytest.raises(ValueError, match=r"endpoint_url='127\.0\.0\.1:1' has no scheme.*"
                     r"'http://127\.0\.0\.1:1'"):
    mail.open(_url(), storage_options={**options, "endpoint_url": "127.0.0.1:1"})


@pytest.mark.timeout(120)
def test_credentials_the_storage_refuses_are_named(tmp_path):
  # A moto server that checks credentials: create and open raised a bare
  # PermissionError("Forbidden"), naming neither the URL nor the fix.
  script = ("import os, sys, time, moto.server\n"
            "s = moto.server.ThreadedMotoServer(ip_address='127.0.0.1', port=0,"
            " verbose=False)\n"
            "s.start(); print(s.get_host_and_port()[1], flush=True)\n"
            "sys.stdin.read()\n")
  env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
  server = subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  try:
    port = int(server.stdout.readline())
    bad = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bad", "secret": "bad"}
    fix = r"the storage refused access .*; check the credentials \(storage_options' key"
    with pytest.raises(PermissionError, match=rf"create s3://{BUCKET}/run/manifest\.json: {fix}"):
      mail.create(f"s3://{BUCKET}/run", ms.params0(), gmjax.DiLoCo(sync_every=2),
                  storage_options=bad)
    with pytest.raises(PermissionError, match=rf"s3://{BUCKET}/run/manifest\.json: {fix}"):
      mail.open(f"s3://{BUCKET}/run", storage_options=bad)
  finally:
    server.stdin.close()
    server.wait(30)
