"""Closing the learners a script leaves open when it ends (``Learner`` registers itself).

A script that ends without ``close()`` (a forgotten one, an uncaught exception outside
a ``with`` block) would leave its learners' threads inside XLA or a storage write while
the interpreter finalizes, which aborts the process and loses the contribution being
written. So at exit the learners still open are closed, without waiting for any round,
when the main thread ends: before ``concurrent.futures`` refuses new work (its hook runs
then too, the later registered first), and after the thread that last used a learner,
which Python would wait for next, has ended. Those of daemon and executor threads are
closed at the interpreter's exit.
"""

from __future__ import annotations

import atexit
# Imported before the hook below is registered, so that its own exit hook, which stops
# every executor taking work (asyncio's and Orbax's too), runs after this one.
import concurrent.futures.thread  # pylint: disable=unused-import
import logging
import os
import threading
import weakref

log = logging.getLogger("gmjax.mail.learner")

OPEN: weakref.WeakSet = weakref.WeakSet()
"""The learners not closed yet."""


def _joined_at_exit(thread: threading.Thread) -> bool:
  """Whether Python joins ``thread`` before its exit: not a daemon, nor an executor's
  worker (those wait for work until ``concurrent.futures`` ends them)."""
  pool = concurrent.futures.thread
  return not thread.daemon and thread not in getattr(pool, "_threads_queues", {})


def _close_at_exit(main_thread_ended: bool) -> None:
  for learner in list(OPEN):
    user = learner._user  # pylint: disable=protected-access
    if main_thread_ended and user is not None and user.is_alive() and (
        user is not threading.current_thread()):
      if not _joined_at_exit(user):
        continue  # at the interpreter's exit
      user.join()  # as Python would next: its thread may still train and close it
    try:
      learner._leave(None, flush=False)  # pylint: disable=protected-access
    except Exception as error:  # pylint: disable=broad-except
      log.warning("learner %r: closing at exit: %r", learner.name, error)


getattr(threading, "_register_atexit", atexit.register)(lambda: _close_at_exit(True))
atexit.register(_close_at_exit, False)
os.register_at_fork(after_in_child=OPEN.clear)  # a child does not close its parent's
