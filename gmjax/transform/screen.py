"""Screening a round's deltas in-mesh by the rules the mail closer applies.

Before the weighted sum, each learner's decoded delta is judged from numbers every
learner holds alike (its squared norm over the fragment and its count of non-finite
values, both summed over the shards first when the outer step is sharded):

* a delta with a NaN or Inf value is rejected, and so is a withheld one (its learner
  dropped a step since its last delta, which would have made it non-finite:
  ``gmjax.transform.finite``; its token count is marked ``WITHHELD``);
* a delta whose norm is an outlier (``gmjax.core.guards.outliers``: more than
  ``DiLoCo.outlier_factor``, 10 by default, times the lower median of the learners'
  finite norms, judged only beside another learner's) is rejected;
* a kept learner's token count above that factor times the lower median of the kept
  learners' counts is clamped to it (with ``outlier_factor=None``, neither).

In-mesh every learner trains the same steps between syncs, so comparing norms and
tokens equals the mail closer's comparison per step. A rejected learner's weight is zero
and its delta is replaced by zeros (so its NaN cannot reach the sum); the others' token
weights are renormalized. When every delta is rejected the round is skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gmjax.core import guards, robust
from gmjax.core import round as round_ops
from gmjax.transform import explicit
from gmjax.transform import tokens as token_counts


class Verdict(NamedTuple):
  """What a round's screening decided, identical on every learner.

  Attributes:
    keep: bool ``(M,)``: whose delta enters the sum.
    weights: F32 ``(M,)``: the token weights of the kept learners (zero for the others).
    rejected: int32: how many deltas were rejected.
    clamped: int32: how many kept learners' token counts were clamped.
    applied: what the aggregation rule makes of the kept deltas
      (``gmjax.core.robust.Applied``: ``ruled``), None before.
  """

  keep: jax.Array
  weights: jax.Array
  rejected: jax.Array
  clamped: jax.Array
  applied: robust.Applied | None = None


def judge(squared: jax.Array, non_finite: jax.Array, counts: jax.Array,
          factor: float | None = guards.OUTLIER_FACTOR) -> Verdict:
  """The verdict on ``M`` deltas from their squared norms and non-finite counts.

  Args:
    squared: F32 ``(M,)``, each learner's ``‖decode(Δ_m)‖²`` over the fragment.
    non_finite: ``(M,)``, how many of each learner's decoded values are NaN or Inf.
    counts: int32 ``(M, 2)``, each learner's token count (``gmjax.transform.tokens``),
      marked where the learner withholds its delta.
    factor: ``DiLoCo.outlier_factor``; None judges no norm and clamps no count.
  """
  finite = (non_finite == 0) & ~token_counts.withheld(counts)
  values = token_counts.as_float(counts)
  if factor is None:
    keep, clamp = finite, jnp.zeros_like(finite)
    cap = jnp.zeros(values.shape, jnp.float32)
  else:
    norms = jnp.sqrt(jnp.where(finite, squared, jnp.nan))
    keep = finite & ~guards.outliers(norms, factor, xp=jnp)
    reference = guards.reference(jnp.where(keep, values, jnp.nan), xp=jnp)
    cap = jnp.floor(jnp.float32(factor) * reference)
    clamp = keep & ~jnp.isnan(reference) & (values > cap)
  capped = jnp.where(clamp[:, None], _pair(jnp.where(clamp, cap, 0)), counts)
  used = jnp.where(keep[:, None], capped, 0)
  # Equal weights over the kept deltas when none counted tokens, as the mail closer's.
  weights = jnp.where(keep, token_counts.weights(used, keep), 0.0)
  return Verdict(keep, weights, jnp.sum(~keep).astype(jnp.int32),
                 jnp.sum(clamp).astype(jnp.int32))


def verdict(squared: jax.Array, non_finite: jax.Array, counts: jax.Array,
            rule: robust.Rule) -> Verdict:
  """``judge`` by ``rule.outlier_factor``, then ``ruled`` by ``rule``."""
  return ruled(judge(squared, non_finite, counts, rule.outlier_factor), rule, squared)


def ruled(verdict: Verdict, rule: robust.Rule, squared: jax.Array) -> Verdict:
  """``verdict`` with the aggregation rule applied to its kept deltas, whose squared
  norms ``squared`` F32 ``(M,)`` are (a rejected one's value is not read)."""
  return verdict._replace(applied=rule.apply(verdict.weights, verdict.keep, squared))


def _pair(value: jax.Array) -> jax.Array:
  """The ``(high, low)`` int32 pair of a whole, non-negative F32 ``value`` below 2^55."""
  unit = jnp.float32(2.0**token_counts.LOW_BITS)
  high = jnp.floor(value / unit)
  # Both terms are F32 multiples of the value's ulp, so the difference is exact.
  low = value - high * unit
  return jnp.stack([high.astype(jnp.int32), low.astype(jnp.int32)], axis=-1)


def masked(delta, keep: jax.Array):
  """``delta`` where ``keep`` (a scalar), zeros otherwise (a NaN times a zero weight is
  NaN); one choice for the whole tree (``explicit.choose``)."""
  return explicit.choose(keep, delta, jax.tree.map(jnp.zeros_like, delta))


def squares_and_non_finite(delta) -> tuple[jax.Array, jax.Array]:
  """``(Σ d², count of non-finite d)`` of a delta's leaves, both F32 scalars."""
  leaves = jax.tree.leaves(delta)
  squared = explicit.total(jnp.sum(jnp.square(d.astype(jnp.float32))) for d in leaves)
  bad = round_ops.count_non_finite(leaves, explicit.total)
  return jnp.float32(squared), jnp.float32(bad)
