"""``gmjax.mail.verify`` and ``gmjax status RUN [--verify] [--key]``: damaged runs show."""

import json
import shutil
import time

import pytest

import gmjax
from gmjax import mail
from gmjax.app import cli
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import manifest as manifest_lib
from gmjax.mail import states

import mail_support as ms

KEY = "verify-secret"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A keyed run with versions 0..2 of each of 2 fragments, made once."""
  url = str(tmp_path_factory.mktemp("verify") / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, fragments=2, quorum_size=2,
                                               flush_on_close=False), key=KEY)
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, mail.open(url, key=KEY), f"w{m}", m, 4)
  threads.join(timeout=100)
  return url


@pytest.fixture
def url(trained, tmp_path):
  copy = str(tmp_path / "run")
  shutil.copytree(trained, copy)
  return copy


def _status(url, *flags):
  return cli.main(["status", url, "--key", KEY, *flags])


def test_healthy_run_verifies(url, capsys):
  assert mail.verify(url, key=KEY) == []
  assert _status(url, "--verify") == 0
  assert _status(url) == 0
  assert "DAMAGED" not in capsys.readouterr().out


def test_zeroed_checkpoint_file_of_an_old_version(url, capsys):
  run = mail.open(url, key=KEY)
  record = run.commit(1, 1)
  state_file = sorted(record.state_files)[0]
  path = f"{record.state}/{state_file}"
  run.store.put(path, b"\0" * len(run.store.get(path)))
  problems = mail.verify(url, key=KEY)
  assert len(problems) == 1 and path in problems[0] and "sha256" in problems[0]
  assert _status(url, "--verify") == 1
  captured = capsys.readouterr()
  assert "DAMAGED: 1 problem(s)" in captured.out and "damaged" in captured.err
  assert mail.verify(url, key=KEY, deep=False) == []  # an old version: --verify finds it
  with pytest.raises(TypeError, match=r"deep='no' must be a bool"):  # it ran the deep check
    mail.verify(url, key=KEY, deep="no")


def test_zeroed_newest_checkpoint_shows_in_plain_status(url, capsys):
  run = mail.open(url, key=KEY)
  record = run.commit(0, 2)
  for state_file in record.state_files:
    path = f"{record.state}/{state_file}"
    run.store.put(path, b"\0" * len(run.store.get(path)))
  assert _status(url) == 1
  assert "DAMAGED" in capsys.readouterr().out


def test_record_without_a_field_is_reported_not_a_traceback(tmp_path, capsys):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=1))
  threads = ms.Threads()
  threads.start(ms.train, mail.open(url), "w0", 0, 2)
  threads.join(timeout=100)
  path = f"{url}/{layout.commit(0, 1)}"
  with open(path, encoding="utf-8") as f:
    record = json.load(f)
  del record["participants"]
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record, f)
  assert cli.main(["status", url]) == 1
  out = capsys.readouterr().out
  assert "DAMAGED" in out and "'participants'" in out
  assert [p for p in mail.verify(url) if "1.commit.json" in p and "participants" in p]


@pytest.mark.parametrize("damage", ["fragments removed", "every commit of a fragment"])
def test_a_run_with_no_readable_version_of_a_fragment_lists_its_problems(url, capsys, damage):
  # status exited 2 with one line from run.status() ("create it again"), dropping what
  # verify had found; the docs say a damaged run exits 1 with its problems.
  if damage == "fragments removed":
    shutil.rmtree(f"{url}/fragments")
  else:
    for version in range(3):
      with open(f"{url}/{layout.commit(0, version)}", "w") as f:
        f.write("garbage")
  problems = mail.verify(url, key=KEY)
  assert problems
  assert _status(url) == 1
  out = capsys.readouterr().out
  assert f"DAMAGED: {len(problems)} problem(s)" in out and problems[0] in out
  assert "no summary" in out
  assert _status(url, "--json") == 1
  report = json.loads(capsys.readouterr().out)
  assert report["problems"] == problems and report["status"] is None and report["error"]


def test_a_heartbeat_readers_ignore_is_named_on_an_unkeyed_run(tmp_path, capsys):
  # Only a keyed run's heartbeats were parsed: with versions=[1, 2] the learner left the
  # status table, and status and --verify said nothing (exit 0).
  url = str(tmp_path / "run")
  ms.train(mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2)), "w0", 0, 2)
  path = tmp_path / "run" / "learners" / "w0.json"
  record = json.loads(path.read_text())
  path.write_text(json.dumps({**record, "versions": [1, 2]}))
  problems = mail.verify(url)
  assert problems == ["learners/w0.json: versions=[1, 2] is not fragment -> version"]
  assert cli.main(["status", url]) == 1
  assert "versions=[1, 2]" in capsys.readouterr().out
  path.write_text(json.dumps(record))
  assert mail.verify(url) == []


def test_gap_bad_heartbeat_and_wrong_key(url):
  run = mail.open(url, key=KEY)
  run.store.delete(layout.commit(0, 1))
  run.store.put("learners/x.json", b'{"seq": 1}')
  problems = mail.verify(url, key=KEY)
  assert any("versions [1] have no commit record" in p for p in problems)
  assert any(p.startswith("learners/x.json") for p in problems)
  assert mail.verify(url, key="wrong")[0].startswith("manifest.json")
  assert _status(url, "--verify") == 1
  # Nothing was pruned: the header said "the last 3 kept" of the 4 rounds.
  assert "rounds committed: 4 (3 readable, " in mail.format_status(mail.open(url, key=KEY))


def test_a_planted_version_far_above_the_others_is_one_gap(url, capsys):
  # The gap to 10**12 was a set of a trillion numbers: verify and status ran out of
  # memory instead of reporting the planted record.
  run = mail.open(url, key=KEY)
  run.store.put(layout.commit(0, 10**12), b"{}")
  run.store.delete(layout.commit(1, 1))
  problems = mail.verify(url, key=KEY)
  assert any(f"versions [3-{10**12 - 1}] have no commit record" in p for p in problems), problems
  assert any("fragments/1: versions [1] have no" in p for p in problems), problems
  assert _status(url) == 1 and "DAMAGED" in capsys.readouterr().out


def test_huge_planted_heartbeat_and_manifest_are_refused_unread(url, capsys):
  # verify read a heartbeat whole (1 GiB planted: 1.3 GiB of memory), and open the
  # manifest; both are bounded now (a sparse file: nothing is written).
  run = mail.open(url, key=KEY)
  with open(f"{url}/learners/big.json", "wb") as f:
    f.truncate(heartbeats.MAX_HEARTBEAT_BYTES + 1)
  problems = mail.verify(url, key=KEY)
  assert any(p.startswith("learners/big.json") and "more than" in p for p in problems)
  with open(f"{url}/manifest.json", "wb") as f:
    f.truncate(manifest_lib.MAX_MANIFEST_BYTES + 1)
  with pytest.raises(mail.CorruptRecord, match="manifest.json .*more than"):
    mail.open(url, key=KEY)
  del run


def test_edited_record_fields_are_checked_against_the_schedule(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=1))
  threads = ms.Threads()
  threads.start(ms.train, mail.open(url), "w0", 0, 2)
  threads.join(timeout=100)
  path = f"{url}/{layout.commit(0, 1)}"
  with open(path, encoding="utf-8") as f:
    record = json.load(f)
  record["step"] = 7
  record["participants"][0]["weight"] = 0.5
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record, f)
  problems = mail.verify(url)
  assert any("step 7, expected 2" in p for p in problems)
  assert any("weights sum to 0.5" in p for p in problems)


def test_status_json_writes_a_nan_loss_and_an_infinite_pace_as_null(tmp_path, capsys):
  # json.dumps wrote them bare (NaN, Infinity), which jq and JSON.parse refuse.
  from gmjax.mail import heartbeats  # pylint: disable=g-import-not-at-top

  url = str(tmp_path / "run")
  ms.train(mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2)), "w0", 0, 2)
  mail.open(url).store.put("learners/h.json", heartbeats.dumps(
      {"name": "h", "status": "live", "seq": 1, "loss": float("nan"),
       "step_seconds": 5e-324}, None))
  assert cli.main(["status", url, "--json"]) == 0
  refuse = lambda constant: pytest.fail(f"bare {constant} in gmjax status --json")
  report = json.loads(capsys.readouterr().out, parse_constant=refuse)
  (h,) = [learner for learner in report["status"]["learners"] if learner["name"] == "h"]
  assert h["loss"] is None and h["steps_per_second"] is None


def test_a_version_pruned_while_verify_reads_it_is_not_damage(tmp_path, monkeypatch):
  # A prune deletes a version's files first and its records last. verify, having
  # listed the versions before a newer commit, found the files of a version being
  # pruned missing while its record still read, and reported a healthy run DAMAGED
  # (`gmjax status --verify` exited 1 on a run in training, 1 time in 12).
  run = mail.create(str(tmp_path / "run"), ms.params0(), gmjax.DiLoCo(sync_every=2),
                    keep_versions=2)
  learner = run.join("w", poll_interval=ms.POLL)
  params = learner.pull(ms.params0())
  for _ in range(4):
    params = learner.step(ms.inner(params, ms.target(0)))
  deadline = time.monotonic() + 30  # the closer prunes version 0 after its commit
  while (stale := states.committed_versions(run.store, 0)) != [1, 2]:
    assert time.monotonic() < deadline, stale
    time.sleep(ms.POLL)
  # The prune of version 1, cut after its files: its records stay.
  kind, delete = type(run.store), type(run.store).delete
  monkeypatch.setattr(kind, "delete", lambda self, path: None if layout.slot_version(
      path.rsplit("/", 1)[-1]) is not None else delete(self, path))
  for _ in range(2):
    params = learner.step(ms.inner(params, ms.target(0)))
  learner.close(params)
  monkeypatch.setattr(kind, "delete", delete)
  assert states.committed_versions(run.store, 0) == [1, 2, 3]
  listings = [stale]  # verify's listing, taken before version 3 committed
  listed = states.committed_versions
  monkeypatch.setattr(states, "committed_versions",
                      lambda *args: listings.pop() if listings else listed(*args))
  assert mail.verify(mail.open(run.url), deep=True) == []
  # Files missing from a version that no newer commit has pushed out are damage.
  monkeypatch.setattr(states, "committed_versions", listed)
  run.store.delete(layout.commit(0, 3))
  found = mail.verify(mail.open(run.url), deep=True)
  assert any("1.commit.json" in p and "missing" in p for p in found), found
