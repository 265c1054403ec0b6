"""Token counts of the in-mesh learners, exact past 2^24, and the weights they give.

A learner counts the tokens it trained since its last delta of each fragment. An F32
count stops being exact at 2^24 (16.8M tokens, a few steps of a large batch), so each
count is a pair of int32 ``(high, low)`` standing for ``high·2^24 + low`` with
``0 <= low < 2^24``: exact up to 2^55 tokens per round, and the carry needs no 64-bit
integers (which JAX leaves off by default).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

LOW_BITS = 24
_LOW_MASK = (1 << LOW_BITS) - 1


def zeros(fragments: int) -> jax.Array:
  """No tokens counted for any of ``fragments``: int32 of shape ``(fragments, 2)``."""
  return jnp.zeros([fragments, 2], jnp.int32)


def step_tokens(tokens: Any) -> jax.Array:
  """One step's token count as an int32 scalar (1 when not given).

  Raises:
    ValueError: ``tokens`` is not a scalar.
  """
  if tokens is None:
    return jnp.int32(1)
  value = jnp.asarray(tokens)
  if value.shape:
    raise ValueError(
        f"gmjax.diloco: tokens must be one number per learner and step, got shape"
        f" {value.shape}; pass e.g. the number of tokens in this learner's batch."
    )
  if jnp.issubdtype(value.dtype, jnp.floating):
    value = jnp.round(value)
  return value.astype(jnp.int32)


def normalized(high: jax.Array, low: jax.Array) -> jax.Array:
  """The pair ``(high, low)`` with the carry of ``low`` moved into ``high``."""
  return jnp.stack([high + (low >> LOW_BITS), low & _LOW_MASK], axis=-1)


def add(counts: jax.Array, tokens: jax.Array) -> jax.Array:
  """``counts`` (``(..., 2)`` pairs) plus a non-negative int32 ``tokens`` in each."""
  low = counts[..., 1] + (tokens & _LOW_MASK)
  return normalized(counts[..., 0] + (tokens >> LOW_BITS), low)


def as_float(counts: jax.Array) -> jax.Array:
  """The F32 value of ``(..., 2)`` pairs, rounded once."""
  return counts[..., 0].astype(jnp.float32) * jnp.float32(2.0**LOW_BITS) + counts[
      ..., 1
  ].astype(jnp.float32)


def total(counts: jax.Array) -> jax.Array:
  """The sum of ``(M, 2)`` pairs, as one pair (exact)."""
  return normalized(jnp.sum(counts[:, 0]), jnp.sum(counts[:, 1]))


def weights(counts: jax.Array) -> jax.Array:
  """``w_m = tokens_m / Σ tokens`` for ``(M, 2)`` pairs, F32; equal when none were counted.

  Counts below 2^24 convert exactly, so the weight is the correctly rounded quotient, as
  the mail closer computes it.
  """
  learners = counts.shape[0]
  whole = as_float(total(counts))
  nonzero = whole > 0
  return jnp.where(nonzero, as_float(counts) / jnp.where(nonzero, whole, 1), 1.0 / learners)
