"""Contribution payloads: how a learner writes its delta and how a closer checks one.

A contribution is a safetensors payload (``gmjax.core.payload``) holding the delta's
entries on the algorithm's delta wire (``gmjax.core.wire.Wire.layout``) and, in
``__metadata__``, the record fields: learner, round, fragment, base_version, local_step,
steps, tokens, step_seconds, final, precision, block, and with a run key ``signature``.

Every reported field is bounded (``check``): ``steps`` by the run's ``sync_every`` (a
learner's steps since its last contribution to a fragment never exceed it), ``tokens`` by
``steps · MAX_TOKENS_PER_STEP``, counts by ``MAX_COUNT``; ``step_seconds`` outside
``[0, MAX_STEP_SECONDS]`` is clamped and the clamp recorded. The decoded delta must be
finite; its norm per step is what the closer compares across the round
(``gmjax.core.guards.outliers``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Mapping
from typing import Any

import numpy as np

from gmjax.core import payload, sparse
from gmjax.core.codec import BLOCK
from gmjax.core.wire import Wire
from gmjax.core.guards import quote
from gmjax.core.records import QUANTIZED, Contribution
from gmjax.core.schema import NUMPY_DTYPES, Schema
from gmjax.mail import layout
from gmjax.mail import signing
from gmjax.mail.errors import ContributionRejected

_FLOAT_CODES = ("F32", "F16", "BF16", "F8_E4M3")
MAX_STEP_SECONDS = 3600.0
"""Reported seconds per inner step above this (an hour) are clamped to it."""
MAX_TOKENS_PER_STEP = 2**30
"""Reported tokens above ``steps`` times this (about 1e9 a step) reject a contribution."""
MAX_COUNT = 2**53
"""Rounds, versions and local steps stay below this."""


@dataclasses.dataclass(frozen=True)
class Checked:
  """A contribution that passed ``check``, with what the closer weighs it by.

  Attributes:
    contribution: the contribution (``step_seconds`` clamped).
    norm_per_step: ``‖decode(Δ)‖₂ / steps``, in float64.
    clamped: each field that was clamped, as the round record lists it:
      ``{learner, field, reported, used}``.
  """

  contribution: Contribution
  norm_per_step: float
  clamped: tuple[dict[str, Any], ...] = ()


def dumps(entries: Mapping[str, Any], *, learner: str, round_: int, fragment: int,
          base_version: int, local_step: int, steps: int, tokens: int,
          step_seconds: float, final: bool, precision: str | None,
          key: bytes | None) -> bytes:
  """The payload bytes of one contribution (signed when ``key`` is given)."""
  metadata = {
      "learner": learner,
      "round": str(round_),
      "fragment": str(fragment),
      "base_version": str(base_version),
      "local_step": str(local_step),
      "steps": str(steps),
      "tokens": str(tokens),
      "step_seconds": repr(float(step_seconds)),
      "final": "true" if final else "false",
      "precision": "none" if precision is None else precision,
      "block": str(BLOCK),
  }
  if key is not None:
    metadata[signing.SIGNATURE] = signing.sign_payload(key, entries, metadata)
  return payload.dumps(entries, metadata)


def learner_of(file_name: str) -> str:
  """The learner a contribution's file name stands for, as ``loads`` reports it."""
  if file_name.endswith(layout.CONTRIBUTION_SUFFIX):
    return file_name[: -len(layout.CONTRIBUTION_SUFFIX)]
  return file_name


def label(name: str) -> str:
  """How a record names the author of a file: a valid learner name as it is, anything
  else quoted short and escaped."""
  return name if layout.is_valid_name(name) else quote(name)


def max_bytes(payload_schema: Schema) -> int:
  """The largest an honest contribution of ``payload_schema`` can be, in bytes."""
  return payload.bounds(payload_schema)[1]


