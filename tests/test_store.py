"""The store over a local directory and memory://: atomic puts, exclusive create, retries."""

import hashlib
import os
import sys
import threading

import pytest

from gmjax import mail
from gmjax.mail import store as store_lib

import mail_support as ms


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
  if request.param == "local":
    return store_lib.open_store(str(tmp_path / "run"))
  return store_lib.open_store(f"memory://store-test-{os.getpid()}-{id(request)}")


def test_put_get_list_delete(store):
  store.put("a/b/one.json", b"1")
  store.put("a/b/one.json", b"11")
  store.put("a/two.bin", b"2")
  assert store.get("a/b/one.json") == b"11"
  assert store.list("a") == ["b", "two.bin"]
  assert store.list("a/b") == ["one.json"]
  assert store.list("nothing/here") == []
  assert store.exists("a/two.bin") and not store.exists("a/three.bin")
  with pytest.raises(FileNotFoundError):
    store.get("a/missing")
  store.delete("a/b")
  assert store.list("a") == ["two.bin"]
  store.delete("a/missing")  # absent: no error


def test_list_dated_dates_objects_by_the_storage_clock(store):
  ms.check_dated_listing(store)


def test_create_is_exclusive(store):
  assert store.create("x/commit.json", b"first")
  assert not store.create("x/commit.json", b"second")
  assert store.get("x/commit.json") == b"first"
  # A retried create whose first attempt landed finds its own bytes: created.
  assert store.create("x/commit.json", b"first")


def test_create_race_has_one_winner(store):
  barrier = threading.Barrier(8)
  wins = []

  def racer(i):
    barrier.wait()
    if store.create("race/0.commit.json", f"writer {i}".encode()):
      wins.append(i)

  threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert len(wins) == 1
  assert store.get("race/0.commit.json") == f"writer {wins[0]}".encode()


def test_listing_while_another_thread_deletes(store):
  # fsspec's memory filesystem lists its keys, then looks each one up: unserialized, a
  # delete between the two raised KeyError in the listing thread (a learner's worker).
  done = threading.Event()
  errors = []

  def churn():
    try:
      while not done.is_set():
        for i in range(20):
          store.put(f"learners/w{i}.json", b"{}")
        for i in range(20):
          store.delete(f"learners/w{i}.json")
    except Exception as error:  # pylint: disable=broad-except  # reported below
      errors.append(error)

  thread = threading.Thread(target=churn, daemon=True)
  switch = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)  # switch threads often, so the two calls interleave
  try:
    thread.start()
    for _ in range(300):
      store.list("learners")
      store.list_marked("learners")
  finally:
    done.set()
    thread.join(30)
    sys.setswitchinterval(switch)
  assert not errors, errors


def test_local_names_appear_complete(tmp_path):
  store = store_lib.open_store(str(tmp_path))
  store.put("d/f.bin", b"x" * 1000)
  assert store.create("d/g.bin", b"y" * 1000)
  assert sorted(os.listdir(tmp_path / "d")) == ["f.bin", "g.bin"]  # no temporary left
  assert store.local_root == str(tmp_path)


class _Flaky(store_lib.LocalStore):
  """Fails the first ``failures`` calls of each operation with a transient error."""

  def __init__(self, url, failures, error):
    super().__init__(url, retry_seconds=5.0)
    self.failures, self.error, self.calls = failures, error, 0

  def _get(self, path):
    self.calls += 1
    if self.calls <= self.failures:
      raise self.error
    return super()._get(path)


def test_transient_errors_are_retried(tmp_path):
  flaky = _Flaky(str(tmp_path), 3, ConnectionResetError("reset by peer"))
  flaky.put("f", b"data")
  assert flaky.get("f") == b"data"
  assert flaky.calls == 4


def test_permanent_errors_propagate(tmp_path):
  flaky = _Flaky(str(tmp_path), 1, PermissionError("denied"))
  flaky.put("f", b"data")
  with pytest.raises(PermissionError):
    flaky.get("f")
  assert flaky.calls == 1


