"""The records runtimes exchange and the protocols they drive.

The typed values the pure core hands the runtimes and takes from them: a committed
``FragmentState``, a learner's ``Contribution``, the ``Participant`` entry the round
record keeps, and the ``RoundResult`` an ``Aggregator`` returns; and the ``Algorithm``
and ``Aggregator`` protocols the mail runtime drives (``gmjax.DiLoCo`` and
``gmjax.core.aggregator.DiLoCoAggregator`` implement them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from gmjax.core.schedule import RoundSchedule

DType = Literal["F32", "F16", "BF16"]
Quantized = Literal["F8_E4M3", "F4", "I4", "I2"]
Precision = DType | Quantized | None
"""How a tensor travels: in a parameter dtype, quantized with its scales beside it, or,
with ``None``, in its own (schema) dtype."""

DTYPES: tuple[str, ...] = ("F32", "F16", "BF16")
QUANTIZED: tuple[str, ...] = ("F8_E4M3", "F4", "I4", "I2")
PRECISIONS: tuple[Precision, ...] = (None, *DTYPES, *QUANTIZED)

# A tensor as it is held by a record: any array with a dtype and shape (numpy or jax).
Tensor = Any


@dataclasses.dataclass(frozen=True)
class FragmentState:
  """A fragment as last committed: its version, the published anchor and the outer state.

  ``theta`` maps leaf names to the published Θ at the schema dtype. ``outer`` holds the
  outer optimizer's state as named records (``gmjax.core.outer_records``):
  ``momentum.<name>`` (F32) for the default SGD, ``outer.<k>.<field>.<name>`` and
  ``outer.<k>.<field>`` for other optimizers' leaves, and ``master.<name>`` in F32 when the
  published tensor is not the master (the schema dtype is not F32, or commits carry an
  update).
  """

  version: int
  theta: Mapping[str, Tensor]
  outer: Mapping[str, Tensor]


@dataclasses.dataclass(frozen=True)
class Contribution:
  """One learner's delta ``anchor - θ`` of a fragment for one round, as payload entries.

  ``final`` when the learner published it while closing: it trains no further.
  """

  learner: str
  local_step: int
  steps: int
  tokens: int
  step_seconds: float
  final: bool
  tensors: Mapping[str, Tensor]


@dataclasses.dataclass(frozen=True)
class Participant:
  """A contribution as the round record lists it, with the weight it received.

  ``step_seconds`` is the learner's reported seconds per step (None in records written
  before it was kept); adaptive steps (``gmjax.mail.pace``) time rounds by it.
  """

  learner: str
  local_step: int
  steps: int
  tokens: int
  weight: float
  step_seconds: float | None = None

  def to_json(self) -> dict[str, Any]:
    record = dataclasses.asdict(self)
    if record["step_seconds"] is None:
      del record["step_seconds"]
    return record


@dataclasses.dataclass(frozen=True)
class Aggregation:
  """What a robust aggregation rule (``gmjax.core.robust``) did in a round, as the round
  record lists it under ``"aggregation"`` (rounds aggregated by ``"mean"`` have none).

  Attributes:
    rule: ``"clipped_mean"`` or ``"trimmed_mean"``.
    trim: the configured ``trim``.
    clipped: ``(learner, scale)`` of each delta whose norm was clipped to the median,
      ``scale = median / norm``.
    capped: how many token weights were capped at the median weight.
    trimmed: values dropped from each side of every coordinate.
  """

  rule: str
  trim: int
  clipped: tuple[tuple[str, float], ...] = ()
  capped: int = 0
  trimmed: int = 0

  def to_json(self) -> dict[str, Any]:
    return {"rule": self.rule, "trim": self.trim,
            "clipped": [{"learner": n, "scale": s} for n, s in self.clipped],
            "capped": self.capped, "trimmed": self.trimmed}


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What closing a round produced.

  Attributes:
    state: the fragment's next state.
    participants: the contributions as the round record lists them.
    cosine: mean pairwise cosine similarity of the decoded deltas over the fragment
      (None with fewer than two).
    update: ``encode(master - Θ_old, commit_precision)`` entries for learners holding the
      old Θ to rebuild the new one from; None when commits carry Θ alone.
    skipped: the outer step's result was not finite, so ``state`` keeps Θ and the
      outer state (``gmjax.core.round.outer_round``'s skip rule).
    aggregation: what a robust rule did, or None (``"mean"``).
  """

  state: FragmentState
  participants: tuple[Participant, ...]
  cosine: float | None
  update: Mapping[str, Tensor] | None
  skipped: bool = False
  aggregation: Aggregation | None = None


@runtime_checkable
class Aggregator(Protocol):
  """Closes one round of one fragment; the only place outer tensor arithmetic happens."""

  def close_round(
      self, state: FragmentState, contributions: Sequence[Contribution]
  ) -> RoundResult: ...


@runtime_checkable
class Algorithm(Protocol):
  """A synchronization algorithm as the runtimes drive it."""

  def schedule(self, fragments: int) -> RoundSchedule:
    """The schedule of a plan of ``fragments`` fragments."""
    ...

  def plan(self, schema) -> tuple[tuple[str, ...], ...]: ...

  @property
  def delta_dtype(self) -> Precision: ...

  @property
  def commit_dtype(self) -> Precision: ...

  def quorum(self) -> int: ...

  @property
  def mixing(self) -> float: ...

  @property
  def flush_on_close(self) -> bool: ...

  def global_batch(self) -> int | None: ...

  def to_json(self) -> Mapping[str, object]: ...