def _int(metadata: Mapping[str, str], field: str, learner: str, minimum: int = 0,
         maximum: int = MAX_COUNT) -> int:
  text = metadata.get(field)
  try:
    value = int(text)
  except (TypeError, ValueError):  # ValueError too for more than 4300 digits
    raise ContributionRejected(learner, f"metadata {field}={quote(text)} is not an int"
                               ) from None
  if not minimum <= value <= maximum:
    raise ContributionRejected(learner, f"metadata {field}={quote(text)} is outside"
                               f" [{minimum}, {maximum}]")
  return value


UNKNOWN = "unknown learner: it never joined the run"
"""Why a file under a name with no valid heartbeat is rejected (unread)."""


def check_name(file_name: str, known: Container[str]) -> str:
  """The learner a contribution's file name names, if it may be read at all.

  A file under a name that never joined is rejected unread: files planted under a
  thousand such names cost the round a listing, not a thousand reads.

  Raises:
    ContributionRejected: not a contribution's name, or its learner never joined.
  """
  if not file_name.endswith(layout.CONTRIBUTION_SUFFIX):
    raise ContributionRejected(label(file_name), "not a .safetensors contribution")
  learner = learner_of(file_name)
  if not layout.is_valid_name(learner):
    raise ContributionRejected(label(learner), "learner name does not match"
                               f" {layout.NAME_PATTERN.pattern}")
  if learner not in known:
    raise ContributionRejected(learner, UNKNOWN)
  return learner


