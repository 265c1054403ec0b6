"""``format_status`` and ``Run.status``: the run's rounds and learners at a glance."""

import json

import pytest

import gmjax
from gmjax import mail
from gmjax.mail import heartbeats
from gmjax.mail import layout

import mail_support as ms


def test_status_tables(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=4, fragments=2, quorum_size=2))
  out = {}
  threads = ms.Threads()
  for m in range(2):
    threads.start(ms.train, mail.open(url), f"w{m}", m, 4, out=out)
  threads.join(timeout=60)
  status = run.status()
  json.dumps(status)  # JSON-ready for `gmjax status --json`
  assert status["rounds"] == 3 and status["fragments"] == 2
  assert status["versions"] == {0: 2, 1: 1}  # round 2: final flush
  assert [l["name"] for l in status["learners"]] == ["w0", "w1"]
  text = mail.format_status(run)
  lines = text.splitlines()
  assert "2 fragment(s), sync every 4 steps" in lines[0]
  header = next(line for line in lines if line.startswith("round "))
  for column in ("frag", "ver", "step", "weights", "rejected", "cosine", "quorum_s", "sync_s",
                 "closer", "committed_at"):
    assert column in header
  assert sum(1 for line in lines if "w0:0.500 w1:0.500" in line) >= 2
  assert any(line.startswith("w1") and "closed" in line for line in lines)
  for column in ("grace_s", "takeover_s", "wait_s"):
    assert column in header
  learners_header = next(line for line in lines if line.startswith("learner "))
  for column in ("steps/s", "steps/round", "idle", "goodput"):
    assert column in learners_header
  rounds = run.rounds()
  assert all(r.wait_seconds >= r.quorum_seconds for r in rounds)
  for learner in status["learners"]:
    name = learner["name"]
    # Each learner trained 4 steps; its contributions, one fragment at a time, carried
    # each step once per fragment: rounds 0 (fragment 0, 2 steps), 1 (fragment 1, 4)
    # and the final flush 2 (fragment 0, 2), all committed.
    steps = [p.steps for r in rounds for p in r.participants if p.learner == name]
    assert steps == [2, 4, 2]
    assert learner["trained"] == 4 and learner["committed_steps"] == 8
    assert learner["goodput"] == 8 / (4 * 2)
    assert learner["steps_per_round_last"] == 2
    assert learner["steps_per_round_mean"] == sum(steps) / 3
    assert learner["step_seconds"] > 0
    assert learner["steps_per_second"] == 1 / learner["step_seconds"]
    assert 0 <= learner["idle_fraction"] <= 1 and learner["idle_seconds"] >= 0
  assert any(line.startswith("w0") and "100.0%" in line for line in lines)


def test_status_reads_heartbeats_without_pace_fields(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  ms.train(mail.open(url), "w0", 0, 4)
  # A learner of an older version (no pace fields), and one whose fields are junk.
  old = {"name": "old", "status": "closed", "seq": 3, "step": 2, "first_round": 0}
  junk = dict(old, name="junk", step_seconds="fast", trained=-1, idle_seconds=float("nan"))
  for record in (old, junk):
    run.store.put(layout.heartbeat(record["name"]), heartbeats.dumps(record, None))
  status = run.status()
  json.dumps(status)
  by_name = {l["name"]: l for l in status["learners"]}
  # Fields of the wrong kind make the heartbeat malformed (heartbeats.parse): ignored,
  # as the roster ignores it.
  assert "junk" not in by_name
  for name in ("old",):
    learner = by_name[name]
    assert learner["step_seconds"] is None and learner["steps_per_second"] is None
    assert learner["trained"] is None and learner["goodput"] is None
    assert learner["idle_seconds"] is None and learner["idle_fraction"] is None
    assert learner["committed_steps"] == 0 and learner["steps_per_round_mean"] is None
  assert by_name["w0"]["trained"] == 4 and by_name["w0"]["goodput"] == 1.0
  text = mail.format_status(run)
  assert any(line.startswith("old ") for line in text.splitlines())


def test_goodput_is_unknown_once_rounds_since_the_join_are_pruned(tmp_path):
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2), keep_versions=2)
  ms.train(mail.open(url), "w0", 0, 12)
  status = run.status()
  # Rounds 0..5 committed, all but two pruned: the count said 2, "rounds committed: 2".
  assert status["rounds"] == 6 and status["rounds_kept"] == 2
  assert "rounds committed: 6 (the last 2 kept, latest step 12)" in mail.format_status(run)
  (learner,) = status["learners"]
  assert learner["trained"] == 12 and learner["goodput"] is None
  assert learner["steps_per_round_last"] == 2


