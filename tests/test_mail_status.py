"""``format_status`` and ``Run.status``: the run's rounds and learners at a glance."""

import json

import gmjax
from gmjax import mail

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


def test_status_of_a_new_run():
  run = mail.create("memory://status-new", ms.params0(), gmjax.DiLoCo(sync_every=2))
  text = mail.format_status(run)
  assert "no rounds committed yet" in text and "no learners have joined" in text
