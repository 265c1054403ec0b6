"""How a ``gmjax train`` job stops: SIGTERM and SIGHUP as Ctrl-C, and a learner that
failed. Imported by the command before anything heavy, so that a signal in the job's
first seconds stops it as one later does."""

from __future__ import annotations

import contextlib
import signal
import threading


class LearnersFailed(RuntimeError):
  """A learner process of the job exited with an error (each one's log tail quoted)."""


@contextlib.contextmanager
def _handled(signals, handler):
  """``handler`` for each of ``signals`` the job was not started to ignore (``nohup``),
  the previous handlers back on exit."""
  previous = {s: signal.signal(s, handler) for s in signals
              if signal.getsignal(s) is not signal.SIG_IGN}
  try:
    yield
  finally:
    for s, old in previous.items():
      signal.signal(s, old)


@contextlib.contextmanager
def stopped_by_signals():
  """SIGTERM and SIGHUP stop the job as Ctrl-C does (``KeyboardInterrupt``), so that it
  stops its learners rather than leave them running without it; one the job was started
  to ignore (``nohup``) stays ignored."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def interrupt(signum, frame):  # pylint: disable=unused-argument
    raise KeyboardInterrupt(signal.Signals(signum).name)

  with _handled((signal.SIGTERM, signal.SIGHUP), interrupt):
    yield


@contextlib.contextmanager
def deferred():
  """Ctrl-C, SIGTERM and SIGHUP noted, not raised, until the ``check`` this yields is
  called, which raises ``KeyboardInterrupt`` as ``stopped_by_signals`` would.

  For work that XLA runs in this process (the baseline): an interrupt raised inside a
  compile or a step left XLA's threads at work while the interpreter shut down, and the
  job died of a segmentation fault (exit 139) instead of exiting 130. A signal the job
  was started to ignore stays ignored.
  """
  if threading.current_thread() is not threading.main_thread():
    yield lambda: None
    return
  noted = []

  def check():
    if noted:
      raise KeyboardInterrupt("" if noted[0] == signal.SIGINT
                              else signal.Signals(noted[0]).name)

  with _handled((signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
                lambda signum, frame: noted.append(signum)):
    yield check
  check()  # one that came after the last check