def test_retries_are_bounded(tmp_path):
  flaky = _Flaky(str(tmp_path), 10**9, TimeoutError("slow"))
  flaky.retry_seconds = 0.3
  with pytest.raises(TimeoutError):
    flaky.get("f")


def test_transient_classification():
  assert store_lib.is_transient(ConnectionError())
  assert store_lib.is_transient(TimeoutError())
  assert not store_lib.is_transient(FileNotFoundError())
  assert not store_lib.is_transient(FileExistsError())
  assert not store_lib.is_transient(ValueError())

  class HttpError(Exception):
    code = 503

  assert store_lib.is_transient(HttpError())
  # What the libraries raise, as they raise it: botocore's connection errors, a 502
  # from a proxy under gcsfs (requests' ProxyError), and S3's 409 to two conditional
  # writes of one key at once (s3fs maps it to EIO). None was retried.
  botocore = pytest.importorskip("botocore.exceptions")
  requests = pytest.importorskip("requests")
  assert store_lib.is_transient(botocore.EndpointConnectionError(endpoint_url="http://x"))
  assert store_lib.is_transient(botocore.ReadTimeoutError(endpoint_url="http://x"))
  assert store_lib.is_transient(requests.exceptions.ProxyError())
  assert store_lib.is_transient(OSError(
      5, "An error occurred (ConditionalRequestConflict) when calling the PutObject"
         " operation: A conflicting conditional operation is currently in progress"))
  assert not store_lib.is_transient(OSError(5, "An error occurred (AccessDenied)"))


def test_open_store_rejects_non_strings():
  with pytest.raises(TypeError, match="url"):
    store_lib.open_store(42)


def test_retry_budget_bounds_retries_with_a_typed_error(tmp_path):
  flaky = _Flaky(str(tmp_path), 10**9, ConnectionResetError("reset by peer"))
  budgets = []

  def budget():
    budgets.append(0.2)
    return 0.2

  bounded = flaky.with_retry_budget(budget)
  assert bounded.retry_budget() == 0.2 and flaky.retry_budget() == 5.0  # a view, not a change
  with pytest.raises(mail.StorageUnavailable, match=r"get .*still failed after \d+ attempt") as e:
    bounded.get("f")
  assert isinstance(e.value, TimeoutError)
  assert isinstance(e.value.__cause__, ConnectionResetError)
  assert bounded.calls > 1 and len(budgets) >= 2  # retried, under the budget read per call


def test_get_verified_hashes_what_it_reads(store):
  data = os.urandom(3 * (4 << 20) + 5)  # several read chunks
  store.put("blob.bin", data)
  assert store.get_verified("blob.bin", hashlib.sha256(data).hexdigest()) == data
  with pytest.raises(mail.CorruptRecord):
    store.get_verified("blob.bin", hashlib.sha256(b"other").hexdigest())
  with pytest.raises(FileNotFoundError):
    store.get_verified("missing.bin", "0" * 64)


def test_bounded_read(store):
  store.put("r/small.bin", b"x" * 100)
  assert store.read("r/small.bin", 100) == b"x" * 100
  assert store.size("r/small.bin") == 100
  with pytest.raises(store_lib.BadObject, match="more than 99 bytes"):
    store.read("r/small.bin", 99)
  with pytest.raises(FileNotFoundError):
    store.read("r/missing.bin", 10)
  with pytest.raises(FileNotFoundError):
    store.size("r/missing.bin")
  # A bound far above the object (a checkpoint's, for a large model) is no allocation:
  # the local store read the bound itself, a MemoryError past the machine's memory.
  assert store.read("r/small.bin", 1 << 50) == b"x" * 100
  digest = hashlib.sha256(b"x" * 100).hexdigest()
  assert store.get_verified("r/small.bin", digest, 1 << 50) == b"x" * 100


