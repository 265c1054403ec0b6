"""The replicated exchange of one round (``shard_outer=False``): every learner gets ``g``.

Deltas cross the axis at ``delta_precision``, as the mail runtime stores them, a
fragment's dense deltas as its buckets (``gmjax.transform.buckets``: the leaves' rows of
32 values end to end, the codec's blocks), so each step is one operation a bucket:

* F32 deltas (``delta_precision="F32"``, or ``None`` with F32 parameters) are summed with
  one ``psum`` of ``(w_m·Δ_m, Δ_m/‖Δ_m‖)``; the second half feeds the cosine statistic.
* Every other precision all-gathers the encoded buckets (F16/BF16 values, or the
  quantized codes and their F32 block scales) along a learners' dimension, and each
  learner decodes them all at once and forms ``Σ_m w_m · decode(Δ_m)`` locally, in
  learner order, with the core's ``weighted_sum``: the program does not grow with ``M``.
  Codes and 16-bit values cross as unsigned integers of their width: XLA's CPU backend
  widens float8 and bf16 collectives to wider floats.

This moves ``(M−1)·b·n`` bytes per learner for an all-gather: the sharded exchange
(``gmjax.transform.exchange``) is the bandwidth-optimal one. Sparse (top-k) deltas
(``gmjax.core.sparse``) are always all-gathered, leaf by leaf (the top-k sets are chosen
in chunks of each flat leaf), every learner's top-k set being its own: their kept
values' codes (and scales) and indices, ``(M−1)·d·(b + b_index)·n`` bytes per learner
for a density ``d = k / chunk``, plus the scales.

References:
  Douillard et al., *Streaming DiLoCo with overlapping communication*, arXiv 2501.18512
  (quantized exchange of the outer gradients).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gmjax.core import robust
from gmjax.core import round as round_ops
from gmjax.core.schema import ParameterSpec
from gmjax.core.wire import Wire
from gmjax.transform import collectives, explicit, screen
from gmjax.transform.buckets import LEARNER_DIM, from_wire, gather_wire, to_wire

AxisName = Any


def travels_as_f32(specs: Sequence[ParameterSpec], wire: Wire) -> bool:
  """Whether every delta of ``specs`` crosses the axis as dense F32 (then: a ``psum``)."""
  return not wire.sparse and all(wire.code(s.dtype) == "F32" for s in specs)


def _as_bytes(entries: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Entries as unsigned integers of their width (F32 stays F32)."""
  out = {}
  for name, value in entries.items():
    width = value.dtype.itemsize
    if value.dtype == jnp.float32 or jnp.issubdtype(value.dtype, jnp.integer):
      out[name] = value
    else:
      out[name] = lax.bitcast_convert_type(value, jnp.uint8 if width == 1 else jnp.uint16)
  return out


def _from_bytes(entries, like) -> dict[str, jax.Array]:
  return {n: v if v.dtype == like[n].dtype else lax.bitcast_convert_type(v, like[n].dtype)
          for n, v in entries.items()}


def _squared_norm(arrays: Any) -> jax.Array:
  values = arrays.values() if isinstance(arrays, Mapping) else arrays
  return explicit.total(jnp.sum(jnp.square(v)) for v in values)


def _unit(arrays: Sequence[jax.Array]) -> tuple[list[jax.Array], jax.Array]:
  """``arrays / ‖arrays‖`` (zero for zeros) and whether any is nonzero (F32 0/1)."""
  norm = jnp.sqrt(_squared_norm(arrays))
  nonzero = norm > 0
  scale = jnp.where(nonzero, 1.0 / jnp.where(nonzero, norm, 1.0), 0.0)
  return [v * scale for v in arrays], nonzero.astype(jnp.float32)


def mean_cosine(unit_sum: Any, nonzero: jax.Array) -> jax.Array:
  """Mean pairwise cosine of ``K`` unit vectors from their sum: ``(‖Σ d‖² − K)/(K(K−1))``.

  Zero deltas contribute nothing to the sum and are not counted in ``K``, so pairs with a
  zero delta are skipped as in ``gmjax.cosine``. NaN when ``K < 2``.
  """
  k = nonzero
  value = (_squared_norm(unit_sum) - k) / jnp.where(k > 1, k * (k - 1), 1.0)
  return jnp.where(k > 1, jnp.clip(value, -1.0, 1.0), jnp.nan).astype(jnp.float32)


