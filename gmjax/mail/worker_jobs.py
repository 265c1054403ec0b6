"""What crosses between a learner's training thread and its background worker.

The training thread (``Learner`` and its ``Rounds``) puts jobs in the inbox of
``gmjax.mail.worker.Worker`` and gets ``Commit`` values back through futures. Each is a
small frozen value, kept apart from the worker's loop so that the training side imports
only what it sends and receives:

* ``Publish``: a contribution to upload (then its round to watch);
* ``Request``: a future to resolve with the ``Commit`` of a version once it is committed;
* ``Warm``: read the roster and compile the closer for the learners live now;
* ``Stop``: let the queued uploads go out, then end the thread;
* ``Commit``: what a request resolves to, Θ of the version and its round record.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, NamedTuple

import numpy as np

from gmjax.mail.records import RoundRecord

Key = tuple[int, int]  # (fragment, version)


@dataclasses.dataclass(frozen=True)
class Publish:
  """A contribution for the worker to upload (``Worker.publish``).

  Attributes:
    round: the round it contributes to.
    fragment: the round's fragment.
    base_version: the version its delta is taken against.
    local_step: the learner's own step count when it published.
    steps: inner steps the delta covers.
    tokens: tokens those steps trained.
    step_seconds: the learner's seconds per step (0 when not timed yet).
    final: a leaving learner's last contribution.
    delta: the delta (leaf name -> array), for the worker to encode; or None when
      ``entries`` holds it encoded already (by the learner, where error feedback's
      residual or the eager correction must follow the bytes).
    entries: the encoded delta, or None.
  """

  round: int
  fragment: int
  base_version: int
  local_step: int
  steps: int
  tokens: int
  step_seconds: float
  final: bool
  delta: dict[str, Any] | None = None
  entries: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Request:
  """A future to resolve with the ``Commit`` of ``key`` once it is committed."""
  key: Key
  future: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class Warm:
  """Read the roster and compile the closer for the learners live now."""


@dataclasses.dataclass(frozen=True)
class Stop:
  """Let the queued uploads go out, then end the thread."""


class Commit(NamedTuple):
  """What a ``request`` resolves to: Θ of the version (leaf name → array) and the round
  record that committed it."""
  theta: dict[str, np.ndarray]
  record: RoundRecord
