"""Bounded storage: a run keeps its newest ``keep_versions`` and compacts dead learners.

Real stores only: a local directory, ``memory://`` and S3 on the moto server.
"""

import datetime
import json
import os
import re
import threading
import time
import uuid

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail import recovery
from gmjax.mail import retention
from gmjax.mail import states
from gmjax.mail import store as store_lib

import mail_support as ms

CONFIG = gmjax.DiLoCo(sync_every=2, fragments=2, quorum_size=2)
KEEP = 2


def _url(kind, tmp_path, options_=None):
  if kind == "local":
    return str(tmp_path / "run"), None
  if kind == "memory":
    return f"memory://retention-{uuid.uuid4().hex[:8]}", None
  return f"s3://gmjax-test/{uuid.uuid4().hex[:8]}", options_


def _usage(store):
  """``(objects, bytes)`` under the run, listed from the storage itself, with each
  fragment state's Orbax checkpoint directory counted as one object: how many files
  Orbax writes inside one (its OCDBT data files, a metadata file written after the
  rest) varies with timing, not with the rounds."""
  if store.local_root is not None:
    files = {os.path.relpath(os.path.join(root, name), store.local_root):
             os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(store.local_root) for name in names}
  else:
    store.fs.invalidate_cache()
    root = store.root.rstrip("/") + "/"
    files = {path.split(root, 1)[-1]: info["size"]
             for path, info in store.fs.find(store.root, detail=True).items()}
  objects = {re.match(r"(fragments/\d+/\d+-[0-9a-f]+/)?", path).group(1) or path
             for path in files}
  return len(objects), sum(files.values())


def _train_pair(run_url, steps, storage_options=None):
  # Both join and pull before either steps, so both start at the same committed step.
  out = {}
  threads = ms.Threads()
  together = threading.Barrier(2, timeout=60)
  for m in range(2):
    threads.start(ms.train, mail.open(run_url, storage_options=storage_options), f"a{m}",
                  m, steps, out=out, together=together)
  threads.join(timeout=120)
  return out


def _train_pair_until(run_url, done, min_steps, deadline_s=90.0):
  """Learners ``a0``, ``a1`` train together a round (two steps) at a time: at least
  ``min_steps`` steps, then until ``done()`` holds or ``deadline_s`` passes (a bound
  against hanging; the caller's checks then fail). Both stop after the same step."""
  deadline = time.monotonic() + deadline_s
  steps, stop = [0], [False]

  def decide():  # run by one learner once both finished the round's steps
    steps[0] += 2
    stop[0] = steps[0] >= min_steps and (done() or time.monotonic() > deadline)

  barrier = threading.Barrier(2, action=decide, timeout=2 * deadline_s)

  def body(name, index):
    try:
      learner = mail.open(run_url).join(name, poll_interval=ms.POLL, wait_timeout=60.0)
      params, goal = learner.pull(ms.params0()), ms.target(index)
      while True:
        for _ in range(2):
          params = learner.step(ms.inner(params, goal))
        barrier.wait()
        if stop[0]:
          break
      learner.close(params)
    except BaseException:
      barrier.abort()  # the other learner stops waiting for this one
      raise

  threads = ms.Threads()
  for m in range(2):
    threads.start(body, f"a{m}", m)
  threads.join(timeout=3 * deadline_s)


@pytest.mark.parametrize("value", [0, 1, -3, 2.0, True, "4"])
def test_keep_versions_is_checked(tmp_path, value):
  with pytest.raises((TypeError, ValueError), match="keep_versions"):
    mail.create(str(tmp_path / "run"), ms.params0(), CONFIG, keep_versions=value)
  assert not os.path.exists(tmp_path / "run" / layout.MANIFEST)  # refused before writing


def test_keep_versions_may_be_a_numpy_int(tmp_path):
  run = mail.create(str(tmp_path / "run"), ms.params0(), CONFIG, keep_versions=np.int64(3))
  assert run.manifest.keep_versions == 3 and type(run.manifest.keep_versions) is int


