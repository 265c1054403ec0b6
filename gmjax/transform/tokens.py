"""Token counts of the in-mesh learners, exact past 2^24, and the weights they give.

A learner counts the tokens it trained since its last delta of each fragment. An F32
count stops being exact at 2^24 (16.8M tokens, a few steps of a large batch), so each
count is a pair of int32 ``(high, low)`` standing for ``high·2^24 + low`` with
``0 <= low < 2^24``: exact up to 2^55 tokens per round, and the carry needs no 64-bit
integers (which JAX leaves off by default).

A count whose learner withholds its delta (it dropped a step since its last delta of the
fragment: ``gmjax.transform.finite``) is marked by a negative low word (``WITHHELD``); it
stays marked until the round that consumes it, and the screening rejects that delta.

A step's count must be a non-negative whole number, as the mail runtime's
``Learner.step`` requires: a static one that is not is refused; a traced one is clamped
(negative or non-finite to 0, fractional down, above ``MAX_STEP_TOKENS`` to it) and the
step counted in ``stats.bad_tokens``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LOW_BITS = 24
_LOW_MASK = (1 << LOW_BITS) - 1
WITHHELD = -1
MAX_STEP_TOKENS = 2**31 - 1
# The largest F32 value an int32 holds (2^31 − 128): traced F32 counts are clamped to it.
_MAX_F32_TOKENS = float(np.nextafter(np.float32(2.0**31), np.float32(0)))


def zeros(fragments: int) -> jax.Array:
  """No tokens counted for any of ``fragments``: int32 of shape ``(fragments, 2)``."""
  return jnp.zeros([fragments, 2], jnp.int32)


def step_tokens(tokens: Any) -> tuple[jax.Array, jax.Array]:
  """One step's token count as an int32 scalar (1 when not given), and whether it was
  clamped (a bool scalar, False unless ``tokens`` is traced).

  A static count (a Python number, a concrete numpy or JAX array) must be a
  non-negative whole number up to ``MAX_STEP_TOKENS``. A traced one is clamped:
  negative or non-finite to 0, fractional down, above ``MAX_STEP_TOKENS`` to it.

  Raises:
    ValueError: ``tokens`` is not a scalar, not a real number, or static and not a
      non-negative whole number up to ``MAX_STEP_TOKENS``.
  """
  if tokens is None:
    return jnp.int32(1), jnp.bool_(False)
  if not isinstance(tokens, jax.core.Tracer):
    return jnp.int32(_static_count(tokens)), jnp.bool_(False)
  value = tokens
  if value.shape:
    raise _not_a_scalar(value.shape)
  _check_dtype(value.dtype, tokens)
  if jnp.issubdtype(value.dtype, jnp.floating):
    value = value.astype(jnp.promote_types(value.dtype, jnp.float32))
    whole = jnp.floor(value)
    ok = jnp.isfinite(value) & (whole == value) & (value >= 0) & (value <= _MAX_F32_TOKENS)
    clamped = jnp.clip(jnp.where(jnp.isfinite(value), whole, 0), 0, _MAX_F32_TOKENS)
    return clamped.astype(jnp.int32), ~ok
  ok = jnp.bool_(True)
  if jnp.issubdtype(value.dtype, jnp.signedinteger):
    ok = value >= 0
    value = jnp.maximum(value, 0)
  if jnp.iinfo(value.dtype).max > MAX_STEP_TOKENS:
    ok = ok & (value <= MAX_STEP_TOKENS)
    value = jnp.minimum(value, MAX_STEP_TOKENS)
  return value.astype(jnp.int32), ~ok


def _not_a_scalar(shape: tuple[int, ...]) -> ValueError:
  return ValueError(
      f"gmjax.diloco: tokens must be one number per learner and step, got shape"
      f" {shape}; pass e.g. the number of tokens in this learner's batch."
  )


def _check_dtype(dtype: Any, tokens: Any) -> None:
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise ValueError(
        f"gmjax.diloco: tokens must be a non-negative whole number, got {tokens!r} of"
        f" dtype {dtype}; pass the number of tokens in this learner's batch, e.g."
        " tokens=x.shape[0].")


def _static_count(tokens: Any) -> int:
  """``tokens``, known before tracing, as an int; raises unless it is a valid count."""
  if isinstance(tokens, bool):
    raise ValueError(
        f"gmjax.diloco: tokens must be a non-negative whole number, got {tokens!r}; pass"
        " the number of tokens in this learner's batch, e.g. tokens=x.shape[0].")
  value = np.asarray(tokens)
  if value.shape:
    raise _not_a_scalar(value.shape)
  _check_dtype(value.dtype, tokens)
  number = value.item()
  if not (np.isfinite(number) and number >= 0 and number == int(number)
          and int(number) <= MAX_STEP_TOKENS):
    raise ValueError(
        f"gmjax.diloco: tokens must be a non-negative whole number (as gmjax.mail's"
        f" Learner.step requires), at most 2^31 − 1 a step, got {tokens!r}; pass the"
        " number of tokens in this learner's batch, e.g. tokens=x.shape[0], or leave"
        " tokens unset to count 1 per step.")
  return int(number)


def normalized(high: jax.Array, low: jax.Array) -> jax.Array:
  """The pair ``(high, low)`` with the carry of ``low`` moved into ``high``."""
  return jnp.stack([high + (low >> LOW_BITS), low & _LOW_MASK], axis=-1)


def add(counts: jax.Array, tokens: jax.Array) -> jax.Array:
  """``counts`` (``(..., 2)`` pairs) plus a non-negative int32 ``tokens`` in each; a
  withheld count stays withheld."""
  low = counts[..., 1] + (tokens & _LOW_MASK)
  added = normalized(counts[..., 0] + (tokens >> LOW_BITS), low)
  return jnp.where(withheld(counts)[..., None], counts, added)


def withhold(counts: jax.Array, dropped: jax.Array) -> jax.Array:
  """``counts`` with every pair marked ``WITHHELD`` where ``dropped`` (a bool scalar)."""
  return jnp.where(dropped, jnp.full_like(counts, WITHHELD), counts)


def withheld(counts: jax.Array) -> jax.Array:
  """Which pairs of ``(..., 2)`` counts are withheld (bool ``(...)``)."""
  return counts[..., 1] < 0


def as_float(counts: jax.Array) -> jax.Array:
  """The F32 value of ``(..., 2)`` pairs, rounded once."""
  return counts[..., 0].astype(jnp.float32) * jnp.float32(2.0**LOW_BITS) + counts[
      ..., 1
  ].astype(jnp.float32)


def total(counts: jax.Array) -> jax.Array:
  """The sum of ``(M, 2)`` pairs, as one pair (exact)."""
  return normalized(jnp.sum(counts[:, 0]), jnp.sum(counts[:, 1]))


def weights(counts: jax.Array, keep: jax.Array | None = None) -> jax.Array:
  """``w_m = tokens_m / Σ tokens`` for ``(M, 2)`` pairs, F32; equal over the learners
  ``keep`` marks (all by default) when none were counted.

  Counts below 2^24 convert exactly, so the weight is the correctly rounded quotient, as
  the mail closer computes it.
  """
  learners = (jnp.float32(counts.shape[0]) if keep is None
              else jnp.maximum(jnp.sum(keep).astype(jnp.float32), 1.0))
  whole = as_float(total(counts))
  nonzero = whole > 0
  return jnp.where(nonzero, as_float(counts) / jnp.where(nonzero, whole, 1), 1.0 / learners)
