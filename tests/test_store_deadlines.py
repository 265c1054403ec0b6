"""Every storage call has a deadline: a server that accepts and never answers costs an
attempt, and the call raises ``StorageUnavailable`` instead of blocking.

The servers are real sockets on 127.0.0.1: a black hole that accepts connections and
never sends a byte, and a proxy in front of the moto S3 server that turns into one.
"""

import contextlib
import os
import socket
import threading
import time
import uuid

import pytest

import gmjax
from gmjax import mail
from gmjax.mail import store as store_lib

import mail_support as ms

s3fs = pytest.importorskip("s3fs")
gcsfs = pytest.importorskip("gcsfs")

BUCKET = "gmjax-deadlines"
# Far above what a bounded call takes (an attempt of MIN_ATTEMPT_SECONDS), far below the
# minutes a call without a deadline blocked for.
DOES_NOT_HANG = 30.0


class Proxy:
  """A TCP server on 127.0.0.1 that forwards to ``upstream`` until ``stall()``; from then
  on (and always, without an upstream) it accepts and reads, and never answers; so does
  it on its first ``swallow`` connections."""

  def __init__(self, upstream: tuple[str, int] | None = None, swallow: int = 0):
    self.upstream = upstream
    self.swallow = swallow  # the first connections that get no answer, stalled or not
    self.stalled = threading.Event()
    if upstream is None:
      self.stalled.set()
    self.listener = socket.create_server(("127.0.0.1", 0))
    self.port = self.listener.getsockname()[1]
    self.sockets = [self.listener]
    threading.Thread(target=self._accept, daemon=True).start()

  def stall(self):
    self.stalled.set()

  def _accept(self):
    with contextlib.suppress(OSError):
      while True:
        client, _ = self.listener.accept()
        self.sockets.append(client)
        if self.stalled.is_set() or self.swallow > 0:
          self.swallow -= 1
          threading.Thread(target=self._pump, args=(client, None), daemon=True).start()
          continue
        server = socket.create_connection(self.upstream)
        self.sockets.append(server)
        threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

  def _pump(self, source, sink):
    with contextlib.suppress(OSError):
      while data := source.recv(1 << 16):
        if sink is not None and not self.stalled.is_set():
          sink.sendall(data)

  def close(self):
    for sock in self.sockets:
      with contextlib.suppress(OSError):
        sock.close()


@pytest.fixture
def black_hole():
  proxy = Proxy()
  yield proxy
  proxy.close()


@pytest.fixture
def moto(s3_options):
  """The moto S3 server's (host, port); its credentials are in the environment."""
  host, port = s3_options["endpoint_url"].removeprefix("http://").split(":")
  return host, int(port)


def _s3_options(port):
  return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "x", "secret": "x"}


def _bounded(call):
  """Runs ``call``, which must raise StorageUnavailable; returns the seconds it took."""
  started = time.monotonic()
  with pytest.raises(mail.StorageUnavailable, match="retry budget"):
    call()
  elapsed = time.monotonic() - started
  assert elapsed < DOES_NOT_HANG, elapsed
  return elapsed


@pytest.mark.timeout(120)
def test_s3_calls_to_a_server_that_never_answers_raise(moto, black_hole):
  del moto  # only for its credentials in the environment
  store = store_lib.open_store(f"s3://{BUCKET}/x", retry_seconds=1.0,
                               storage_options=_s3_options(black_hole.port))
  assert store.has_deadlines
  _bounded(lambda: store.create("fragments/0/1.commit.json", b"{}"))
  # create waited 30 s, then spoke of a learner's timeout and the poll interval.
  with pytest.raises(mail.StorageUnavailable, match=r"budget of 1\.00s \(retry_seconds;"
                     r" check the storage's availability, its endpoint .* raise retry_seconds"):
    mail.create(f"s3://{BUCKET}/y", ms.params0(), gmjax.DiLoCo(sync_every=2),
                storage_options=_s3_options(black_hole.port), retry_seconds=1.0)


@pytest.mark.timeout(120)
def test_gcs_calls_to_a_server_that_never_answers_raise(black_hole, monkeypatch):
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{black_hole.port}")
  store = store_lib.open_store(f"gs://{BUCKET}/x", retry_seconds=1.0)
  assert store.has_deadlines
  _bounded(lambda: store.create("fragments/0/1.commit.json", b"{}"))
  _bounded(lambda: store.read("learners/a.json", 4096))


def test_an_attempts_deadline_follows_the_budget_and_the_bytes():
  store = store_lib.open_store("memory://deadline").with_retry_budget(lambda: 10.0)
  assert store.attempt_seconds() == 5.0
  assert store.attempt_seconds(3 * store_lib.MIN_BYTES_PER_SECOND) == 8.0
  assert store.attempt_seconds(budget=0.1) == store_lib.MIN_ATTEMPT_SECONDS
  assert not store.has_deadlines  # memory:// calls cannot hang on a server


@pytest.mark.timeout(120)
def test_a_run_whose_server_stops_answering_raises_instead_of_blocking(moto):
  proxy = Proxy(moto)
  try:
    options = _s3_options(proxy.port)
    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(BUCKET)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), storage_options=options)
    # Opened with room for a loaded machine's first connection (over the 2 s an attempt
    # of a 1 s budget gets), then bounded by 1 s, as mail.open(..., retry_seconds=1.0).
    run = mail.open(url, storage_options=options)
    assert run.rounds() == []  # answered: nothing closed yet
    run.store = run.store.with_retry_budget(lambda: 1.0)
    proxy.stall()
    _bounded(run.rounds)
    _bounded(lambda: run.store.put("rounds/0/a.safetensors", os.urandom(1000)))
  finally:
    proxy.close()


@pytest.mark.timeout(120)
def test_an_attempt_that_outlasts_the_budget_is_tried_again(moto):
  # As a process paused (SIGSTOP, a debugger) for longer than its budget mid-request
  # finds its attempt past its deadline on waking: it raised StorageUnavailable after
  # that one attempt ("1 attempt(s) over 6.01s, the retry budget of 1.90s") while the
  # storage was fine.
  proxy = Proxy(moto, swallow=1)
  try:
    store = store_lib.open_store(f"s3://gmjax-test/{uuid.uuid4().hex[:8]}",
                                 storage_options=_s3_options(proxy.port))
    store = store.with_retry_budget(lambda: 1.0)  # an attempt gets 2 s, over the budget
    store.put("learners/a.json", b"{}")
    assert store.get("learners/a.json") == b"{}"
  finally:
    proxy.close()