def test_keep_versions_is_stored_and_older_manifests_keep_everything(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), CONFIG)
  assert run.manifest.keep_versions == 4  # the default
  assert mail.open(url).manifest.keep_versions == 4
  with pytest.raises(mail.RunExists, match=r"keep_versions \(stored 4, given 8\)"):
    mail.create(url, ms.params0(), CONFIG, keep_versions=8)
  # A manifest written before the field existed: every version is kept.
  record = json.loads(run.store.get(layout.MANIFEST))
  del record["keep_versions"]
  run.store.put(layout.MANIFEST, json.dumps(record).encode())
  older = mail.open(url)
  assert older.manifest.keep_versions is None
  assert retention.prune(older.store, older.manifest, 0, 1000) == []


def test_a_prune_cut_short_leaves_no_gap_in_the_kept_versions(tmp_path):
  # Records went in name order, "10.commit.json" before "9.commit.json": a closer killed
  # between the two left version 9 without 10, which verify reports as damage.
  run = mail.create(str(tmp_path / "run"), ms.params0(), CONFIG, keep_versions=KEEP)
  for version in range(8, 13):
    run.store.put(layout.commit(0, version), b"{}")
    run.store.put(f"{layout.fragment_dir(0)}/{version}.commit-1.json", b"{}")
  deleted = []
  delete = run.store.delete

  def killed_after_three_records(path):
    if layout.slot_version(path.rsplit("/", 1)[-1]) is not None:
      if len(deleted) == 3:
        raise KeyboardInterrupt("killed")
      deleted.append(path)
    delete(path)

  run.store.delete = killed_after_three_records
  with pytest.raises(KeyboardInterrupt):
    retention.prune(run.store, run.manifest, 0, 12)
  left = sorted({layout.slot_version(e) for e in run.store.list(layout.fragment_dir(0))}
                - {None})
  assert left == list(range(left[0], 13)) and left[0] == 9, left


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_storage_stays_bounded_and_restarted_learners_rejoin(tmp_path, kind, request):
  url, storage_options = _url(kind, tmp_path, request.getfixturevalue("s3_options")
                              if kind == "s3" else None)
  run = mail.create(url, ms.params0(), CONFIG, keep_versions=KEEP,
                    storage_options=storage_options)
  first, then = (8, 16) if kind != "s3" else (4, 4)  # S3 on moto is slow
  _train_pair(url, first, storage_options)  # 3 or 4 versions a fragment: some pruned
  short = _usage(run.store)
  # What a kill mid-write leaves in a local directory: temporary files of old versions.
  torn = [f"{layout.fragment_dir(f)}/1{rest}.{uuid.uuid4().hex}.tmp" for f in range(2)
          for rest in (".commit.json", "-0123abcd.update.safetensors")]
  if kind == "local":
    for path in torn:
      with open(os.path.join(url, path), "wb") as f:
        f.write(b"torn")
  # The same learners join again (restarted, after their run was pruned) and train
  # longer.
  out = _train_pair(url, then, storage_options)
  long = _usage(run.store)
  newest = run.newest_versions()
  assert min(newest.values()) >= (first + then) // len(run.plan) // 2
  # Objects and bytes do not grow with the rounds (a join adds a claim until the
  # next compaction).
  assert long[0] <= short[0] + 2 and long[1] <= 1.1 * short[1], (short, long)
  for fragment, version in newest.items():
    kept = states.committed_versions(run.store, fragment)
    assert kept == [version - 1, version], (fragment, kept, newest)
    entries = run.store.list(layout.fragment_dir(fragment))
    assert all(int(e.split(".")[0].split("-")[0]) >= version - 1 for e in entries), entries
  if kind == "local":  # pruned with their versions
    assert not any(os.path.exists(os.path.join(url, path)) for path in torn)
    assert all(run.store.temporaries(layout.fragment_dir(f)) == [] for f in range(2))
  rounds = [int(r) for r in run.store.list("rounds")]
  assert len(rounds) <= KEEP * len(run.plan)
  assert [r.version for r in run.rounds()][-4:] == sorted(
      [newest[0] - 1, newest[0], newest[1] - 1, newest[1]])
  assert mail.verify(url, storage_options=storage_options) == []
  # Both rejoined learners end on the newest Θ.
  last = max(range(len(run.plan)), key=lambda f: run.commit(f, newest[f]).round)
  theta = states.load_theta(run.store, run.commit(last, newest[last]), 1 << 30)
  for name in run.plan[last]:
    for learner in ("a0", "a1"):
      np.testing.assert_array_equal(out[learner][name], theta[name])


