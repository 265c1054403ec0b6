"""Typed errors of the mail runtime; each subclasses the built-in it refines."""

from __future__ import annotations


class RunExists(FileExistsError):
  """``create`` found a run at the URL with another schema, configuration or key."""


class NameTaken(FileExistsError):
  """``join`` was given the name of a learner that is live in the run."""


class RunNotFound(FileNotFoundError):
  """``open`` found no run (no ``manifest.json``) at the URL."""


class ContributionRejected(ValueError):
  """A contribution failed validation; ``reason`` is what the round record lists.

  Attributes:
    learner: the learner the contribution names (or its file name if unreadable).
    reason: a short description of what was wrong.
  """

  def __init__(self, learner: str, reason: str):
    super().__init__(f"contribution of {learner!r} rejected: {reason}")
    self.learner = learner
    self.reason = reason


class AuthenticationError(PermissionError):
  """The run's key is missing or wrong, or a signed record does not verify.

  Attributes:
    key: for a key given to an unsigned run, ``"unexpected"``; not given for a signed
      run, ``"missing"``; not the run's, ``"wrong"``; else None (a record or the
      manifest does not verify). Front ends name their own way of giving the key.
  """

  def __init__(self, message: str, *, key: str | None = None):
    super().__init__(message)
    self.key = key


class CorruptRecord(ValueError):
  """A stored record or state does not match the sha256 its commit recorded, or does
  not parse."""


class UnsupportedStorage(ValueError):
  """The run's URL names a storage protocol whose exclusive create is not atomic."""


class StorageNotInstalled(ImportError):
  """The package a run's storage needs (gcsfs for ``gs://``, s3fs for ``s3://``) is not
  installed; the message names the extra that installs it."""


class StorageUnavailable(TimeoutError):
  """A storage call kept failing with transient errors until its retry budget (for a
  learner, the run's timeout) ran out; the last error is its ``__cause__``."""


class RoundTimeout(TimeoutError):
  """A learner waited longer than its ``wait_timeout`` for a round to commit (from
  ``step``: the step counted, and the learner takes no more steps; close it)."""


class LearnerClosed(RuntimeError):
  """A learner was used after ``close`` or after its background work failed, or
  stepped after a ``step`` raised ``RoundTimeout``."""


class StateDirMismatch(ValueError):
  """A learner's ``state_dir`` holds the saved state of another run or learner name."""