def test_bounded_read_refuses_what_is_not_a_regular_file(tmp_path):
  local = store_lib.open_store(str(tmp_path / "run"))
  local.put("r/keep.bin", b"1")
  folder = tmp_path / "run" / "r"
  os.mkfifo(folder / "fifo.bin")                     # reading would block
  os.symlink("/dev/zero", folder / "zero.bin")       # reading would never end
  os.symlink(folder / "keep.bin", folder / "link.bin")
  os.mkdir(folder / "dir.bin")
  with open(folder / "sparse.bin", "wb") as f:       # 3 GiB that occupy nothing on disk
    f.truncate(3 << 30)
  for name in ("fifo.bin", "zero.bin", "link.bin", "dir.bin"):
    with pytest.raises(store_lib.BadObject, match="not a regular file"):
      local.read(f"r/{name}", 1 << 20)
  with pytest.raises(store_lib.BadObject, match="holds 3221225472 bytes"):
    local.read("r/sparse.bin", 1 << 20)
  assert issubclass(store_lib.BadObject, ValueError)


def test_a_path_under_a_file_holds_nothing(tmp_path):
  # A run URL that names a file (a config passed as the run, a typo): nothing is stored
  # under it, as under a missing folder, and opening it says there is no run.
  afile = tmp_path / "config.toml"
  afile.write_text("[train]\n")
  store = store_lib.open_store(str(afile))
  for read in (lambda: store.get("manifest.json"), lambda: store.read("manifest.json", 64),
               lambda: store.size("manifest.json"),
               lambda: store.get_verified("manifest.json", hashlib.sha256().hexdigest())):
    with pytest.raises(FileNotFoundError):
      read()
  assert not store.exists("manifest.json") and store.list("") == []
  with pytest.raises(mail.RunNotFound, match="no run at"):
    mail.open(str(afile))


def test_links_among_the_folders_lead_nowhere_outside_the_run(tmp_path):
  # The store makes no links. A folder of the run replaced by a link to one outside it
  # took listings, reads, writes and retention's deletes there: a user's files were
  # deleted by pruning.
  outside = tmp_path / "outside"
  (outside / "1").mkdir(parents=True)
  (outside / "1" / "photo.jpg").write_bytes(b"precious")
  (outside / "2.bin").write_bytes(b"precious")
  local = store_lib.open_store(str(tmp_path / "run"))
  local.put("keep/a.bin", b"1")
  os.symlink(outside, tmp_path / "run" / "rounds")
  os.symlink(outside, tmp_path / "run" / "keep" / "claims")
  for prefix in ("rounds", "rounds/1", "keep/claims"):
    assert local.list(prefix) == [] and local.list_dated(prefix) == {}
  for path in ("rounds/2.bin", "rounds/1/photo.jpg"):
    for read in (lambda: local.get(path), lambda: local.read(path, 64),
                 lambda: local.size(path),
                 lambda: local.get_verified(path, hashlib.sha256(b"precious").hexdigest())):
      with pytest.raises(store_lib.BadObject, match="symbolic link"):
        read()
  local.delete("rounds/1")
  local.delete("rounds/2.bin")
  local.delete("keep/claims")  # the link itself goes, not what it points to
  assert not os.path.lexists(tmp_path / "run" / "keep" / "claims")
  assert (outside / "1" / "photo.jpg").read_bytes() == b"precious"
  assert sorted(os.listdir(outside)) == ["1", "2.bin"]
  local.put("rounds/3/x.bin", b"3")  # a write replaces the link by the run's folder
  assert not os.path.islink(tmp_path / "run" / "rounds")
  assert local.get("rounds/3/x.bin") == b"3" and local.list("rounds") == ["3"]
  assert sorted(os.listdir(outside)) == ["1", "2.bin"]


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
  # A full disk (ENOSPC) left the half-written temporary file behind for good.
  import errno as errno_lib  # pylint: disable=g-import-not-at-top

  local = store_lib.open_store(str(tmp_path / "run"))
  local.put("r/a.bin", b"1")

  def full(fd):
    raise OSError(errno_lib.ENOSPC, "No space left on device")

  monkeypatch.setattr(os, "fsync", full)
  for write in (lambda: local.put("r/b.bin", b"2"), lambda: local.create("r/c.bin", b"3")):
    with pytest.raises(OSError, match="No space left"):
      write()
  monkeypatch.undo()
  assert local.temporaries("r") == [] and local.list("r") == ["a.bin"]