def test_late_learner_merges_the_newest_version_when_its_rounds_were_pruned(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=KEEP)
  slow = mail.open(url).join("slow", poll_interval=ms.POLL, wait_timeout=60.0)
  params = slow.pull(ms.params0())
  try:
    # Rounds close on the quorum of one, after the grace period: "slow" falls behind.
    # Round 0 waits for a learner that joined but has not stepped up to its closer's
    # startup_timeout: 2 s here, not 60.
    ms.train(mail.open(url), "busy", 0, 10, startup_timeout=2.0)
    assert run.newest_versions() == {0: 5}
    goal = ms.target(1)
    for _ in range(6):  # rounds 0-2, committed and pruned (but round 2's version 3)
      params = slow.step(ms.inner(params, goal))
  finally:
    params = slow.close(params)
  assert slow.versions[0] >= 5
  theta = states.load_theta(run.store, run.commit(0, 5), 1 << 30)
  assert not any("slow" in {p.learner for p in r.participants} for r in run.rounds())
  # Only the rounds of the versions kept (4 and 5): nothing was sent to pruned rounds.
  assert run.store.list("rounds") == ["3", "4"]
  for name in theta:  # mixing 0: the last merge is the newest Θ
    np.testing.assert_array_equal(params[name], theta[name])
  assert mail.verify(url) == []


def test_pull_verify_and_repair_on_a_pruned_run(tmp_path, caplog):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), CONFIG, keep_versions=KEEP)
  _train_pair(url, 12)
  newest = run.newest_versions()
  assert mail.verify(url) == []
  assert states.committed_versions(run.store, 0) == [newest[0] - 1, newest[0]]
  # A new learner pulls the newest Θ.
  learner = mail.open(url).join("newcomer", poll_interval=ms.POLL)
  pulled = learner.pull(ms.params0())
  learner.close(pulled)
  theta = states.load_theta(run.store, run.commit(0, newest[0]), 1 << 30)
  for name in theta:
    np.testing.assert_array_equal(pulled[name], theta[name])
  # The newest state of fragment 0 damaged: repaired from the version kept before it.
  record = run.commit(0, newest[0])
  first = sorted(record.state_files)[0]
  run.store.put(f"{record.state}/{first}", b"damaged")
  assert any("state" in p for p in mail.verify(url))
  repaired, _ = recovery.repair(run.store, run.manifest, 0, newest[0], None, "test")
  assert repaired.extra["repair"]["from_version"] == newest[0] - 1
  assert mail.verify(url) == []
  # Nothing kept below is intact: the repair says the older versions were pruned.
  before = run.commit(0, newest[0] - 1)
  run.store.put(f"{before.state}/{sorted(before.state_files)[0]}", b"damaged")
  with pytest.raises(mail.CorruptRecord, match="pruned"):
    recovery.newest_intact_state(run.store, 0, newest[0], None, 1 << 30)
  # A pruned version is never repaired (committed again).
  with pytest.raises(retention.Pruned):
    recovery.repair(run.store, run.manifest, 0, 1, None, "test")
  assert not run.store.exists(layout.commit(0, 1))


