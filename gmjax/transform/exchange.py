"""The sharded exchange of one round: deltas ``all_to_all`` by shard, Θ ``all_gather``-ed.

With ``M`` learners on the axis, learner ``k`` owns shard ``k`` of every leaf (see
``shards``). A round of a fragment of ``n`` elements moves, per learner:

1. ``all_to_all`` of the encoded delta rows: learner ``k`` receives every learner's
   encoding of shard ``k`` and sends away the other ``M − 1`` shards of its own,
   ``(M−1)/M · b_delta · n`` bytes. Codes and 16-bit values cross as unsigned integers
   of their width (``uint8``, ``uint16``): XLA's CPU backend widens float8 and bf16
   collectives to a wider float, which would multiply the bytes. F32 deltas cross as
   F32 the same way: an ``all_to_all`` sends exactly what a ring ``psum_scatter`` sends,
   and keeps every learner's delta apart, so the sum runs in learner order (the mail
   closer's arithmetic) and the Gram matrix of the deltas is exact.
2. One ``psum`` of ``M² + M`` F32 values: the shard's partial Gram matrix of the decoded
   deltas and each delta's count of non-finite values, from which every learner alike
   screens the deltas (``gmjax.transform.screen``: non-finite or outlier norms rejected,
   outlying token counts clamped); then ``g = Σ_m w_m · decode(Δ_m)`` over the shard in
   learner order (``weighted_sum``, rejected deltas as zeros), the outer step on the
   shard.
3. ``all_gather`` of the new Θ shards at the parameter dtype, or of the update at
   ``commit_precision``, which every learner decodes and adds to its Θ with the same
   function: ``(M−1)/M · b_publish · n`` bytes.
4. One ``psum`` of 2 F32 values: the squared norm of ``g`` on the shard, and the count of
   non-finite values (gradient, master, Θ), which decides for every learner alike whether
   the round is kept.

Sparse (top-k) deltas (``gmjax.core.sparse``) replace step 1: every learner's top-k set
is its own, so each learner encodes its whole delta and the entries (kept values' codes
and scales, indices, as unsigned integers) are ``all_gather``-ed, ``(M−1)·d·(b_delta +
b_index)·n`` bytes per learner for a density ``d = k / chunk`` plus the scales; every
learner decodes them all and keeps the rows of its own shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmjax.core import robust
from gmjax.core import round as round_ops
from gmjax.core.codec import JNP_DTYPES
from gmjax.core.schema import ParameterSpec
from gmjax.core.wire import Wire
from gmjax.transform import collectives, explicit, screen, shards
from gmjax.transform.buckets import (LEARNER_DIM, Buckets, from_wire, gather_wire,
                                     gathered_spec, joined, split, to_wire)
from gmjax.transform.replicated import _as_bytes, _from_bytes

def receive(
    buckets: Buckets,
    packed: Sequence[jax.Array],
    axis_name: Any,
) -> tuple[list[jax.Array], list[jax.Array]]:
  """Every learner's decoded delta of this learner's shard, bucket by bucket.

  Args:
    buckets: where the fragment's leaves lie in ``packed``, and each bucket's wire code.
    packed: this learner's F32 delta rows, bucketed: ``(F, S, M, 32)`` each.
    axis_name: the learners' axis.

  Returns:
    ``(deltas, sent)``, bucket by bucket: ``(F, S, M, 32)`` F32, learner ``m``'s decoded
    delta of this learner's shard at index ``m`` of dimension 2; and the decode of the
    very wire arrays this learner sends, laid out as ``packed`` (error feedback keeps
    what they did not carry).
  """
  deltas, sent = [], []
  for code, rows in zip(buckets.codes, packed):
    wire = to_wire(rows, code)
    sent.append(from_wire(wire, code))
    crossing = joined(wire)
    # Under vmap's spmd_axis_name the exchanged dimension comes out split over the
    # learners' axis; each learner needs every learner's encoding of its shard.
    received, = collectives.all_to_all([crossing], axis_name, LEARNER_DIM)
    received = explicit.pin(received, explicit.spec(crossing))
    deltas.append(from_wire(split(received, wire), code))
  return deltas, sent


def receive_sparse(
    delta: Mapping[str, jax.Array],
    specs: Sequence[ParameterSpec],
    wire: Wire,
    axis_name: Any,
    learners: int,
    learner: jax.Array,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """Every learner's decoded sparse delta of this learner's shard, leaf by leaf.

  Args:
    delta: this learner's F32 delta of each leaf of the fragment (any shape).
    specs: the fragment's specs.
    wire: how deltas travel (``DiLoCo.delta_wire``, sparse).
    axis_name: the learners' axis.
    learners: ``M``.
    learner: this learner's index on the axis.

  Returns:
    ``(deltas, sent)``: by leaf name, F32 rows ``(R, M, 32)`` of this learner's shard,
    learner ``m``'s decoded delta at index ``m`` of dimension 1; and this learner's own
    delta decoded from the entries it sends, by leaf name in the leaf's shape.
  """
  flat = [ParameterSpec(s.name, s.dtype, (s.size,)) for s in specs]
  # A leaf split over other axes (FSDP) keeps its row-major pieces where they lie when
  # each encodes on its own (whole chunks whose kept values fill whole codec blocks);
  # the entries then come out split alike, and every learner's decode of them too.
  entries, _ = wire.encode_values(
      {s.name: explicit.flatten(delta[s.name], wire.whole_run) for s in specs},
      {s.name: s.dtype for s in specs})
  crossing = _as_bytes(entries)
  gathered = {n: explicit.pin(g, gathered_spec(crossing[n])) for n, g in zip(
      crossing, collectives.all_gather(list(crossing.values()), axis_name, learners))}
  gathered = _from_bytes(gathered, entries)
  # Every learner's delta decoded at once (the learners' dimension mapped), then cut
  # into this learner's shard, laid out as the leaf so that its rows come in the order
  # of its master's.
  values = jax.vmap(lambda e: wire.decode_values(e, flat), in_axes=1)(gathered)
  decoded = {s.name: [] for s in specs}
  for m in range(learners):
    for s in specs:
      value = explicit.unflatten(values[s.name][m], delta[s.name])
      decoded[s.name].append(shards.own(shards.to_rows(value, learners), learner))
  mine = wire.decode_values(entries, flat)
  return ({n: jnp.stack(v, axis=1) for n, v in decoded.items()},
          {s.name: explicit.unflatten(mine[s.name], delta[s.name]) for s in specs})


def judge_and_sum(deltas: Sequence[jax.Array], counts: jax.Array, axis_name: Any,
                  rule: robust.Rule = robust.Rule()
                  ) -> tuple[list[jax.Array], screen.Verdict, jax.Array]:
  """Screens the received deltas and combines the kept ones by ``rule``, bucket by bucket.

  Each learner holds every learner's value of each coordinate of its shard, so a rule
  that needs them all (``"trimmed_mean"``) sorts them where they are: the exchange
  moves the same bytes whatever the rule.

  Args:
    deltas: every learner's decoded delta of this learner's shard, ``(F, S, M, 32)``
      each (``receive``).
    counts: this learner's token count pair.
    axis_name: the learners' axis.
    rule: how the kept deltas are combined (``DiLoCo.rule``).

  Returns:
    ``(gradient, verdict, matrix)``: ``g`` of this learner's shard ``(F, S, 32)`` per
    bucket, the screening's verdict (identical on every learner), and the ``M × M``
    Gram matrix of the deltas over the whole fragment.
  """
  learners = deltas[0].shape[LEARNER_DIM]
  every = lax.all_gather(counts, axis_name)
  every = explicit.pin(every, (None,) * every.ndim)
  parts = [round_ops.gram(deltas, LEARNER_DIM, batch=0).reshape(-1),
           round_ops.non_finite(deltas, LEARNER_DIM)]
  if explicit.spec(parts[0]) is not None:
    # On an explicit mesh under vmap, with one learner the Gram matrix's reshape drops the
    # learners' axis from the batch dimension (its size is 1): laid out alike again.
    parts = [explicit.pin(part, (None,) * part.ndim) for part in parts]
  partial = jnp.concatenate(parts)
  summed = explicit.psum(partial, axis_name)
  size = learners * learners
  matrix = summed[:size].reshape(learners, learners)
  squares = _diagonal(matrix)
  verdict = screen.verdict(squares, summed[size:], every, rule)
  gradient = [rule.combine(d, verdict.applied, verdict.keep, LEARNER_DIM) for d in deltas]
  return gradient, verdict, matrix


def publish(
    buckets: Buckets,
    master: Sequence[jax.Array],
    anchor: Mapping[str, jax.Array],
    specs: Sequence[ParameterSpec],
    commit_wire: Wire,
    axis_name: Any,
    learners: int | None,
    learner: Any,
    gather: bool = True,
    updates: Sequence[jax.Array] | None = None,
) -> tuple[dict[str, jax.Array], jax.Array]:
  """The new Θ of every piece from the new master buckets, and a finiteness count.

  With ``commit_wire.precision=None`` each bucket of ``cast(master)`` is published;
  otherwise ``encode(master − Θ_old)`` is, and every learner forms
  ``Θ = cast(Θ_old + decode(update))`` from the same bytes, as ``outer.rebuild`` does.
  Sharded (``learners`` = ``M``), each learner holds its part of every bucket and the
  parts are gathered: one ``all_gather`` a bucket (``buckets.gather_wire``); replicated
  (None), every learner publishes the whole buckets itself.

  Args:
    buckets: how the fragment's pieces lie in the buckets.
    master: the new F32 master buckets, this learner's part ``(F, S, 32)`` each.
    anchor: the current Θ of each piece, in its shape.
    specs: the fragment's specs.
    commit_wire: how commits travel (``DiLoCo.commit_wire``).
    axis_name: the learners' axis (sharded).
    learners: ``M`` when sharded, else None.
    learner: this learner's index on the axis when sharded.
    gather: False: only what this learner publishes, to be checked (no collective).
    updates: the outer updates, a bucket each (``master`` is ``old + updates``);
      replicated with F32 commits, Θ of a bucket whose master is Θ itself (F32, no
      master kept) is then formed piece by piece as ``Θ_old + update``, the same
      values, so that XLA writes the new Θ where the old lies (unpacked from the
      master bucket, each piece would be a copy in the step's scratch).

  Returns:
    ``(theta, bad)``: Θ by piece at the parameter dtype, and 1 for each published
    bucket part of this learner holding a NaN or Inf (F32); without ``gather``,
    ``({}, parts)``: this learner's published part of each bucket, as it decodes (with a
    commit precision, the part of Θ it rebuilds).
  """
  count = learners or 1
  own = (lambda b: b[:, :, 0]) if learners is None else (
      lambda b: shards.own(b, learner, LEARNER_DIM))
  if commit_wire.precision is not None:
    names = [s.name for s in specs]
    old = [own(b) for b in buckets.pack({n: shards.to_rows(anchor[n], count)
                                         for n in names})]
    where = 0 if learners is None else learner
    valid = buckets.pack({s.name: shards.valid(s.shape, count, where) for s in specs})
  bad, gathered = jnp.float32(0), []
  for index, value in enumerate(master):
    dtype = buckets.dtypes[index]
    if commit_wire.precision is None:
      code = dtype
    else:
      code = commit_wire.precision
      value = explicit.where(valid[index], value - old[index], jnp.float32(0))
    wire = to_wire(value, code)
    mine = from_wire(wire, code)
    if commit_wire.precision is None:
      mine = mine.astype(JNP_DTYPES[dtype])
      checked = mine
    else:
      # Θ as every learner rebuilds it is what must be finite, not only the update:
      # Θ_old + a finite update can overflow the parameters' dtype (F16 past 65504).
      checked = (old[index] + mine).astype(JNP_DTYPES[dtype])
    if not gather:
      gathered.append(checked)
      continue
    bad = bad + round_ops.non_finite_flag(checked)
    if learners is None:
      gathered.append(from_wire(wire, code)[:, :, None])
      continue
    gathered.append(from_wire(gather_wire(wire, axis_name, learners), code))
  if not gather:
    return {}, gathered
  theta, rows = {}, buckets.unpack(gathered)
  if updates is not None and learners is None and commit_wire.precision is None:
    # A bucket whose master is Θ itself (F32: no master kept) holds Θ_old + update:
    # formed piece by piece, the same values are written where Θ_old lies (unpacked
    # from the bucket, each piece would be a copy).
    plain = [d == "F32" for d in buckets.dtypes]
    each = buckets.unpack([u[:, :, None] if p else g
                           for u, g, p in zip(updates, gathered, plain)])
    in_place = {n for group, p in zip(buckets.groups, plain) if p for n in group}
  else:
    in_place = set()
  for spec in specs:
    dtype = JNP_DTYPES[spec.dtype]
    if spec.name in in_place:
      theta[spec.name] = (anchor[spec.name].astype(jnp.float32) + shards.from_rows(
          each[spec.name], spec.shape, anchor[spec.name])).astype(dtype)
      continue
    value = shards.from_rows(rows[spec.name], spec.shape, anchor[spec.name])
    if commit_wire.precision is None:
      theta[spec.name] = value.astype(dtype)
    else:
      theta[spec.name] = (anchor[spec.name].astype(jnp.float32) + value).astype(dtype)
  return theta, bad


def _diagonal(matrix: jax.Array) -> jax.Array:
  """The diagonal of a square matrix as a masked sum: ``jnp.diagonal`` is a gather, which
  XLA may partition over the other mesh axes."""
  return jnp.sum(jnp.where(np.eye(matrix.shape[0], dtype=bool), matrix, 0.0), axis=1)


def mean_cosine(matrix: jax.Array) -> jax.Array:
  """Mean pairwise cosine from a Gram matrix, skipping zero deltas; NaN without a pair."""
  learners = matrix.shape[0]
  diagonal = _diagonal(matrix)
  norms = jnp.sqrt(jnp.maximum(diagonal, 0.0))
  nonzero = norms > 0
  upper = jnp.triu(jnp.ones((learners, learners), bool), k=1)
  pairs = upper & nonzero[:, None] & nonzero[None, :]
  safe = jnp.where(nonzero, norms, 1.0)
  cosines = matrix / (safe[:, None] * safe[None, :])
  count = jnp.sum(pairs)
  value = jnp.sum(jnp.where(pairs, cosines, 0.0)) / jnp.maximum(count, 1)
  return jnp.where(count > 0, jnp.clip(value, -1.0, 1.0), jnp.nan).astype(jnp.float32)
