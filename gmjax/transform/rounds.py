"""The rare steps of ``gmjax.diloco``: the first update, a fragment's sync, its merge.

Each part runs under ``gmjax.transform.control.when`` on a predicate of the step count,
so the common step pays nothing for it (under ``vmap`` too: the step count is
unbatched), and a part writes the state it changes where it lies, passing the rest
through without a copy.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gmjax.core import eager, feedback, outer
from gmjax.core import round as round_ops
from gmjax.core.schema import ParameterSpec
from gmjax.transform import control, exchange, explicit, merge, replicated, shards
from gmjax.transform import tokens as token_counts
from gmjax.transform.structure import Layout
from gmjax.transform.state import MERGE, NOTHING, RESET, DelayState, RoundState


def vary_like(new: Any, old: Any) -> Any:
  """``new`` typed as varying over every manual axis ``old`` varies over.

  Under ``shard_map`` a collective's result is invariant across the axis, while the
  state it replaces varies; ``lax.cond`` branches must agree on that type.
  """

  def one(n, o):
    missing = tuple(sorted(_varying(o) - _varying(n), key=str))
    n = lax.pcast(n, missing, to="varying") if missing else n
    # Under explicit sharding the branches must also agree on each value's sharding.
    old, new = (getattr(jax.typeof(v), "sharding", None) for v in (o, n))
    if (old is not None and new is not None and getattr(old, "spec", None) is not None
        and old.spec != new.spec and any(
            t == jax.sharding.AxisType.Explicit for t in old.mesh.axis_types)):
      n = jax.sharding.reshard(n, old.spec)
    return n

  return jax.tree.map(one, new, old)


def _varying(x: Any) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def start(layout: Layout, tx, axis_name: Any, learner: Any):
  """The first update: learner 0's parameters everywhere, as anchor, master, outer state.

  Returns a function ``(params, round_state) -> (start, round_state)``; with
  ``axis_name=None`` the learner's own parameters are the start.
  """

  def run(params, state):
    if axis_name is None:
      shared = params
    else:
      source = lax.axis_index(axis_name) == 0
      shared = jax.tree.map(lambda p: _from_learner_0(p, source, axis_name), params)
    theta = layout.cast(shared)
    flat = layout.flatten(theta)
    pieces = layout.view(flat)
    masters, states = [], []
    for names in layout.plan:
      buckets, values = layout.theta_buckets({n: pieces[n] for n in names}, learner)
      masters.append(layout.masters(buckets, values))
      states.append(layout.outer_tx(tx, buckets, {n: pieces[n] for n in names}).init(
          tuple(values)))
    new = state._replace(anchor=theta, master=tuple(masters), outer_state=tuple(states))
    if layout.delay:
      new = new._replace(delay=new.delay._replace(start=layout.unflatten(
          {n: explicit.like(v.astype(jnp.float32), v) for n, v in flat.items()})))
    return vary_like((shared, new), (params, state))

  return run


def _from_learner_0(x: jax.Array, source: jax.Array, axis_name: Any) -> jax.Array:
  """Learner 0's ``x`` on every learner: a masked sum of its bits, widened to at least
  32 of them.

  Summed as bits, the broadcast is exact for every value (a sum of floats would turn
  learner 0's ``-0.0`` into ``+0.0``); widened, it is no 16-bit all-reduce, which XLA's
  CPU backend promotes to 32 bits and, under a partially manual ``shard_map``, aborts
  on (``Invalid binary instruction opcode copy``).
  """
  width = jnp.dtype(x.dtype).itemsize
  bits = jnp.dtype(f"uint{8 * width}")
  wide = lax.bitcast_convert_type(x, bits).astype(jnp.promote_types(bits, jnp.uint32))
  summed = explicit.psum(jnp.where(source, wide, jnp.zeros_like(wide)), axis_name)
  return lax.bitcast_convert_type(summed.astype(bits), x.dtype)


def _kept_residual(new: dict[str, jax.Array], old: dict[str, jax.Array],
                   withheld: jax.Array) -> dict:
  """The new residuals of a fragment, or zeros if any is not finite (nothing was sent)
  or the delta was ``withheld`` (as if it were not finite: ``gmjax.transform.finite``)."""
  ok = (round_ops.count_non_finite(new.values(), explicit.total) == 0) & ~withheld
  return {n: explicit.where(ok, v, jnp.zeros_like(old[n])) for n, v in new.items()}


def _own(weights: jax.Array, index: Any) -> jax.Array:
  """``weights[index]`` as a masked sum (an index batched over learners is a gather)."""
  if index is None:
    return weights[0]
  return jnp.sum(jnp.where(jnp.arange(weights.shape[0]) == index, weights, 0.0))


def _exchange(layout, config, axis_name, learner, names, delta, rows, buckets, counts):
  """The fragment's outer gradient, bucket by bucket, from every learner's delta.

  Returns ``(gradient, verdict, cosine, sent)``: ``g`` as this learner's part
  ``(F, S, 32)`` of each bucket, the screening's verdict, the mean pairwise cosine, and
  this learner's own delta as its wire carries it, by piece in the piece's shape.
  """
  specs = layout.schema.subset(names).parameters
  wire = config.delta_wire

  def unrows(packed):
    """Each piece, in its shape and layout, from buckets of rows ``(F, S, M, 32)``."""
    rows_of = buckets.unpack(packed)
    return {s.name: shards.from_rows(rows_of[s.name], s.shape, delta[s.name]) for s in specs}

  if layout.learners is None:
    if not wire.sparse:
      gradient, cosine, verdict, sent = replicated.aggregate(
          buckets, buckets.pack(rows), counts, axis_name, config.rule)
      return gradient, verdict, cosine, unrows(sent)
    # The sparse codec chooses its entries on flat leaves, whose row-major pieces stay
    # where an FSDP split of the leading dimension put them when they encode on their
    # own (whole chunks whose kept values fill whole codec blocks).
    flat = {s.name: dataclasses.replace(s, shape=(s.size,)) for s in specs}
    gradient, cosine, verdict, sent = replicated.aggregate_sparse(
        {n: explicit.flatten(delta[n], wire.whole_run) for n in names}, counts,
        list(flat.values()), wire, axis_name, config.rule)
    gradient = layout.rows({n: explicit.unflatten(g, delta[n]) for n, g in gradient.items()})
    return ([layout.own(b, None) for b in buckets.pack(gradient)], verdict, cosine,
            {n: explicit.unflatten(v, delta[n]) for n, v in sent.items()})
  if not wire.sparse:
    deltas, sent = exchange.receive(buckets, buckets.pack(rows), axis_name)
    sent = {n: explicit.like(v, delta[n]) for n, v in unrows(sent).items()}
  else:
    received, sent = exchange.receive_sparse(delta, specs, wire, axis_name, layout.learners,
                                             learner)
    deltas = buckets.pack(received)
  gradient, verdict, matrix = exchange.judge_and_sum(deltas, counts, axis_name,
                                                     config.rule)
  both = verdict.keep[:, None] & verdict.keep[None, :]
  return gradient, verdict, exchange.mean_cosine(jnp.where(both, matrix, 0.0)), sent


def _sync(layout, config, tx, axis_name, learner, names, anchor, master, outer_state,
          counts, theta_of, residual, base):
  """One fragment's round on its buckets: exchange, outer step, publish, skip rule."""
  specs = layout.schema.subset(names).parameters
  delta = {n: base[n].astype(jnp.float32) - theta_of(n).astype(jnp.float32)
           for n in names}
  if layout.beta is not None:
    delta = feedback.compensated({n: residual[n] for n in names}, delta, layout.beta)
  rows = layout.rows(delta)
  buckets = layout.buckets(rows)
  gradient, verdict, cosine, sent = _exchange(layout, config, axis_name, learner, names,
                                              delta, rows, buckets, counts)
  if layout.beta is not None:
    residual = _kept_residual(
        {n: explicit.like(delta[n] - sent[n], residual[n]) for n in names}, residual,
        token_counts.withheld(counts))
  # Buckets whose pieces keep no master (F32 Θ published as itself) start from Θ.
  keeps = layout.keeps(buckets)
  bucket_specs = [ParameterSpec(str(i), "F32", g.shape) for i, g in enumerate(gradient)]
  keys = [s.name for s in bucket_specs]
  outer_tx = layout.outer_tx(tx, buckets, anchor)

  def outer_step(anchor, master, outer_state, gather, count=round_ops.count_non_finite):
    """The round's outer step from the fragment's state (``gmjax.core.round``)."""
    if not all(keeps):
      current = [layout.own(b, learner) for b in buckets.pack(layout.rows(anchor))]
    old = [m if keep else current[i] for i, (m, keep) in enumerate(zip(master, keeps))]
    publish = lambda new_master, updates: exchange.publish(
        buckets, [new_master[k] for k in keys], anchor, specs, config.commit_wire,
        axis_name, layout.learners, learner, gather=gather,
        updates=[updates[k] for k in keys])
    # A round none of whose deltas was kept has no outer step: counted with the
    # non-finite values, so that whether the round is kept comes out of the (closing)
    # psum, and XLA does not copy the screening into each bucket's selects.
    return round_ops.outer_round(
        outer_tx, dict(zip(keys, gradient)), outer_state, dict(zip(keys, old)), {},
        bucket_specs, config.commit_wire, publish=publish, total=explicit.total,
        as_tuple=True, any_kept=jnp.any(verdict.keep), count=count)

  def commit(anchor, master, outer_state):
    """The fragment's new ``(Θ, master, outer state)``, written where the old lie."""
    result = outer_step(anchor, master, outer_state, gather=True)
    new_master = [result.master[k] for k in keys]
    return ({n: result.theta[n] for n in anchor}, layout.masters(buckets, new_master),
            result.state)

  # The skip rule needs the round's health before anything is written: a first pass
  # that only counts (its values feed reductions, and no Θ is gathered), then
  # ``commit`` in place if the round is kept (``run_round``). Two passes of the outer
  # step on a sync, instead of a second copy of the fragment's state on every step.
  bad = outer_step(anchor, master, outer_state, gather=False,
                   count=round_ops.count_non_finite_fused).bad
  squared = explicit.total(jnp.sum(jnp.square(g)) for g in gradient)
  if layout.learners is not None:
    squared, bad = explicit.psum(jnp.stack([squared, bad]), axis_name)
  own = None if not layout.eager else (
      sent, _own(verdict.weights, None if axis_name is None else lax.axis_index(axis_name)))
  return commit, squared, bad == 0, cosine, verdict, residual, own


def run_round(layout, config, tx, axis_name, learner, inputs, state: RoundState, first,
              sync_index, merge_index, dropped=False, anyone_dropped=None):
  """The first update, the sync of the fragment ``sync_index − 1`` and the merge of
  ``merge_index − 1``.

  ``inputs`` is ``(params, inner_updates)``; the learner's ``θ = params +
  inner_updates`` is formed leaf by leaf where it is read, from buffers that exist
  already. Where ``dropped`` (a bool scalar: ``gmjax.transform.finite``), the inner
  updates count as zeros. Every part is a ``gmjax.transform.control.when`` on the state,
  which it changes in place. Returns the updates and the new ``RoundState``.
  """
  flat_params, flat_updates = (layout.flatten(x) for x in inputs)
  # ``dropped`` is each learner's own (batched under ``vmap``): a select, on the steps
  # where any learner's is dropped.
  flat_updates = control.when(
      dropped if anyone_dropped is None else anyone_dropped,
      lambda u: vary_like({n: explicit.where(dropped, jnp.zeros_like(v), v)
                           for n, v in u.items()}, u), flat_updates)

  def begin(x, params):
    """Learner 0's parameters as anchor, master and outer state; with learners, the
    first update moves every learner onto them (``θ = learner 0's params + update``)."""
    state, updates = x
    # The parameters are read inside the loop (``reads``), so that XLA does not hoist
    # their broadcast (a collective) out of the loop into every step.
    shared, state = start(layout, tx, axis_name, learner)(params, state)
    if axis_name is not None:
      shared, own = layout.flatten(shared), layout.flatten(params)
      updates = {n: merge.difference((shared[n] + u).astype(shared[n].dtype), own[n], u)
                 for n, u in updates.items()}
    return vary_like((state, updates), x)

  state, flat_updates = control.when(first, begin, (state, flat_updates), reads=inputs[0])
  # Without error feedback there is no residual ({}: nothing crosses the branches).
  delay = state.delay
  flat_of = lambda tree, on: layout.flatten(tree) if on else {}
  flat = (layout.flatten(state.anchor),
          flat_of(state.residual, layout.beta is not None),
          flat_of(getattr(delay, "start", None), layout.delay),
          flat_of(getattr(delay, "correction", None), layout.eager),
          flat_of(getattr(delay, "previous", None), layout.eager))
  rest = (state.master, state.outer_state, state.pending, state.tokens, state.stats,
          delay.weight if layout.eager else (), delay.outer if layout.eager else ())

  piece_theta = functools.partial(merge.piece_theta, layout)

  # The loops read the parameters (and the merge the anchor) as ``reads``, so that XLA
  # forms θ and the F32 conversions where they are read, not as whole buffers hoisted
  # out of the loops.
  def sync_of(fragment, names):
    def sync(flat, rest, updates, params):
      masters, outer_states, pending, counts, stats, weights, own_states = rest
      whole = tuple(dict(x) for x in flat)
      # The fragment's pieces of the state shaped like the parameters (with layer
      # blocks, slices of whole leaves; written back below).
      anchor, residual, start, correction, previous = (
          layout.view(x, names) if x else {} for x in whole)
      result = _sync(layout, config, tx, axis_name, learner, names, anchor,
                     masters[fragment], outer_states[fragment], counts[fragment],
                     lambda n: piece_theta(n, updates, params), residual,
                     start if layout.delay else anchor)
      commit, squared, finite, cosine, verdict, left, own = result
      # The residual is what this learner's wire did not carry, whatever the round's
      # outcome: a learner does not learn it (the mail runtime's learners cannot).
      residual.update(left)
      if layout.delay:
        # The next phase starts at the Θ before this round (gmjax.core.eager) ...
        for n in names:
          start[n] = explicit.like(anchor[n].astype(jnp.float32), start[n])
      if layout.eager:
        # ... plus this learner's correction for its fresh delta.
        sent, weight = own
        ok = eager.finite(sent) & ~token_counts.withheld(counts[fragment])
        first_weight = 1.0 / (1 if axis_name is None else int(lax.psum(1, axis_name)))
        old_weight = jnp.where(weights[fragment] < 0, first_weight, weights[fragment])
        # A delta that could not travel, or was withheld, counts as none (its learner's
        # weight is 0).
        mine = {n: explicit.where(ok, explicit.like(sent[n], previous[n]),
                                  jnp.zeros_like(previous[n])) for n in names}
        d = eager.proxy(mine, previous, old_weight)
        new_correction, new_own = eager.correct(tx, d, own_states[fragment], correction,
                                                names)
        # A correction that would make the start non-finite is dropped (gmjax.core.eager).
        new_correction, new_own = eager.restart(
            tx, eager.start_finite({n: anchor[n] for n in names}, new_correction),
            new_correction, new_own, names,
            where=lambda keep, kept, dropped: explicit.where(~keep, dropped, kept))
        for n in names:
          correction[n] = explicit.like(new_correction[n], correction[n])
          previous[n] = mine[n]
          start[n] = start[n] + correction[n]
        weights = weights.at[fragment].set(jnp.where(finite, weight, 0.0))
        own_states = tuple(new_own if f == fragment else x
                           for f, x in enumerate(own_states))
      # The round's results where the state lies, or the state before it.
      old = ({n: anchor[n] for n in names}, masters[fragment], outer_states[fragment])
      if any(explicit.spec(x) is not None for x in jax.tree.leaves(old)):
        # On an explicit mesh ``finite`` is batched under ``vmap``: a select.
        chosen_anchor, chosen_master, kept = explicit.choose(
            finite, vary_like(commit(*old), old), old)
      else:
        chosen_anchor, chosen_master, kept = control.when(
            finite, lambda x: vary_like(commit(*x), x), old)
      anchor.update(chosen_anchor)
      masters = tuple(chosen_master if f == fragment else m for f, m in enumerate(masters))
      outer_states = tuple(kept if f == fragment else s for f, s in enumerate(outer_states))
      stats = stats._replace(
          rounds=stats.rounds + 1,
          skipped=stats.skipped + (~finite).astype(jnp.int32),
          fragment=jnp.int32(fragment),
          delta_norm=jnp.sqrt(squared).astype(jnp.float32),
          cosine=cosine,
          rejected=verdict.rejected,
          clamped=verdict.clamped,
          clipped=verdict.applied.clipped,
          capped=verdict.applied.capped,
          trimmed=verdict.applied.trimmed,
      )
      pending = pending.at[fragment].set(jnp.where(finite, MERGE, RESET))
      counts = counts.at[fragment].set(jnp.zeros([2], jnp.int32))
      for out, values in zip(whole, (anchor, residual, start, correction, previous)):
        layout.write(out, values)
      return vary_like((whole,
                        (masters, outer_states, pending, counts, stats, weights, own_states),
                        updates), (flat, rest, updates))

    return sync

  def merges(flat_updates, pending, flat, index):
    """The merge of each fragment ``index − 1`` names (or whose sync this is, where a
    merge is left pending: a state saved between a sync and its merge, continued under
    another ``sync_every`` or ``overlap_steps``), and the pending codes after them."""
    # With a delay a merge adopts the learner's new start, not the new Θ.
    flat_anchor = flat[2] if layout.delay else flat[0]
    for fragment, names in enumerate(layout.plan):
      merge_ = merge.merge_of(layout, config, names, pending[fragment])
      flat_updates = control.when(
          (index == fragment + 1) | (sync_index == fragment + 1),
          lambda u, reads, merge_=merge_: vary_like(merge_(u, reads), u), flat_updates,
          reads=(flat_params, flat_anchor))
    done = jnp.arange(pending.shape[0])
    done = (done == index - 1) | (done == sync_index - 1)
    return flat_updates, jnp.where(done, NOTHING, pending).astype(pending.dtype)

  # A fragment's merge comes before its next sync (the learners adopt Θ before they
  # send the next delta against it): with overlap_steps > 0 at its own step, and at the
  # sync where a changed schedule left it pending; with 0, at the sync that made it.
  masters, outer_states, pending, counts, stats, weights, own_states = rest
  flat_updates, pending = merges(flat_updates, pending, flat,
                                 merge_index if config.overlap_steps > 0 else 0)
  rest = (masters, outer_states, pending, counts, stats, weights, own_states)
  for fragment, names in enumerate(layout.plan):
    sync = sync_of(fragment, names)
    flat, rest, flat_updates = control.when(
        sync_index == fragment + 1, lambda x, params, sync=sync: sync(*x, params),
        (flat, rest, flat_updates), reads=flat_params)
  masters, outer_states, pending, counts, stats, weights, own_states = rest
  if config.overlap_steps == 0:
    flat_updates, pending = merges(flat_updates, pending, flat, merge_index)
  return _finish(layout, state, flat, flat_updates, masters, outer_states, pending, counts,
                 stats, weights, own_states)


def _finish(layout, state, flat, flat_updates, masters, outer_states, pending, counts, stats,
            weights, own_states):
  """``run_round``'s results from the round's flat values."""
  anchor = layout.unflatten(flat[0])
  residual = state.residual if layout.beta is None else layout.unflatten(flat[1])
  delay = state.delay
  if layout.delay:
    delay = DelayState(layout.unflatten(flat[2]))
    if layout.eager:
      delay = delay._replace(correction=layout.unflatten(flat[3]),
                             previous=layout.unflatten(flat[4]), weight=weights,
                             outer=own_states)
  return layout.unflatten(flat_updates), RoundState(
      anchor, masters, outer_states, pending, counts, stats, residual, delay)