def test_dead_heartbeats_claims_and_junk_are_compacted(tmp_path, monkeypatch):
  monkeypatch.setattr(retention, "DEAD_TIMEOUTS", 0.25)  # dead after 0.5 s, not 20 s
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, quorum_size=2),
                    keep_versions=KEEP)
  long_ago = (datetime.datetime.now(datetime.timezone.utc)
              - datetime.timedelta(hours=1)).isoformat()
  for i in range(100):
    name = f"gone-{i}"
    beat = {"name": name, "status": "closed" if i % 2 else "live", "seq": 3,
            "last_seen": long_ago, "incarnation": f"{i:032x}"}
    run.store.put(layout.heartbeat(name), json.dumps(beat).encode())
    run.store.put(f"learners/{name}.claims/1", f"{i:032x}".encode())
  for i in range(20):
    run.store.put(f"learners/junk-{i}.txt", b"x")
  with open(os.path.join(url, "learners", f"gone-0.json.{uuid.uuid4().hex}.tmp"), "wb") as f:
    f.write(b"torn")  # a heartbeat write a kill tore
    run.store.put(f"learners/bad-{i}.json", b"{not json")
  _train_pair(url, 4)
  own = {"a0.json", "a0.claims", "a1.json", "a1.claims"}

  def compacted():
    return (set(run.store.list("learners")) <= own
            and not run.store.temporaries("learners")
            and run.store.list("learners/a0.claims") == ["2"])

  # Joined again: the first joins' claims are old. A closer deletes a planted entry at a
  # compaction after one of its commits, once it has itself seen the entry unchanged for
  # 0.5 s (or longer, as the liveness timeout follows the run's timings). Twelve steps
  # (six rounds) can all commit within 0.5 s of a closer's first compaction, so the pair
  # trains on until the compaction is done.
  _train_pair_until(url, compacted, min_steps=12)
  entries = run.store.list("learners")
  assert set(entries) <= own, entries[:10]
  assert run.store.temporaries("learners") == []
  assert run.store.list("learners/a0.claims") == ["2"]  # the first join's claim went


def test_a_new_closer_compacts_what_the_storage_dates_long_ago(tmp_path):
  # Where learners come and go faster than dead_after, no closer lives to see an entry
  # unchanged that long: the storage's own dates judge it, at a closer's first
  # compaction. Claims without a heartbeat (a drop a kill cut short), a stray file and
  # a malformed heartbeat written an hour ago go; the same written now, and a live
  # learner's heartbeat and claims, stay.
  store = store_lib.open_store(str(tmp_path / "run"))
  now = time.time()
  live = {"name": "live", "status": "live", "seq": 3, "incarnation": "f" * 32,
          "last_seen": datetime.datetime.now(datetime.timezone.utc).isoformat()}
  store.put(layout.heartbeat("live"), json.dumps(live).encode())
  store.put("learners/live.claims/1", b"f" * 32)
  for age in ("old", "new"):
    store.put(f"learners/{age}-orphan.claims/1", b"0" * 32)
    store.put(f"learners/{age}-junk.txt", b"x")
    store.put(f"learners/{age}-bad.json", b"{not json")
  for path in ("old-orphan.claims/1", "old-junk.txt", "old-bad.json"):
    os.utime(tmp_path / "run" / "learners" / path, (now - 3600, now - 3600))
  roster = heartbeats.Roster(store)
  roster.refresh()
  assert set(roster.records) == {"live"} and set(roster.bad) == {"old-bad", "new-bad"}
  everything = store.list("learners")
  # By sight alone a new closer deletes nothing: it has seen nothing unchanged yet.
  assert retention.Compactor(store).compact(roster, 20.0, interval=0.0) == []
  assert store.list("learners") == everything
  removed = retention.Compactor(store).compact(roster, 20.0, interval=0.0,
                                               storage_clock=time.time)
  assert sorted(removed) == ["learners/old-bad.json", "learners/old-junk.txt",
                             "learners/old-orphan.claims/1"]
  assert store.list("learners") == ["live.claims", "live.json", "new-bad.json",
                                    "new-junk.txt", "new-orphan.claims"]
  assert store.list("learners/live.claims") == ["1"]


