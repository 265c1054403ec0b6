"""How a round combines its kept deltas: the token-weighted mean or a robust rule.

``DiLoCo.aggregation`` names the rule, ``Rule`` applies it. Every runtime calls it on the
deltas stacked along a learners' dimension, after the screening (``gmjax.transform.screen``
in-mesh, the mail closer's checks) has chosen which deltas are kept: a rejected,
withheld or missing delta takes part in no median and no trimming.

* ``"mean"``: ``g = Σ_m w_m · Δ_m`` with the token weights ``w_m``.
* ``"clipped_mean"``: with ``ν`` the median of the kept deltas' norms and ``ω`` the
  median of their token weights, ``g = Σ_m w'_m · min(1, ν/‖Δ_m‖) · Δ_m`` where
  ``w'_m = min(w_m, ω) / Σ_k min(w_k, ω)``: no delta counts for more than a median one,
  in length or in tokens.
* ``"trimmed_mean"``: per coordinate, of the ``K`` kept values the ``t`` largest and the
  ``t`` smallest are dropped and the other ``K − 2t`` averaged with equal weights, where
  ``t = min(trim, ⌊(K − 1)/2⌋)``: a round with too few kept deltas to drop ``trim`` of
  each side takes the coordinate-wise median (the middle value, or the mean of the two
  middle ones). Token counts do not enter it.

The medians are those of ``numpy.median`` (the mean of the two middle values for an
even count). Everything is a few passes over the learners' dimension (a sort, masked
sums), jittable, and the same for any number of padding (not kept) learners.

References:
  Yin et al., *Byzantine-Robust Distributed Learning: Towards Optimal Statistical
  Rates*, arXiv 1803.01498 (the coordinate-wise trimmed mean and median).
  Karimireddy, He and Jaggi, *Learning from History for Byzantine Robust Optimization*,
  arXiv 2012.10333 (clipping to a robust radius).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gmjax.core import guards
from gmjax.core import round as round_ops

MEAN = "mean"
CLIPPED_MEAN = "clipped_mean"
TRIMMED_MEAN = "trimmed_mean"
RULES = (MEAN, CLIPPED_MEAN, TRIMMED_MEAN)


class Applied(NamedTuple):
  """What the rule did in a round, identical on every learner.

  Attributes:
    weights: F32 ``(M,)``: each kept delta's factor in ``g``, ``shares · scales``
      (``"trimmed_mean"``: ``1/K``, informational, as each coordinate averages its own
      ``K − 2t`` values); zero for the others.
    shares: F32 ``(M,)``: the token weights the rule gives (``"clipped_mean"``: capped
      and renormalized; ``"trimmed_mean"``: ``1/K``), summing to 1 over the kept.
    scales: F32 ``(M,)``: ``min(1, ν/‖Δ_m‖)`` (``"clipped_mean"``), else 1.
    clipped: int32: kept deltas whose norm was above the median and scaled to it.
    capped: int32: kept token weights above the median weight, capped to it.
    trimmed: int32: values dropped from each side of every coordinate (``t``).
  """

  weights: jax.Array
  shares: jax.Array
  scales: jax.Array
  clipped: jax.Array
  capped: jax.Array
  trimmed: jax.Array


def check(aggregation: Any, trim: Any, outlier_factor: Any = guards.OUTLIER_FACTOR) -> None:
  """Raises ValueError naming the argument unless ``aggregation``, ``trim`` and
  ``outlier_factor`` make a rule."""
  if aggregation not in RULES:
    raise ValueError(
        f"DiLoCo aggregation must be one of {', '.join(map(repr, RULES))}, got"
        f" {aggregation!r}: 'mean' trusts every learner with a valid key, the others"
        " bound what one learner can do to a round.")
  if isinstance(trim, bool) or not isinstance(trim, int) or trim < 1:
    raise ValueError(
        f"DiLoCo trim must be a positive int (values dropped from each side of every"
        f" coordinate by aggregation='trimmed_mean'), got {trim!r}: use trim=1 to"
        " withstand one attacker, trim=f for f colluding ones.")
  if trim != 1 and aggregation != TRIMMED_MEAN:
    raise ValueError(
        f"DiLoCo trim={trim!r} is used only by aggregation='trimmed_mean', got"
        f" aggregation={aggregation!r}: it would not be used, and the config would record"
        " it. Leave trim at 1, or set aggregation='trimmed_mean'.")
  if outlier_factor is not None and (
      isinstance(outlier_factor, bool) or not isinstance(outlier_factor, (int, float))
      or not 1 < outlier_factor < float("inf")):
    raise ValueError(
        f"DiLoCo outlier_factor must be a number above 1 or None, got {outlier_factor!r}:"
        " a delta whose norm is more than that many times the lower median of the"
        " learners' is rejected (and token counts above it clamped); None screens out"
        " only non-finite deltas, as DiLoCo itself does.")


def median(values: jax.Array, keep: jax.Array) -> jax.Array:
  """The median of ``values[keep]`` (F32 ``(M,)``), as ``numpy.median``; NaN if none."""
  ordered = jnp.sort(jnp.where(keep, values.astype(jnp.float32), jnp.inf))
  count = jnp.sum(keep).astype(jnp.int32)
  rank = jnp.arange(values.shape[0])
  pick = lambda r: jnp.sum(jnp.where(rank == r, ordered, 0.0))
  middle = jnp.float32(0.5) * (pick((count - 1) // 2) + pick(count // 2))
  return jnp.where(count > 0, middle, jnp.nan)


def effective_trim(trim: int, count: jax.Array) -> jax.Array:
  """``t = min(trim, ⌊(K − 1)/2⌋)`` (0 without kept deltas), int32."""
  count = jnp.asarray(count, jnp.int32)
  # A trim beyond int32 is beyond every count: clipped to it, it stays a valid bound.
  return jnp.clip((count - 1) // 2, 0, min(trim, 2**31 - 1)).astype(jnp.int32)


def trimmed_mean(stacked: jax.Array, keep: jax.Array, trim: int, axis: int = 0
                 ) -> jax.Array:
  """Per coordinate, the mean of the kept values without the ``t`` largest and smallest.

  Args:
    stacked: the learners' values, learner ``m`` at index ``m`` of ``axis``.
    keep: bool ``(M,)``: whose values take part (the others may hold anything).
    trim: values to drop from each side, at most (``effective_trim``).
    axis: the learners' dimension.

  Returns:
    ``stacked``'s shape without ``axis``, in F32: sums in the sorted order, from the
    ``t``-th smallest up, each value times ``1/(K − 2t)`` (``round.weighted_sum``).
  """
  shape = [1] * stacked.ndim
  shape[axis] = stacked.shape[axis]
  inside = jnp.reshape(keep, shape)
  # The left-out values sort after every kept one, which fills ranks 0 .. K − 1.
  ordered = jnp.sort(jnp.where(inside, stacked.astype(jnp.float32), jnp.inf), axis=axis)
  count = jnp.sum(keep).astype(jnp.int32)
  t = effective_trim(trim, count)
  rank = jnp.arange(stacked.shape[axis])
  middle = (rank >= t) & (rank < count - t)
  share = jnp.float32(1) / jnp.maximum(count - 2 * t, 1).astype(jnp.float32)
  return round_ops.weighted_sum(ordered, jnp.where(middle, share, 0.0), axis, keep=middle)


def clipped_weights(weights: jax.Array, keep: jax.Array, squared: jax.Array) -> Applied:
  """``"clipped_mean"``'s factors ``w'_m · min(1, ν/‖Δ_m‖)`` (module docstring).

  Args:
    weights: F32 ``(M,)`` token weights (any scale; only the kept ones are read).
    keep: bool ``(M,)``: the kept deltas.
    squared: F32 ``(M,)``: each delta's squared norm (only the kept ones are read).

  Returns:
    The ``Applied`` of the rule (``trimmed`` 0).
  """
  weights = jnp.where(keep, weights.astype(jnp.float32), 0.0)
  cap = median(weights, keep)
  over_cap = keep & (weights > cap)
  capped = jnp.where(over_cap, cap, weights)
  # In learner order (``weighted_sum``): the trailing padding of the mail closer's slots
  # then adds exact zeros, and every runtime renormalizes alike.
  total = round_ops.weighted_sum(capped, jnp.ones(capped.shape, jnp.float32))
  # Zero tokens everywhere that counts: equal weights, as the mean has then.
  count = jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)
  even = jnp.where(keep, jnp.float32(1) / count, 0.0)
  shares = jnp.where(total > 0, capped / jnp.where(total > 0, total, 1.0), even)
  norms = jnp.sqrt(jnp.where(keep, squared.astype(jnp.float32), 0.0))
  radius = median(norms, keep)
  over_radius = keep & (norms > radius)
  scale = jnp.where(over_radius, radius / jnp.where(over_radius, norms, 1.0), 1.0)
  return Applied(shares * scale, shares, scale, jnp.sum(over_radius).astype(jnp.int32),
                 jnp.sum(over_cap).astype(jnp.int32), jnp.zeros([], jnp.int32))


@dataclasses.dataclass(frozen=True)
class Rule:
  """A round's aggregation rule (``DiLoCo.aggregation``, ``DiLoCo.trim``), and the
  screening before it (``DiLoCo.outlier_factor``: ``gmjax.core.guards.outliers``).

  Example:
    >>> import jax.numpy as jnp
    >>> from gmjax.core.robust import Rule
    >>> deltas = jnp.array([[1.0], [2.0], [3.0], [-90.0]])  # learner 3 attacks
    >>> keep = jnp.array([True, True, True, True])
    >>> rule = Rule("trimmed_mean", trim=1)
    >>> applied = rule.apply(jnp.full(4, 0.25), keep, jnp.sum(deltas**2, axis=1))
    >>> rule.combine(deltas, applied, keep).tolist()  # -90 and 3 dropped
    [1.5]
  """

  name: str = MEAN
  trim: int = 1
  outlier_factor: float | None = guards.OUTLIER_FACTOR

  def __post_init__(self):
    if isinstance(self.trim, np.integer):  # as gmjax.DiLoCo takes it
      object.__setattr__(self, "trim", int(self.trim))
    check(self.name, self.trim, self.outlier_factor)

  @property
  def is_mean(self) -> bool:
    return self.name == MEAN

  @property
  def needs_values(self) -> bool:
    """Whether the rule needs every kept learner's value of each coordinate (a sum of
    weighted deltas, e.g. one ``psum``, does not do)."""
    return self.name == TRIMMED_MEAN

  def apply(self, weights: jax.Array, keep: jax.Array, squared: jax.Array) -> Applied:
    """The rule's factors and counts from the kept deltas' token weights and squared
    norms (each F32 ``(M,)``)."""
    zero = jnp.zeros([], jnp.int32)
    ones = jnp.ones(keep.shape, jnp.float32)
    if self.name == CLIPPED_MEAN:
      return clipped_weights(weights, keep, squared)
    if self.name == TRIMMED_MEAN:
      count = jnp.sum(keep).astype(jnp.int32)
      even = jnp.where(keep, jnp.float32(1) / jnp.maximum(count, 1).astype(jnp.float32),
                       0.0)
      return Applied(even, even, ones, zero, zero, effective_trim(self.trim, count))
    return Applied(weights, weights, ones, zero, zero, zero)

  def combine(self, stacked: jax.Array, applied: Applied, keep: jax.Array,
              axis: int = 0) -> jax.Array:
    """``g`` of one array of deltas stacked along ``axis``, in F32."""
    if self.name == TRIMMED_MEAN:
      return trimmed_mean(stacked, keep, self.trim, axis)
    return round_ops.weighted_sum(stacked, applied.weights, axis, keep=keep)
