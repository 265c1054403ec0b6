"""The run's timeout cannot feed on itself: a learner that always publishes late, at
0.8x the timeout, stretches its rounds but not the timeout."""

import time

import pytest

import gmjax
from gmjax import mail

import mail_support as ms

POLL = 0.02
ROUNDS = 12


def _timeout(run):
  rounds = run.rounds()
  estimates = rounds[-1].estimates if rounds else gmjax.Estimates()
  return estimates.timeout(POLL)


def _late(run, out):
  """Trains like the others, but sleeps 0.8x the run's current timeout every round (named
  to sort last: not the designated closer, which starts watching a round when it publishes)."""
  learner = run.join("z-late", poll_interval=POLL, wait_timeout=60.0)
  params = learner.pull(ms.params0())
  for step in range(2 * ROUNDS):
    params = ms.inner(params, ms.target(3))
    if step % 2 == 1:
      out.append(_timeout(run))
      time.sleep(0.8 * out[-1])
    params = learner.step(params)
  learner.close(params)


@pytest.mark.timeout(180)
def test_a_learner_publishing_late_every_round_does_not_grow_the_timeout(tmp_path):
  url = str(tmp_path / "run")
  mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=2, flush_on_close=False))
  timeouts = []
  threads = ms.Threads()
  for m in range(3):
    threads.start(ms.train, mail.open(url), f"w{m}", m, 2 * ROUNDS, poll=POLL)
  threads.start(_late, mail.open(url), timeouts)
  threads.join(timeout=150)
  floor = gmjax.Estimates().timeout(POLL)
  # Fed back, the wait for the late learner grew the timeout ~1.2x a round (9x in 12).
  assert _timeout(mail.open(url)) < 3 * floor, timeouts
  assert max(timeouts) < 3 * floor, timeouts