def test_status_of_a_new_run():
  run = mail.create("memory://status-new", ms.params0(), gmjax.DiLoCo(sync_every=2))
  text = mail.format_status(run)
  assert "no rounds committed yet" in text and "no learners have joined" in text


def test_a_killed_learner_shows_as_silent(tmp_path):
  # A learner killed with SIGKILL stayed "live" in `gmjax status` for good: its
  # heartbeat's own word. Past the time learners wait before presuming it dead, it is
  # shown as silent.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  script = (f"import time, gmjax\nlearner = gmjax.mail.open({url!r}).join('gone',"
            " poll_interval=0.02)\nprint('joined', flush=True)\ntime.sleep(600)\n")
  with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                        text=True) as process:
    assert process.stdout.readline().strip() == "joined"
    [learner] = mail.open(url).status()["learners"]
    assert learner["status"] == "live" and not learner["silent"]
    process.kill()
  deadline = time.monotonic() + 30
  while not mail.open(url).status()["learners"][0]["silent"]:
    assert time.monotonic() < deadline, "never shown as silent"
    time.sleep(0.2)
  row = mail.format_status(mail.open(url)).splitlines()[-1].split()
  assert row[:3] == ["gone", "live,", "silent"], row


def test_goodput_of_a_heartbeat_older_than_the_last_commit_is_at_most_one(tmp_path):
  # Killed right after a commit, a learner's last heartbeat counted fewer steps than its
  # committed contributions carried: 200% goodput.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  ms.train(mail.open(url), "w0", 0, 4)
  record = json.loads(run.store.get(layout.heartbeat("w0")))
  record["trained"] = 2  # as written before its last two steps
  run.store.put(layout.heartbeat("w0"), heartbeats.dumps(record, None))
  (learner,) = run.status()["learners"]
  assert learner["committed_steps"] == 4 and learner["goodput"] == 1.0


def test_format_status_lists_the_rounds_asked_for_and_names_bad_arguments(tmp_path):
  # last=0 listed every round, last=-1 all but the oldest "(the last 2 of 3 rounds)",
  # last=True one; a URL for the run was an AttributeError, and a string of problems
  # was listed character by character.
  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  ms.train(mail.open(url), "w0", 0, 6)
  table = lambda text: [l for l in text.splitlines() if l.lstrip("| ").split(" ")[0].isdigit()]
  assert len(table(mail.format_status(run, last=None))) == 3
  assert len(table(mail.format_status(run, last=2))) == 2
  text = mail.format_status(run, last=0)
  assert not table(text) and "(none of the 3 rounds kept listed: last=0)" in text
  for bad in (-1, True, 2.5, "3"):
    with pytest.raises(ValueError, match=r"last=.* must be None .* or an int >= 0"):
      mail.format_status(run, last=bad)
  with pytest.raises(TypeError, match=r"run must be a gmjax.mail.Run, got str .*mail.open"):
    mail.format_status(url)
  with pytest.raises(TypeError, match=r"problems must be a list .*got a string"):
    mail.format_status(run, problems="bad")


def test_a_learners_silence_is_judged_by_the_storage_not_its_clock(tmp_path):
  # gmjax status aged each heartbeat by its own last_seen, the writing machine's clock:
  # a live learner whose clock ran an hour behind showed as "live, silent", and one an
  # hour ahead, killed, as live with a negative age.
  import datetime  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  url = str(tmp_path / "run")
  run = mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2))
  now = datetime.datetime.now(datetime.timezone.utc)
  for name, hours in (("behind", -1), ("ahead", 1)):
    seen = (now + datetime.timedelta(hours=hours)).isoformat(timespec="milliseconds")
    run.store.put(layout.heartbeat(name), heartbeats.dumps(
        {"name": name, "status": "live", "seq": 5, "last_seen": seen}, None))
  written = time.time() - 600  # "ahead" last wrote its heartbeat 10 minutes ago
  os.utime(os.path.join(url, "learners", "ahead.json"), (written, written))
  by_name = {l["name"]: l for l in run.status()["learners"]}
  assert not by_name["behind"]["silent"] and by_name["behind"]["seconds_since_seen"] < 60
  assert by_name["ahead"]["silent"] and 590 < by_name["ahead"]["seconds_since_seen"] < 700
