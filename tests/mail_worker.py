"""A learner in its own process, for the mail tests.

Usage: mail_worker.py URL NAME INDEX STEPS MODE POLL STEP_SLEEP. MODE is ``normal`` or
``die_before_commit`` (the process kills itself with SIGKILL when it is about to create a
commit record, after reading the round's contributions and saving the state).
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mail_support  # pylint: disable=g-import-not-at-top

from gmjax import mail  # pylint: disable=g-import-not-at-top
from gmjax.mail import states  # pylint: disable=g-import-not-at-top


def main():
  url, name, index, steps, mode, poll, step_sleep = sys.argv[1:8]
  index, steps, poll, step_sleep = int(index), int(steps), float(poll), float(step_sleep)
  if mode == "die_before_commit":
    def die(*args, **kwargs):
      print("dying before commit", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    states.write_commit = die
  run = mail.open(url)
  learner = run.join(name, poll_interval=poll, wait_timeout=120.0)
  params = learner.pull(mail_support.params0())
  goal = mail_support.target(index)
  print("pulled", flush=True)
  for step in range(steps):
    params = mail_support.inner(params, goal)
    params = learner.step(params)
    print(f"step {step + 1}", flush=True)
    time.sleep(step_sleep)
  learner.close(params)
  print("closed", flush=True)


if __name__ == "__main__":
  main()