def aggregate(
    buckets: Any,
    packed: Sequence[jax.Array],
    tokens: jax.Array,
    axis_name: AxisName,
    rule: robust.Rule = robust.Rule(),
) -> tuple[list[jax.Array], jax.Array, screen.Verdict, list[jax.Array]]:
  """The outer gradient ``g = Σ_m w_m · decode(Δ_m)`` across ``axis_name`` of a fragment's
  dense buckets (or ``rule``'s robust aggregate), and the cosine. The deltas are screened
  first (``gmjax.transform.screen``), as in the sharded exchange.

  F32 deltas are summed by one ``psum`` unless the rule needs every learner's value of
  each coordinate (``"trimmed_mean"``): they are then all-gathered as the other
  precisions are.

  Args:
    buckets: how the fragment's pieces lie in ``packed`` (``gmjax.transform.buckets``),
      with each bucket's wire code.
    packed: this learner's F32 delta rows, bucketed: ``(F, S, 1, 32)`` each.
    tokens: tokens this learner trained since its last delta of the fragment, an int32
      pair (see ``gmjax.transform.tokens``).
    axis_name: the learners' mapped axis, or None for a single learner.
    rule: how the kept deltas are combined (``DiLoCo.rule``).

  Returns:
    ``(g, cosine, verdict, sent)``: ``g`` in F32 ``(F, S, 32)`` per bucket (identical on
    every learner), the mean pairwise cosine of the kept decoded deltas (NaN with fewer
    than two nonzero ones), the screening's verdict, and this learner's own delta
    decoded from the very entries it sends, laid out as ``packed``.
  """
  # Codes and 16-bit values as unsigned integers of their width (``buckets.to_wire``),
  # so every learner decodes these bytes.
  wires = [to_wire(p[:, :, 0], code) for p, code in zip(packed, buckets.codes)]
  decoded = [from_wire(w, code) for w, code in zip(wires, buckets.codes)]
  sent = [d[:, :, None] for d in decoded]
  if axis_name is None:
    squared, bad = screen.squares_and_non_finite(decoded)
    verdict = screen.verdict(squared[None], bad[None], tokens[None], rule)
    # Unmasked (any rule's aggregate of one delta is the delta): a lone learner's delta is rejected only when it is not finite, and then
    # so is ``g``, and the round is skipped (``round.outer_round``); masking would copy
    # the delta.
    return decoded, jnp.float32(jnp.nan), verdict, sent
  if all(code == "F32" for code in buckets.codes) and not rule.needs_values:
    every = lax.all_gather(jnp.stack(screen.squares_and_non_finite(decoded)), axis_name)
    every = explicit.pin(every, (None,) * every.ndim)
    all_tokens = lax.all_gather(tokens, axis_name)
    all_tokens = explicit.pin(all_tokens, (None,) * all_tokens.ndim)
    verdict = screen.verdict(every[:, 0], every[:, 1], all_tokens, rule)
    me = lax.axis_index(axis_name)
    kept = screen.masked(decoded, verdict.keep[me])
    unit, nonzero = _unit(kept)
    weighted = [verdict.applied.weights[me] * v for v in kept]
    gradient, unit_sum, count = explicit.psum((weighted, unit, nonzero), axis_name)
    return gradient, mean_cosine(unit_sum, count), verdict, sent
  learners = lax.axis_size(axis_name)
  deltas = [from_wire(gather_wire(wire, axis_name, learners), code)
            for wire, code in zip(wires, buckets.codes)]
  every = lax.all_gather(tokens, axis_name)
  all_tokens = explicit.pin(every, (None,) * every.ndim)
  others = (0, 1, 3)
  squares = explicit.total(jnp.sum(jnp.square(d), axis=others) for d in deltas)
  bad = explicit.total(round_ops.non_finite_flag(d, others) for d in deltas)
  verdict = screen.verdict(squares, bad, all_tokens, rule)
  norms = jnp.sqrt(jnp.where(verdict.keep, squares, 0.0))
  nonzero = norms > 0
  scales = jnp.where(nonzero, 1.0 / jnp.where(nonzero, norms, 1.0), 0.0)
  gradient = [rule.combine(d, verdict.applied, verdict.keep, LEARNER_DIM) for d in deltas]
  unit_sum = [round_ops.weighted_sum(d, scales, LEARNER_DIM, keep=verdict.keep)
              for d in deltas]
  count = jnp.sum(nonzero).astype(jnp.float32)
  return gradient, mean_cosine(unit_sum, count), verdict, sent


