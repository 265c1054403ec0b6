"""The state of ``gmjax.diloco`` and the statistics users log from it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Codes of ``DiLoCoState.pending``: what the next merge of a fragment does.
NOTHING = 0
MERGE = 1  # align to the fragment's new anchor with mixing
RESET = 2  # the round was skipped: reset the fragment to its anchor, no mixing


class Kept(tuple):
  """One fragment's masters (``DiLoCoState.master[f]``): a tuple of buckets that names
  the fragment's pieces (``pieces``) and, sharded, the learners' count (``learners``;
  None replicated) as static data of the tree.

  A state built under another plan (another ``layer_axis``, other fragments) or for
  another count of learners is then another tree, which ``update`` refuses, even where
  its buckets' shapes agree: read in the other layout they would put one leaf's values
  into another's Θ, or one learner's shard of the outer state into another's.
  """

  pieces: tuple[str, ...]
  learners: int | None

  def __new__(cls, values: Any, pieces: Any, learners: int | None = None) -> Kept:
    kept = super().__new__(cls, values)
    kept.pieces, kept.learners = tuple(pieces), learners
    return kept

  def __getnewargs__(self) -> tuple[tuple, tuple[str, ...], int | None]:
    return tuple(self), self.pieces, self.learners

  def __repr__(self) -> str:
    return f"Kept(learners={self.learners!r}, pieces={self.pieces!r}, {list(self)!r})"


jax.tree_util.register_pytree_with_keys(
    Kept,
    lambda kept: (tuple((jax.tree_util.SequenceKey(i), v) for i, v in enumerate(kept)),
                  (kept.pieces, kept.learners)),
    lambda static, values: Kept(values, *static),
    lambda kept: (tuple(kept), (kept.pieces, kept.learners)))


class DiLoCoStatistics(NamedTuple):
  """Health statistics of the latest round, replicated on every learner, and counts of
  this learner's dropped steps and bad token counts.

  Attributes:
    rounds: rounds done so far (skipped ones included), int32.
    skipped: rounds whose aggregated delta, or the outer step's result (master, Θ), was
      not finite, or all of whose deltas were rejected, so no outer step was kept, int32.
    fragment: the fragment the latest round synchronized, int32 (``-1`` before any).
    delta_norm: the L2 norm of the latest round's outer gradient
      ``g = Σ_m w_m Δ_m`` over its fragment, F32 (NaN before any round).
    cosine: the mean pairwise cosine similarity of the kept learners' decoded deltas in
      the latest round, F32; NaN with fewer than two nonzero ones (one learner).
    rejected: how many learners' deltas the latest round rejected (NaN or Inf values,
      withheld after a dropped step, or a norm more than ``DiLoCo.outlier_factor``
      times the lower median of the learners'; see ``gmjax.transform.screen``), int32.
    clamped: how many kept learners' token counts the latest round clamped, int32.
    clipped: with ``aggregation="clipped_mean"``, how many kept deltas the latest round
      clipped to the median norm, int32 (0 otherwise; ``gmjax.core.robust``).
    capped: with ``aggregation="clipped_mean"``, how many kept token weights the latest
      round capped at the median weight, int32.
    trimmed: with ``aggregation="trimmed_mean"``, how many values the latest round
      dropped from each side of every coordinate, int32 (``min(trim, ⌊(K−1)/2⌋)`` of
      ``K`` kept deltas).
    dropped: this learner's steps so far whose update was dropped because its
      gradients, or ``params + updates``, were not finite (its next delta of every
      fragment withheld; ``gmjax.transform.finite``), int32; not replicated.
      Parameters that already hold NaN or Inf count on every step.
    bad_tokens: this learner's steps so far whose traced ``tokens`` was not a
      non-negative whole number and was clamped (negative or non-finite to 0,
      fractional down), int32; not replicated.
  """

  rounds: jax.Array
  skipped: jax.Array
  fragment: jax.Array
  delta_norm: jax.Array
  cosine: jax.Array
  rejected: jax.Array
  clamped: jax.Array
  clipped: jax.Array
  capped: jax.Array
  trimmed: jax.Array
  dropped: jax.Array
  bad_tokens: jax.Array


def initial_statistics() -> DiLoCoStatistics:
  return DiLoCoStatistics(
      rounds=jnp.zeros([], jnp.int32),
      skipped=jnp.zeros([], jnp.int32),
      fragment=jnp.full([], -1, jnp.int32),
      delta_norm=jnp.full([], jnp.nan, jnp.float32),
      cosine=jnp.full([], jnp.nan, jnp.float32),
      rejected=jnp.zeros([], jnp.int32),
      clamped=jnp.zeros([], jnp.int32),
      clipped=jnp.zeros([], jnp.int32),
      capped=jnp.zeros([], jnp.int32),
      trimmed=jnp.zeros([], jnp.int32),
      dropped=jnp.zeros([], jnp.int32),
      bad_tokens=jnp.zeros([], jnp.int32),
  )


class DiLoCoState(NamedTuple):
  """State of ``gmjax.diloco``: a plain pytree (save it with Orbax like the parameters).

  Attributes:
    inner_state: the inner optimizer's state (local to each learner).
    count: inner steps done (the global step), int32.
    anchor: Θ of each fragment's latest round, at the parameter dtype, shaped like the
      parameters. Between a round and its merge (``overlap_steps`` later) it already
      holds the new Θ the learner is about to merge.
    master: per fragment, a ``Kept`` tuple of F32 buckets (``gmjax.transform.buckets``): the
      rows of 32 values of the fragment's leaves (pieces, with ``layer_axis``) that
      travel and publish alike, end to end in the fragment's name order, shape
      ``(F, S, 32)`` (``F`` the devices an FSDP split cuts them into, 1 otherwise).
      Replicated, a bucket holds every row; sharded, this learner's rows (every
      ``M``-th codec block of each leaf, see ``gmjax.transform.shards``).
      ``optax.MaskedNode`` for a bucket whose Θ is its own master (F32 leaves without
      ``commit_precision``).
    outer_state: per fragment, the outer optimizer's state over the fragment's master
      buckets (a tuple), e.g. the trace of the default Nesterov SGD. An outer optimizer
      that is not elementwise (replicated only) keeps its state over the fragment's
      leaves in their own shapes instead, in the fragment's name order.
    pending: per fragment, what its next merge does (0 nothing, 1 align with mixing,
      2 reset to the anchor after a skipped round), int32 of shape ``(P,)``.
    tokens: per fragment, tokens trained since the learner's last delta of it, exact
      int32 pairs ``(high, low)`` = ``high·2^24 + low``, shape ``(P, 2)``; ``(−1, −1)``
      (``gmjax.transform.tokens.WITHHELD``) after a dropped step: the delta is withheld.
    stats: ``DiLoCoStatistics`` of the latest round.
    residual: with ``error_feedback``, this learner's F32 residual ``e`` of every leaf
      (``gmjax.core.feedback``), shaped and laid out like the parameters (each learner
      holds its own residual of whole fragments); ``optax.MaskedNode()`` without.
    delay: with ``outer_delay=1``, this learner's ``DelayState``; ``optax.MaskedNode()``
      without.
  """

  inner_state: Any
  count: jax.Array
  anchor: Any
  master: Any
  outer_state: Any
  pending: jax.Array
  tokens: jax.Array
  stats: DiLoCoStatistics
  residual: Any = optax.MaskedNode()
  delay: Any = optax.MaskedNode()


class DelayState(NamedTuple):
  """A learner's own state under ``outer_delay=1`` (``gmjax.core.eager``), per learner.

  Attributes:
    start: F32, shaped and laid out like the parameters: where each fragment's current
      inner phase started (its deltas are ``start − θ``).
    correction: with ``eager``, the F32 correction ``p`` (start = previous Θ + p), else
      ``optax.MaskedNode()``; likewise the others.
    previous: with ``eager``, the learner's last decoded delta of each fragment, F32.
    weight: with ``eager``, F32 ``(P,)``: the weight the learner had in each fragment's
      last round (``1/M`` before any).
    outer: with ``eager``, per fragment, the state of the learner's own copy of the
      outer optimizer over the fragment's leaves (whole leaves, not sharded).
  """

  start: Any
  correction: Any = optax.MaskedNode()
  previous: Any = optax.MaskedNode()
  weight: Any = optax.MaskedNode()
  outer: Any = optax.MaskedNode()


class RoundState(NamedTuple):
  """The part of ``DiLoCoState`` that the rare steps (first update, sync, merge) change."""

  anchor: Any
  master: Any
  outer_state: Any
  pending: jax.Array
  tokens: jax.Array
  stats: DiLoCoStatistics
  residual: Any = optax.MaskedNode()
  delay: Any = optax.MaskedNode()
