"""Contribution payloads: how a learner writes its delta and how a closer checks one.

A contribution is a safetensors payload (``gmjax.core.payload``) holding the delta's
entries at the algorithm's delta precision (``gmjax.core.codec.layout``) and, in
``__metadata__``, the record fields: learner, round, fragment, base_version, local_step,
steps, tokens, step_seconds, final, precision, block, and with a run key ``signature``.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from typing import Any

import numpy as np

from gmjax.core import payload
from gmjax.core.codec import BLOCK
from gmjax.core.records import Contribution
from gmjax.core.schema import NUMPY_DTYPES, Schema
from gmjax.mail import layout
from gmjax.mail import signing
from gmjax.mail.errors import ContributionRejected

_FLOAT_CODES = ("F32", "F16", "BF16", "F8_E4M3")


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


def _int(metadata: Mapping[str, str], field: str, learner: str, minimum: int = 0) -> int:
  text = metadata.get(field)
  try:
    value = int(text)
  except (TypeError, ValueError):
    raise ContributionRejected(learner, f"metadata {field}={text!r} is not an int") from None
  if value < minimum:
    raise ContributionRejected(learner, f"metadata {field}={value} is below {minimum}")
  return value


def loads(data: bytes, *, file_name: str, round_: int, fragment: int, base_version: int,
          payload_schema: Schema, precision: str | None, known: Container[str],
          key: bytes | None) -> Contribution:
  """Parses and validates a contribution found at ``rounds/<round_>/<file_name>``.

  Checks, in order: the file name, the safetensors header, the metadata fields (learner,
  round, fragment, base version, counts, precision), the signature when the run has a
  key, that the learner joined the run, the layout (names, dtypes, shapes, sizes) and
  that every float entry is finite.

  Raises:
    ContributionRejected: with the reason the round record lists.
  """
  if not file_name.endswith(layout.CONTRIBUTION_SUFFIX):
    raise ContributionRejected(file_name, "not a .safetensors contribution")
  learner = learner_of(file_name)
  if not layout.is_valid_name(learner):
    raise ContributionRejected(learner, "learner name does not match"
                               f" {layout.NAME_PATTERN.pattern}")
  try:
    entries, metadata = payload.loads(data)
  except payload.PayloadError as error:
    raise ContributionRejected(learner, f"unreadable payload: {error}") from None
  if metadata.get("learner") != learner:
    raise ContributionRejected(
        learner, f"metadata learner={metadata.get('learner')!r} does not match the file name")
  for field, expected in (("round", round_), ("fragment", fragment),
                          ("base_version", base_version)):
    value = _int(metadata, field, learner)
    if value != expected:
      raise ContributionRejected(learner, f"{field} {value}, expected {expected}")
  _int(metadata, "local_step", learner)
  steps = _int(metadata, "steps", learner, minimum=1)
  tokens = _int(metadata, "tokens", learner)
  try:
    step_seconds = float(metadata.get("step_seconds", "0"))
  except ValueError:
    raise ContributionRejected(learner, "metadata step_seconds is not a number") from None
  if not math.isfinite(step_seconds) or step_seconds < 0:
    step_seconds = 0.0
  expected_precision = "none" if precision is None else precision
  if metadata.get("precision") != expected_precision:
    raise ContributionRejected(
        learner, f"precision {metadata.get('precision')!r}, the run uses {expected_precision!r}")
  if precision is not None and metadata.get("block") != str(BLOCK):
    raise ContributionRejected(learner, f"block {metadata.get('block')!r}, expected {BLOCK}")
  if key is not None and not signing.payload_signature_ok(key, entries, metadata):
    raise ContributionRejected(learner, "bad or missing HMAC-SHA256 signature")
  if learner not in known:
    raise ContributionRejected(learner, "unknown learner: it never joined the run")
  expected = {spec.name: spec for spec in payload_schema.parameters}
  if set(entries) != set(expected):
    missing = sorted(set(expected) - set(entries))
    extra = sorted(set(entries) - set(expected))
    raise ContributionRejected(
        learner, f"layout mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
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
  return Contribution(
      learner=learner,
      local_step=int(metadata["local_step"]),
      steps=steps,
      tokens=tokens,
      step_seconds=step_seconds,
      final=metadata.get("final") == "true",
      tensors=entries,
  )