def test_what_an_observer_keeps_of_names_stays_as_long_as_learners(tmp_path):
  # A roster and a compactor kept an entry for every name and join they had ever seen:
  # a learner that stays while others come and go under new names held more each join.
  store = store_lib.open_store(str(tmp_path / "run"))
  roster, compactor = heartbeats.Roster(store), retention.Compactor(store)
  now = datetime.datetime.now(datetime.timezone.utc).isoformat()
  for wave in range(3):
    names = [f"w{wave}-{i}" for i in range(20)]
    for i, name in enumerate(names):
      beat = {"name": name, "status": "closed", "seq": 2, "incarnation": f"{i:032x}",
              "claim": 1, "last_seen": now}
      store.put(layout.heartbeat(name), json.dumps(beat).encode())
      store.put(f"learners/{name}.claims/1", f"{i:032x}".encode())
    store.put(f"learners/junk-{wave}.txt", b"x")
    roster.refresh()
    compactor.compact(roster, 20.0, interval=0.0)
    assert set(roster.records) == set(names)
    for name in names:  # compacted (by another closer: this one has seen them briefly)
      store.delete(layout.heartbeat(name))
      store.delete(f"learners/{name}.claims/1")
      store.delete_empty_folder(f"learners/{name}.claims")
    store.delete(f"learners/junk-{wave}.txt")
  roster.refresh()
  compactor.compact(roster, 20.0, interval=0.0)
  kept = [roster._newest, roster._rises, roster._claims, roster._changed,  # pylint: disable=protected-access
          compactor._since, compactor._trimmed]  # pylint: disable=protected-access
  assert roster.records == {} and [len(m) for m in kept] == [0] * len(kept), kept


def test_a_join_between_the_claims_and_their_folder_keeps_its_claim(tmp_path):
  # A join of the name listed the claims folder empty and created claim 1 just before
  # the closer removed the folder, which it had found empty: the folder's delete took
  # the new claim, and a second join got claim 1 too (two learners as one name).
  store = store_lib.open_store(str(tmp_path / "run"))
  store.put("learners/w.claims/1", b"0" * 32)
  old = time.time() - 3600
  os.utime(tmp_path / "run" / "learners" / "w.claims" / "1", (old, old))
  roster = heartbeats.Roster(store)
  roster.refresh()
  retry = store._retry  # pylint: disable=protected-access

  def join_first(what, path, call, *args):
    if (what, path) == ("delete", "learners/w.claims"):  # the folder's removal
      assert store.create("learners/w.claims/1", b"j" * 32)  # the join, just before it
    return retry(what, path, call, *args)

  store._retry = join_first  # pylint: disable=protected-access
  removed = retention.Compactor(store).compact(roster, 20.0, interval=0.0,
                                               storage_clock=time.time)
  assert removed == ["learners/w.claims/1"]
  assert store.get("learners/w.claims/1") == b"j" * 32
  store._retry = retry  # pylint: disable=protected-access
  # An emptied folder goes (on a local disk).
  store.delete("learners/w.claims/1")
  store.delete_empty_folder("learners/w.claims")
  assert store.list("learners") == []


def test_files_planted_under_strangers_names_are_counted_not_listed(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), CONFIG)
  for i in range(30):
    run.store.put(f"rounds/1/stranger-{i}.safetensors", b"junk")
  _train_pair(url, 6)
  record = next(r for r in run.rounds() if r.round == 1)
  assert len(record.rejected) == retention.MAX_LISTED_STRANGERS
  # Rejected from the listing, unread (a read would have found junk, not a payload).
  assert all("never joined" in r.reason for r in record.rejected), record.rejected
  assert record.extra["unlisted_rejections"] == 30 - retention.MAX_LISTED_STRANGERS
  assert sorted(p.learner for p in record.participants) == ["a0", "a1"]


