"""A seeded chaos run in CI: kills, restarts, storage errors, torn and hostile files.

``benchmarks/chaos.py`` is the harness (``--rounds 500`` runs it long); this test runs it
for about 30 rounds and asserts every invariant it checks.
"""

import pytest

import bench_support

chaos = bench_support.load("chaos")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chaos_run_keeps_every_invariant(tmp_path):
  report = chaos.chaos(str(tmp_path), rounds=30, learners=4, seed=7, deadline=300.0)
  problems = chaos.check(report)
  assert not problems, "\n".join(problems)
  figures = chaos.figures(report)
  assert figures["rounds"] >= 30
  assert report.kills + report.self_kills >= 1  # the run was disturbed
  assert set(report.planted) == set(chaos.KINDS)  # one hostile file of each kind
  assert figures["rejected"] >= 1
  assert chaos.lost_or_duplicate(report.ledger) == 0


def test_lost_and_duplicate_commits_are_counted_from_the_ledger():
  # They were counted as check()'s messages holding "versions": a duplicate commit
  # counted 0, a retention problem 1, four lost versions of a fragment 1.
  ledger = chaos.Ledger("unused", 2)
  record = {"supersedes": []}
  ledger.slots = {(0, v): {f"fragments/0/{v}.commit.json": record} for v in (0, 1, 5)}
  ledger.slots[(1, 0)] = {"fragments/1/0.commit.json": record,
                          "fragments/1/0.commit-1.json": record}  # supersedes nothing
  assert chaos.lost_or_duplicate(ledger) == 3 + 1
