"""``DiLoCoAggregator``: how one fragment's round is closed from its contributions.

The mail closer (``gmjax.mail.closer``) runs it, ``DiLoCoAggregator(config,
fragment_schema)``; ``gmjax.mail.create`` takes each fragment's version 0 from it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gmjax.core import outer_records, robust
from gmjax.core import round as round_ops
from gmjax.core.diloco import DiLoCo
from gmjax.core.records import (Aggregation, Contribution, FragmentState, Participant,
                                RoundResult)
from gmjax.core.schema import NUMPY_DTYPES, ParameterSpec, Schema, master_name
from gmjax.core.stats import cosine_from_gram


def _numpy_dtype(spec: ParameterSpec):
  return NUMPY_DTYPES[spec.dtype]


@functools.lru_cache(maxsize=64)
def _outer_transform(config: DiLoCo) -> optax.GradientTransformation:
  # One transformation per configuration: ``_close`` takes it as a static argument, which
  # jit compares by its functions' identity, so a fresh one per round would recompile.
  return config.outer_transform()


@functools.partial(
    jax.jit,
    static_argnames=("specs", "delta_wire", "commit_wire", "transform", "aliases",
                     "keep_master", "rule"),
)
def _close(theta, outer_state, contributions, weights, keep, *, specs, delta_wire,
           commit_wire, transform, aliases, keep_master, rule):
  # ``contributions``: each payload entry stacked over the slots (the learners in sorted
  # order, then zero padding), so every step is one program whatever their count.
  deltas = jax.vmap(lambda c: delta_wire.decode_values(c, specs))(contributions)
  dots = round_ops.gram_rows(list(deltas.values()))
  if rule.is_mean:
    applied = rule.apply(weights, keep, None)
    gradient = {s.name: round_ops.weighted_sum(deltas[s.name], weights) for s in specs}
  else:
    # The padding slots are not kept: they take part in no median and no trimming.
    squared = jnp.sum(jnp.where(jnp.eye(keep.shape[0], dtype=bool), dots, 0.0), axis=1)
    applied = rule.apply(weights, keep, squared)
    gradient = {s.name: rule.combine(deltas[s.name], applied, keep) for s in specs}
  master = {
      s.name: (outer_state[master_name(s.name)] if keep_master[i]
               else theta[s.name].astype(jnp.float32))
      for i, s in enumerate(specs)
  }
  # The optimizer's state structure, shapes and dtypes come from its own init (traced
  # for shapes only); the values from the stored records.
  template = jax.eval_shape(transform.init, master)
  state = outer_records.unflatten(outer_state, template, aliases)
  result = round_ops.outer_round(transform, gradient, state, master, theta, specs,
                                 commit_wire)
  new_outer = outer_records.flatten(result.state, aliases)
  for i, s in enumerate(specs):
    if keep_master[i]:
      new_outer[master_name(s.name)] = result.master[s.name]
  return result.theta, new_outer, result.update, dots, result.bad, applied


@dataclasses.dataclass(frozen=True)
class DiLoCoAggregator:
  """Closes rounds of one fragment: weighted mean of deltas, outer step, publish.

  ``g = Σ_m w_m · decode(Δ_m)`` with ``w_m = tokens_m / Σ tokens`` (equal weights when no
  tokens were counted; token counts are Python ints, exact at any size, each weight is
  their ratio in float64 as the record lists it, and F32 in the sum), summed in sorted learner order, then the
  config's outer optimizer (``apply_outer``) and ``publish``. The outer state travels as
  named records (``gmjax.core.outer_records``).
  """

  config: DiLoCo
  schema: Schema

  def close_round(
      self, state: FragmentState, contributions: Sequence[Contribution], *,
      capacity: int = 0,
  ) -> RoundResult:
    """Closes one round.

    Args:
      state: the fragment's base state.
      contributions: the valid contributions (any order; one per learner).
      capacity: the jitted step is compiled for a fixed number of contributions, the
        smallest power of two that is at least ``max(capacity, len(contributions))``;
        missing ones are zeros with zero weight, which leave every sum unchanged. Rounds
        with any count up to it share one compilation.
    """
    specs = self.schema.parameters
    ordered = sorted(contributions, key=lambda c: c.learner)
    learners = [c.learner for c in ordered]
    if len(set(learners)) != len(learners):
      raise ValueError(f"close_round got two contributions from one learner: {learners}")
    if not ordered:
      # No valid contribution: the version advances with Θ and the outer state unchanged.
      return self._unchanged(state, ())
    total = sum(c.tokens for c in ordered)
    if total > 0:
      weights = [c.tokens / total for c in ordered]
    else:
      weights = [1.0 / len(ordered)] * len(ordered)
    slots = padded_count(max(capacity, len(ordered)))
    padding = [self.zero_contribution()] * (slots - len(ordered))
    theta, outer_state, update, dots, bad, applied = _close(
        {s.name: state.theta[s.name] for s in specs},
        dict(state.outer),
        _stacked([dict(c.tensors) for c in ordered] + padding),
        np.asarray(weights + [0.0] * len(padding), np.float32),
        np.arange(slots) < len(ordered),
        specs=specs,
        delta_wire=self.config.delta_wire,
        commit_wire=self.config.commit_wire,
        transform=_outer_transform(self.config),
        aliases=outer_records.seed_aliases(self.config.outer),
        keep_master=tuple(self.config.keeps_master(s.dtype) for s in specs),
        rule=self.config.rule,
    )
    aggregation = None
    if not self.config.rule.is_mean:
      aggregation, weights = _described(self.config.rule, applied, learners)
    participants = tuple(
        Participant(c.learner, c.local_step, c.steps, c.tokens, float(w),
                    float(c.step_seconds))
        for c, w in zip(ordered, weights)
    )
    if float(bad) > 0:
      # The skip rule (``round.outer_round``): finite deltas can still overflow the outer
      # step; the version commits with the fragment unchanged, so the run goes on.
      return self._unchanged(state, participants, skipped=True, aggregation=aggregation)
    return RoundResult(
        state=FragmentState(state.version + 1, _host(theta), _host(outer_state)),
        participants=participants,
        cosine=cosine_from_gram(np.asarray(dots)[: len(ordered), : len(ordered)]),
        update=None if update is None else _host(update),
        aggregation=aggregation,
    )

  def _unchanged(self, state: FragmentState, participants: tuple[Participant, ...], *,
                 skipped: bool = False, aggregation: Aggregation | None = None
                 ) -> RoundResult:
    """The next version with Θ and the outer state of ``state`` (a zero update)."""
    update = None
    if self.config.commit_precision is not None:
      zeros = {s.name: np.zeros(s.shape, np.float32) for s in self.schema.parameters}
      update = _host(self.config.commit_wire.encode(zeros, self.schema))
    return RoundResult(
        FragmentState(state.version + 1, dict(state.theta), dict(state.outer)),
        participants, None, update, skipped, aggregation)

  def initial_state(self, theta: Mapping[str, Any]) -> FragmentState:
    """Version 0 of the fragment: the creator's parameters ``theta`` (by name), the
    outer optimizer's initial state (``tx.init`` of the F32 master: zero momentum for the
    default SGD) as named records (``gmjax.core.outer_records``), and the exact master
    where one is kept."""
    theta0, master0 = {}, {}
    for spec in self.schema.parameters:
      value = np.asarray(jax.device_get(theta[spec.name]))
      theta0[spec.name] = value.astype(_numpy_dtype(spec), copy=True)
      master0[spec.name] = theta0[spec.name].astype(np.float32)
    state = _outer_transform(self.config).init(
        {n: jnp.asarray(v) for n, v in master0.items()})
    records = outer_records.flatten(state, outer_records.seed_aliases(self.config.outer))
    outer0 = {n: np.array(v) for n, v in jax.device_get(records).items()}
    for spec in self.schema.parameters:
      if self.config.keeps_master(spec.dtype):
        outer0[master_name(spec.name)] = master0[spec.name]
    return FragmentState(version=0, theta=theta0, outer=outer0)

  def zero_contribution(self) -> dict[str, np.ndarray]:
    """Payload entries of an all-zero delta at the delta precision (padding)."""
    return self.config.delta_wire.zeros(self.schema)

  def warm(self, capacity: int) -> None:
    """Compiles the close of a round of up to ``capacity`` contributions (by closing
    one on zeros), so that the first real round does not wait on a compile."""
    zeros = {s.name: np.zeros(s.shape, NUMPY_DTYPES[s.dtype]) for s in self.schema.parameters}
    state = self.initial_state(zeros)
    self.close_round(state, [Contribution("warm", 0, 0, 0, 0.0, False,
                                          self.zero_contribution())], capacity=capacity)


def _described(rule: robust.Rule, applied: robust.Applied, learners: Sequence[str]
               ) -> tuple[Aggregation, list[float]]:
  """What a robust rule did, as the round record lists it, and each participant's
  weight: the token share the rule gave it (``"clipped_mean"``: capped and
  renormalized, its clip scale listed apart; ``"trimmed_mean"``: ``1/K``, as each
  coordinate averages the values it keeps with equal weights)."""
  shares = [float(w) for w in np.asarray(applied.shares, np.float64)[: len(learners)]]
  scales = np.asarray(applied.scales, np.float64)[: len(learners)]
  clipped = tuple((name, float(scale)) for name, scale in zip(learners, scales)
                  if scale < 1)
  return Aggregation(rule.name, rule.trim, clipped=clipped, capped=int(applied.capped),
                     trimmed=int(applied.trimmed)), shares


def _stacked(payloads: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
  """Each entry of ``payloads`` (alike in names, shapes and dtypes) stacked over them."""
  return {name: np.stack([np.asarray(p[name]) for p in payloads]) for name in payloads[0]}


def padded_count(count: int) -> int:
  """The number of contribution slots ``_close`` is compiled for: a power of two."""
  return 1 << max(0, count - 1).bit_length()


def _host(tree: Mapping[str, Any]) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in jax.device_get(dict(tree)).items()}