def test_a_learner_that_beats_slowly_is_not_compacted_between_its_beats(tmp_path):
  # Live for ten of its own beats (beat_seconds 10: 100 s), it was judged by the
  # observers' dead_after (20 s) by the storage's clock: deleted between two beats.
  store = store_lib.open_store(str(tmp_path / "run"))
  now = time.time()
  for name, age in (("slow", 60), ("gone", 200)):
    seen = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=age)
    record = {"name": name, "status": "live", "seq": 3, "incarnation": name * 8,
              "last_seen": seen.isoformat(), "beat_seconds": 10.0}
    store.put(layout.heartbeat(name), json.dumps(record).encode())
    os.utime(tmp_path / "run" / "learners" / f"{name}.json", (now - age, now - age))
  roster = heartbeats.Roster(store)
  roster.refresh()
  removed = retention.Compactor(store).compact(roster, 20.0, interval=0.0,
                                               storage_clock=time.time)
  assert removed == ["learners/gone.json"]
  assert store.list("learners") == ["slow.json"]


def test_a_closer_paused_past_retention_does_not_commit_a_pruned_version(tmp_path):
  # A closer stopped (SIGSTOP, a VM pause) between its save and its commit record woke
  # after the others had committed on and pruned its version: the slot was free, so it
  # committed version 2 again, below the kept versions and naming a deleted state, and
  # verify reported versions 3-18 missing for good.
  import dataclasses  # pylint: disable=g-import-not-at-top

  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=KEEP)
  ms.train(mail.open(url), "busy", 0, 10)
  newest = run.newest_versions()[0]
  assert newest >= 4 and states.committed_versions(run.store, 0)[0] > 2
  late = dataclasses.replace(run.commit(0, newest), version=2, round=1)
  assert not states.write_commit(run.store, late, run.signing_key, keep_versions=KEEP)
  assert states.committed_versions(run.store, 0)[0] > 2
  assert mail.verify(url) == []
  # A version still kept is committed even with a newer one beside it: a fast closer may
  # commit on a record before its writer looks (here: the record written again).
  kept = run.commit(0, newest - 1)
  run.store.delete(layout.commit(0, newest - 1))
  assert states.write_commit(run.store, kept, run.signing_key, keep_versions=KEEP)
  assert mail.verify(url) == []


def test_a_heartbeat_seen_rising_is_not_judged_by_stepped_storage_dates(tmp_path):
  # The storage's dates jump when a writer's clock steps (a VM resumed): a heartbeat this
  # closer had just seen rise was deleted as an hour old, its claims with it, and a
  # second learner joined under the live one's name.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=KEEP)
  roster = heartbeats.Roster(run.store)
  hour_ago = time.time() - 3600
  for seq in (1, 2, 3):
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    run.store.put(layout.heartbeat("b"), json.dumps(
        {"name": "b", "status": "live", "seq": seq, "last_seen": now,
         "incarnation": "1" * 32}).encode())
    run.store.put("learners/b.claims/1", b"1" * 32)
    roster.refresh()
  assert roster.seen_rising("b") and roster.fresh("b", 20.0)
  for path in (os.path.join(url, "learners", "b.json"),
               os.path.join(url, "learners", "b.claims", "1")):
    os.utime(path, (hour_ago, hour_ago))
  removed = retention.Compactor(run.store).compact(roster, 20.0, interval=0.0,
                                                   storage_clock=time.time)
  assert removed == [] and run.store.list("learners/b.claims") == ["1"]
  # Seen once only (a closer that has just started), the storage's date judges it.
  fresh_roster = heartbeats.Roster(run.store)
  fresh_roster.refresh()
  removed = retention.Compactor(run.store).compact(fresh_roster, 20.0, interval=0.0,
                                                   storage_clock=time.time)
  assert "learners/b.json" in removed
