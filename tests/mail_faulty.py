"""A store with injected faults, for the mail tests: a real store that fails on cue."""

from __future__ import annotations

import time

from gmjax.mail.store import Store


class FaultyStore(Store):
  """Forwards to ``inner``, raising ``error()`` on the calls ``failing(op, path)`` picks.

  Args:
    inner: the real store (a ``LocalStore``).
    failing: ``(operation, path) -> bool``; operation is put/create/get/list/delete.
    error: makes the exception to raise.
  """

  def __init__(self, inner: Store, failing, error=lambda: ConnectionError("injected")):
    super().__init__(inner.url, retry_seconds=inner.retry_seconds)
    self.inner, self.failing, self.error = inner, failing, error
    self._failures = [0]  # shared with the copies with_retry_budget makes

  @property
  def failures(self) -> int:
    """Calls failed so far, by this store and its copies."""
    return self._failures[0]

  def _maybe_fail(self, op, path):
    if self.failing(op, path):
      self._failures[0] += 1
      raise self.error()

  def _put(self, path, data, durable=True):
    self._maybe_fail("put", path)
    self.inner._put(path, data, durable)  # pylint: disable=protected-access

  def _create(self, path, data):
    self._maybe_fail("create", path)
    self.inner._create(path, data)  # pylint: disable=protected-access

  def _get(self, path):
    self._maybe_fail("get", path)
    return self.inner._get(path)  # pylint: disable=protected-access

  def _list(self, prefix):
    self._maybe_fail("list", prefix)
    return self.inner._list(prefix)  # pylint: disable=protected-access

  def _list_marked(self, prefix):
    self._maybe_fail("list", prefix)
    return self.inner._list_marked(prefix)  # pylint: disable=protected-access

  def _list_dated(self, prefix):
    self._maybe_fail("list", prefix)
    return self.inner._list_dated(prefix)  # pylint: disable=protected-access

  def _delete(self, path):
    self._maybe_fail("delete", path)
    self.inner._delete(path)  # pylint: disable=protected-access

  @property
  def local_root(self):
    return self.inner.local_root


def outage(seconds: float, starts=lambda op, path: True):
  """A ``failing`` predicate: every call fails for ``seconds`` from the first call that
  ``starts(op, path)`` picks."""
  window = {}

  def failing(op, path):
    if "start" not in window and not starts(op, path):
      return False
    start = window.setdefault("start", time.monotonic())
    return time.monotonic() - start < seconds
  return failing