def aggregate_sparse(
    delta: Mapping[str, jax.Array],
    tokens: jax.Array,
    specs: Sequence[ParameterSpec],
    wire: Wire,
    axis_name: AxisName,
    rule: robust.Rule = robust.Rule(),
) -> tuple[dict[str, jax.Array], jax.Array, screen.Verdict, dict[str, jax.Array]]:
  """``aggregate`` for sparse (top-k) deltas, whose entries are chosen leaf by leaf.

  Args:
    delta: this learner's F32 delta ``anchor − θ`` of one fragment, by leaf name, each
      flattened to 1-D (an FSDP split of the leading dimension stays on it).
    tokens: as for ``aggregate``.
    specs: the fragment's parameter specs, sorted by name, with the flat shapes.
    wire: how deltas travel (``DiLoCo.delta_wire``, sparse).
    axis_name: the learners' mapped axis, or None for a single learner.
    rule: how the kept deltas are combined (``DiLoCo.rule``).

  Returns:
    ``(g, cosine, verdict, sent)`` as ``aggregate``'s, by leaf name and flat.
  """
  dtypes = {s.name: s.dtype for s in specs}
  entries, _ = wire.encode_values(dict(delta), dtypes)
  decode_values = lambda e: wire.decode_values(e, specs)
  # The entries cross as their bits (``_as_bytes``), so every learner decodes these.
  decoded = decode_values(entries)
  if axis_name is None:
    squared, bad = screen.squares_and_non_finite(decoded)
    verdict = screen.verdict(squared[None], bad[None], tokens[None], rule)
    return decoded, jnp.float32(jnp.nan), verdict, decoded
  # Flat entries gather along a new last dimension: an FSDP split of their only
  # dimension stays where it lies (gathered in front, JAX's type would move it to the
  # learners' dimension). Under vmap's spmd_axis_name the learners' dimension comes out
  # split over the learners' axis, and every learner needs all of it.
  crossing = _as_bytes(entries)
  gathered = {n: explicit.pin(g, None if explicit.spec(crossing[n]) is None
                              else (*explicit.spec(crossing[n]), None))
              for n, g in zip(crossing, collectives.all_gather(
                  list(crossing.values()), axis_name, lax.axis_size(axis_name)))}
  every = lax.all_gather(tokens, axis_name)
  all_tokens = explicit.pin(every, (None,) * every.ndim)
  gathered = _from_bytes(gathered, entries)
  # Every learner's delta at once, the learners the leading dimension of each leaf.
  deltas = jax.vmap(decode_values, in_axes=-1)(gathered)
  squares = explicit.total(jnp.sum(jnp.square(d), axis=1) for d in deltas.values())
  bad = explicit.total(round_ops.non_finite_flag(d, 1) for d in deltas.values())
  verdict = screen.verdict(squares, bad, all_tokens, rule)
  norms = jnp.sqrt(jnp.where(verdict.keep, squares, 0.0))
  nonzero = norms > 0
  scales = jnp.where(nonzero, 1.0 / jnp.where(nonzero, norms, 1.0), 0.0)
  gradient = {n: rule.combine(d, verdict.applied, verdict.keep) for n, d in deltas.items()}
  unit_sum = {n: round_ops.weighted_sum(d, scales, keep=verdict.keep)
              for n, d in deltas.items()}
  count = jnp.sum(nonzero).astype(jnp.float32)
  return gradient, mean_cosine(unit_sum, count), verdict, decoded