def check(data: bytes, *, file_name: str, round_: int, fragment: int, base_version: int,
          schema: Schema, wire: Wire, known: Container[str],
          key: bytes | None, max_steps: int, base_lag: int = 0) -> Checked:
  """Parses and validates a contribution found at ``rounds/<round_>/<file_name>``.

  Checks, in order: the file name, the safetensors header (bounded by the layout), the
  metadata fields (learner, round, fragment, base version, counts and their bounds,
  precision), the signature when the run has a key, that the learner joined the run,
  the layout (names, dtypes, shapes, sizes), that every float entry is finite, that
  sparse indices lie in their chunks and rise strictly within each, and that the
  decoded delta is finite.

  Args:
    data: the file's bytes (read with the bound ``max_bytes`` gives).
    file_name: its name in ``rounds/<round_>/``.
    round_, fragment, base_version: what the round expects.
    schema: the fragment's parameter schema.
    wire: how the run's deltas travel (``DiLoCo.delta_wire``).
    known: names of the learners that joined the run.
    key: the run's key, or None.
    max_steps: the most steps a contribution can cover (the run's ``sync_every``).
    base_lag: the run's ``outer_delay``: a base version down to ``base_version −
      base_lag`` (and at least 0) is accepted too (a delayed learner's phase starts at
      the Θ one round older; one that joined the run mid-way starts at the newest).

  Returns:
    The contribution, its delta's norm per step, and what was clamped.

  Raises:
    ContributionRejected: with the reason the round record lists (hostile text in it
      quoted short and escaped).
  """
  learner = check_name(file_name, known)
  precision, topk, chunk = wire.precision, wire.topk, wire.chunk
  payload_schema = wire.layout(schema)
  try:
    entries, metadata = payload.loads(
        data, max_header_bytes=payload.bounds(payload_schema)[0])
  except payload.PayloadError as error:
    raise ContributionRejected(learner, f"unreadable payload: {error}") from None
  if metadata.get("learner") != learner:
    raise ContributionRejected(learner, f"metadata learner={quote(metadata.get('learner'))}"
                               " does not match the file name")
  for field, expected in (("round", round_), ("fragment", fragment)):
    value = _int(metadata, field, learner)
    if value != expected:
      raise ContributionRejected(learner, f"{field} {value}, expected {expected}")
  base, oldest = _int(metadata, "base_version", learner), max(0, base_version - base_lag)
  if not oldest <= base <= base_version:
    expected = base_version if oldest == base_version else f"{oldest} to {base_version}"
    raise ContributionRejected(learner, f"base_version {base}, expected {expected}")
  local_step = _int(metadata, "local_step", learner)
  steps = _int(metadata, "steps", learner, minimum=1, maximum=max_steps)
  tokens = _int(metadata, "tokens", learner, maximum=steps * MAX_TOKENS_PER_STEP)
  text = metadata.get("step_seconds", "0")
  try:
    step_seconds = float(text)
  except ValueError:
    raise ContributionRejected(learner, f"metadata step_seconds={quote(text)} is not a"
                               " number") from None
  clamped = []
  if not 0 <= step_seconds <= MAX_STEP_SECONDS:  # NaN too
    used = MAX_STEP_SECONDS if step_seconds > MAX_STEP_SECONDS else 0.0
    clamped.append({"learner": learner, "field": "step_seconds", "reported": quote(text),
                    "used": used})
    step_seconds = used
  if metadata.get("final") not in ("true", "false"):
    raise ContributionRejected(learner, f"final={quote(metadata.get('final'))} is not"
                               " 'true' or 'false'")
  expected_precision = "none" if precision is None else precision
  if metadata.get("precision") != expected_precision:
    raise ContributionRejected(learner, f"precision {quote(metadata.get('precision'))},"
                               f" the run uses {expected_precision!r}")
  if precision is not None and metadata.get("block") != str(BLOCK):
    raise ContributionRejected(learner, f"block {quote(metadata.get('block'))}, expected"
                               f" {BLOCK}")
  if key is not None and not signing.payload_signature_ok(key, entries, metadata):
    raise ContributionRejected(learner, "bad or missing HMAC-SHA256 signature")
  expected = {spec.name: spec for spec in payload_schema.parameters}
  if set(entries) != set(expected):
    missing = sorted(set(expected) - set(entries))
    extra = sorted(set(entries) - set(expected))
    raise ContributionRejected(
        learner, f"layout mismatch: missing {missing[:5]}, unexpected"
        f" [{', '.join(quote(n) for n in extra[:5])}]")
  for name, spec in expected.items():
    array = entries[name]
    if array.dtype != NUMPY_DTYPES[spec.dtype]:
      raise ContributionRejected(learner, f"entry {name!r} is {array.dtype}, expected"
                                 f" {spec.dtype}")
    if tuple(array.shape) != spec.shape:
      raise ContributionRejected(learner, f"entry {name!r} has shape {tuple(array.shape)},"
                                 f" expected {spec.shape}")
    if spec.dtype in _FLOAT_CODES and not np.isfinite(array.astype(np.float32, copy=False)).all():
      raise ContributionRejected(learner, f"entry {name!r} holds NaN or Inf")
  if topk is not None:
    for spec in schema.parameters:
      name = sparse.index_name(spec.name)
      problem = sparse.index_problem(entries[name], spec.size, topk, chunk)
      if problem is not None:
        raise ContributionRejected(learner, f"entry {name!r}: {problem}")
  norm = _norm(entries, schema, wire)
  if not math.isfinite(norm):
    raise ContributionRejected(learner, "the delta decodes to NaN or Inf in F32 (finite"
                               " codes times finite scales can overflow)")
  contribution = Contribution(
      learner=learner,
      local_step=local_step,
      steps=steps,
      tokens=tokens,
      step_seconds=step_seconds,
      final=metadata["final"] == "true",
      tensors=entries,
  )
  return Checked(contribution, norm / steps, tuple(clamped))


def _norm(entries: Mapping[str, np.ndarray], schema: Schema, wire: Wire) -> float:
  """‖decode(Δ)‖₂ in float64; inf if any decoded F32 value is not finite."""
  if wire.precision in QUANTIZED:  # codes times scales, in F32 as the aggregator decodes
    values = {k: np.asarray(v) for k, v in wire.decode(entries, schema).items()}
  elif wire.topk is not None:  # the kept values are the nonzero ones, already checked finite
    values = {spec.name: entries[spec.name] for spec in schema.parameters}
  else:  # F32/F16/BF16 values are their own decoding, already checked finite
    values = {spec.name: entries[spec.name] for spec in schema.parameters}
  total = 0.0
  for value in values.values():
    value = value.astype(np.float32, copy=False)
    if not np.isfinite(value).all():
      return math.inf
    total += float(np.dot(value.reshape(-1).astype(np.float64),
                          value.reshape(-1).astype(np.float64)))
  return math.sqrt(total)
