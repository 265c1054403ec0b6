"""The rare steps of ``gmjax.diloco``: the first update, a fragment's sync, its merge.

Everything here runs under ``lax.cond``/``lax.switch`` in the step, so the common step
pays nothing for it (under ``vmap`` too: the step count it branches on is unbatched).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gmjax.core import eager, feedback, outer
from gmjax.core import round as round_ops
from gmjax.core.codec import BLOCK
from gmjax.transform import exchange, explicit, replicated, screen, shards
from gmjax.transform.buckets import Buckets
from gmjax.transform.structure import Layout
from gmjax.transform.state import (MERGE, NOTHING, RESET, DelayState, DiLoCoStatistics,
                                   RoundState)


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
      # A masked sum is a broadcast from learner 0 that is exact in any dtype.
      shared = jax.tree.map(
          lambda p: explicit.psum(jnp.where(source, p, jnp.zeros_like(p)), axis_name), params
      )
    theta = layout.cast(shared)
    flat = layout.flatten(theta)
    values = {n: layout.master_value(n, v, learner)
              for n, v in layout.view(flat).items()}
    master = layout.master_tree(
        {n: v if layout.keep[n] else optax.MaskedNode() for n, v in values.items()})
    new = state._replace(anchor=theta, master=master,
                         outer_state=layout.outer_init(tx, values))
    if layout.delay:
      new = new._replace(delay=new.delay._replace(start=layout.unflatten(
          {n: explicit.like(v.astype(jnp.float32), v) for n, v in flat.items()})))
    return vary_like((shared, new), (params, state))

  return run


def _kept_residual(new: dict[str, jax.Array], old: dict[str, jax.Array]) -> dict:
  """The new residuals of a fragment, or zeros if any is not finite (nothing was sent)."""
  ok = round_ops.count_non_finite(new.values(), explicit.total) == 0
  return {n: explicit.where(ok, v, jnp.zeros_like(old[n])) for n, v in new.items()}


def _own(weights: jax.Array, index: Any) -> jax.Array:
  """``weights[index]`` as a masked sum (an index batched over learners is a gather)."""
  if index is None:
    return weights[0]
  return jnp.sum(jnp.where(jnp.arange(weights.shape[0]) == index, weights, 0.0))


def _sync_replicated(layout, config, tx, axis_name, fragment, names, anchor, master,
                     outer_state, counts, theta_of, residual, base):
  # The codec runs on flat leaves, whose row-major pieces stay where an FSDP split of
  # the leading dimension put them (the codec's own reshapes to the leaf's shape would
  # not, on an explicit mesh).
  specs = [dataclasses.replace(s, shape=(s.size,))
           for s in layout.schema.subset(names).parameters]
  flat = lambda x: explicit.flatten(x, BLOCK)
  delta = {n: flat(base[n].astype(jnp.float32) - theta_of(n).astype(jnp.float32))
           for n in names}
  if layout.beta is not None:
    delta = feedback.compensated({n: flat(residual[n]) for n in names}, delta, layout.beta)
  gradient, cosine, verdict, sent = replicated.aggregate(
      delta, counts, specs, config.delta_wire, axis_name)
  if layout.beta is not None:
    residual = _kept_residual(
        {n: explicit.unflatten(delta[n] - sent[n], anchor[n]) for n in names}, residual)
  gradient = {n: explicit.unflatten(gradient[n], anchor[n]) for n in names}
  old = {n: master[n] if layout.keep[n] else anchor[n].astype(jnp.float32) for n in names}

  def publish(new_master):
    # The codec runs on the flat leaves (see above).
    theta, _ = outer.publish({n: flat(new_master[n]) for n in names},
                             {n: flat(anchor[n]) for n in names}, specs, config.commit_wire)
    theta = {n: explicit.unflatten(theta[n], anchor[n]) for n in names}
    return theta, round_ops.count_non_finite(theta.values(), explicit.total)

  result = round_ops.outer_round(tx, gradient, outer_state, old, anchor, specs,
                                 config.commit_wire, publish=publish, total=explicit.total,
                                 as_tuple=True, any_kept=jnp.any(verdict.keep))
  theta, new_master, new_state, bad = result.theta, result.master, result.state, result.bad
  squared = explicit.total(jnp.sum(jnp.square(g)) for g in gradient.values())
  own = (None if not layout.eager else
         ({n: explicit.unflatten(sent[n], anchor[n]) for n in names},
          _own(verdict.weights, None if axis_name is None else lax.axis_index(axis_name))))
  return theta, new_master, new_state, squared, bad == 0, cosine, verdict, residual, own


def _sync_sharded(layout, config, tx, axis_name, learner, fragment, names, anchor,
                  master, outer_state, counts, theta_of, residual, base):
  learners = layout.learners
  specs = layout.schema.subset(names).parameters
  delta = {n: base[n].astype(jnp.float32) - theta_of(n).astype(jnp.float32)
           for n in names}
  if layout.beta is not None:
    delta = feedback.compensated({n: residual[n] for n in names}, delta, layout.beta)
  every = lax.all_gather(counts, axis_name)
  every = explicit.pin(every, (None,) * every.ndim)
  # The fragment's leaves cross, are screened and summed as buckets: one program per
  # bucket whatever the number of leaves, the learners an array dimension.
  wire = config.delta_wire
  if not wire.sparse:
    rows = {n: shards.to_rows(delta[n], learners) for n in names}
    codes = {s.name: wire.code(s.dtype) for s in specs}
    buckets = Buckets(rows, codes, axis_name)
    deltas, sent = exchange.receive(buckets, buckets.pack(rows), axis_name)
    sent = buckets.unpack(sent)
    left = {s.name: shards.from_rows(rows[s.name] - sent[s.name], s.shape, delta[s.name])
            for s in specs}
    sent = {s.name: explicit.like(shards.from_rows(sent[s.name], s.shape, delta[s.name]),
                                  delta[s.name]) for s in specs}
  else:
    received, sent = exchange.receive_sparse(delta, specs, wire,
                                             axis_name, learners, learner)
    left = {n: delta[n] - sent[n] for n in names}
    buckets = Buckets(received, dict.fromkeys(names, "F32"), axis_name)
    deltas = buckets.pack(received)
  if layout.beta is not None:
    residual = _kept_residual(
        {n: explicit.like(v, residual[n]) for n, v in left.items()}, residual)
  dim = exchange.LEARNER_DIM
  partial = jnp.concatenate([
      round_ops.gram(deltas, dim, batch=0).reshape(-1),
      round_ops.non_finite(deltas, dim)])
  summed = explicit.psum(partial, axis_name)
  size = learners * learners
  matrix = summed[:size].reshape(learners, learners)
  # The diagonal as a masked sum: ``jnp.diagonal`` is a gather, which XLA may partition
  # over the other mesh axes.
  squares = jnp.sum(jnp.where(np.eye(learners, dtype=bool), matrix, 0.0), axis=1)
  verdict = screen.judge(squares, summed[size:], every)
  gradient = buckets.unpack([
      round_ops.weighted_sum(d, verdict.weights, dim, keep=verdict.keep) for d in deltas])
  old = {n: master[n] if layout.keep[n] else layout.master_value(n, anchor[n], learner)
         for n in names}
  publish = lambda new_master: exchange.publish(
      new_master, {n: anchor[n] for n in names}, specs, config.commit_wire, axis_name,
      learners, learner)
  # A round none of whose deltas was kept has no outer step: counted with the non-finite
  # values, so that whether the round is kept comes out of the psum, and XLA does not
  # copy the screening into each leaf's selects.
  result = round_ops.outer_round(tx, gradient, outer_state, old, anchor, specs,
                                 config.commit_wire, publish=publish, total=explicit.total,
                                 as_tuple=True, any_kept=jnp.any(verdict.keep))
  theta, new_master, new_state, bad = result.theta, result.master, result.state, result.bad
  squared = explicit.total(jnp.sum(jnp.square(g)) for g in gradient.values())
  summed = explicit.psum(jnp.stack([squared, bad]), axis_name)
  squared, bad = summed[0], summed[1]
  both = verdict.keep[:, None] & verdict.keep[None, :]
  cosine = exchange.mean_cosine(jnp.where(both, matrix, 0.0))
  own = None if not layout.eager else (sent, _own(verdict.weights, learner))
  return theta, new_master, new_state, squared, bad == 0, cosine, verdict, residual, own


def run_round(layout, config, tx, axis_name, learner, inputs, state: RoundState, first,
              sync_index, merge_index):
  """The sync of the fragment ``sync_index − 1`` and the merge of ``merge_index − 1``.

  ``inputs`` is ``(start, params, inner_updates)``; the learner's ``θ = start +
  inner_updates`` is formed leaf by leaf inside each branch, from buffers that exist
  already, so no branch operand is a new parameter-sized array. Returns the updates and
  the new ``RoundState``.
  """
  flat_start, flat_params, flat_updates = (layout.flatten(x) for x in inputs)
  # Without error feedback there is no residual ({}: nothing crosses the branches).
  delay = state.delay
  flat_of = lambda tree, on: layout.flatten(tree) if on else {}
  flat = (layout.flatten(state.anchor), layout.master_pieces(state.master),
          flat_of(state.residual, layout.beta is not None),
          flat_of(getattr(delay, "start", None), layout.delay),
          flat_of(getattr(delay, "correction", None), layout.eager),
          flat_of(getattr(delay, "previous", None), layout.eager))
  rest = (state.outer_state, state.pending, state.tokens, state.stats,
          delay.weight if layout.eager else (), delay.outer if layout.eager else ())

  def theta_of(n):
    """``θ`` of leaf ``n``, at the parameter dtype, as ``optax.apply_updates`` forms it."""
    s = flat_start[n]
    return (s + flat_updates[n]).astype(s.dtype)

  def piece_theta(n):
    """``θ`` of piece ``n``, formed from the pieces of start and updates."""
    piece = layout.pieces[n]
    s = piece.take(flat_start[piece.leaf])
    return (s + piece.take(flat_updates[piece.leaf])).astype(s.dtype)

  def no_sync(flat, rest):
    return flat, rest

  def sync_of(fragment, names):
    def sync(flat, rest):
      outer_states, pending, counts, stats, weights, own_states = rest
      whole = tuple(dict(x) for x in flat)
      master = whole[1]
      # The fragment's pieces of the state shaped like the parameters (with layer
      # blocks, slices of whole leaves; written back below).
      anchor, residual, start, correction, previous = (
          layout.view(x, names) if x else {} for x in (whole[0], *whole[2:]))
      common = (fragment, names, anchor, master, outer_states[fragment], counts[fragment],
                piece_theta, residual, start if layout.delay else anchor)
      if layout.learners is None:
        result = _sync_replicated(layout, config, tx, axis_name, *common)
      else:
        result = _sync_sharded(layout, config, tx, axis_name, learner, *common)
      theta, new_master, new_state, squared, finite, cosine, verdict, left, own = result
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
        ok = eager.finite(sent)
        first_weight = 1.0 / (1 if axis_name is None else int(lax.psum(1, axis_name)))
        old_weight = jnp.where(weights[fragment] < 0, first_weight, weights[fragment])
        # A delta that could not travel counts as none (its learner's weight is 0).
        mine = {n: explicit.where(ok, explicit.like(sent[n], previous[n]),
                                  jnp.zeros_like(previous[n])) for n in names}
        d = eager.proxy(mine, previous, old_weight)
        new_correction, new_own = eager.correct(tx, d, own_states[fragment], correction,
                                                names)
        for n in names:
          correction[n] = explicit.like(new_correction[n], correction[n])
          previous[n] = mine[n]
          start[n] = start[n] + correction[n]
        weights = weights.at[fragment].set(jnp.where(finite, weight, 0.0))
        own_states = tuple(new_own if f == fragment else x
                           for f, x in enumerate(own_states))
      # The round's results, or the state before it (one choice: ``explicit.choose``).
      kept_names = [n for n in names if layout.keep[n]]
      old = ({n: anchor[n] for n in names}, {n: master[n] for n in kept_names},
             outer_states[fragment])
      new = vary_like(({n: theta[n] for n in names},
                       {n: new_master[n] for n in names if layout.keep[n]},
                       new_state), old)
      chosen_anchor, chosen_master, kept = explicit.choose(finite, new, old)
      anchor.update(chosen_anchor)
      master.update(chosen_master)
      outer_states = tuple(kept if f == fragment else s for f, s in enumerate(outer_states))
      stats = DiLoCoStatistics(
          rounds=stats.rounds + 1,
          skipped=stats.skipped + (~finite).astype(jnp.int32),
          fragment=jnp.int32(fragment),
          delta_norm=jnp.sqrt(squared).astype(jnp.float32),
          cosine=cosine,
          rejected=verdict.rejected,
          clamped=verdict.clamped,
      )
      pending = pending.at[fragment].set(jnp.where(finite, MERGE, RESET))
      counts = counts.at[fragment].set(jnp.zeros([2], jnp.int32))
      for out, values in zip((whole[0], *whole[2:]),
                             (anchor, residual, start, correction, previous)):
        layout.write(out, values)
      return vary_like((whole,
                        (outer_states, pending, counts, stats, weights, own_states)),
                       (flat, rest))

    return sync

  branches = [no_sync] + [sync_of(f, names) for f, names in enumerate(layout.plan)]
  flat, rest = lax.switch(sync_index, branches, flat, rest)
  outer_states, pending, counts, stats, weights, own_states = rest
  # With a delay a merge adopts the learner's new start, not the new Θ.
  flat_anchor = flat[3] if layout.delay else flat[0]

  def difference(n, theta):
    """The update that takes the parameters to ``theta``, at the updates' dtype."""
    u = flat_updates[n]
    return (theta.astype(jnp.float32) - flat_params[n].astype(jnp.float32)).astype(u.dtype)

  def no_merge(flat_anchor, pending):
    if axis_name is None:
      return dict(flat_updates), pending
    # The first update moves every learner onto learner 0's start.
    updates = {
        n: explicit.where(first, difference(n, theta_of(n)), u)
        for n, u in flat_updates.items()
    }
    return vary_like((updates, pending), (flat_updates, pending))

  def merge_of(fragment, names):
    def merge(flat_anchor, pending):
      code = pending[fragment]
      current = {n: piece_theta(n) for n in names}
      target = layout.view(flat_anchor, names)
      mixed = outer.align(current, target, config.mixing)
      reset = outer.align(current, target, 0.0)
      thetas = {n: theta_of(n) for n in layout.names}
      layout.write(thetas, {
          n: explicit.where(code == MERGE, mixed[n],
                            explicit.where(code == RESET, reset[n], current[n]))
          for n in names})
      updates = {n: difference(n, theta) for n, theta in thetas.items()}
      return vary_like(
          (updates, pending.at[fragment].set(NOTHING)), (flat_updates, pending)
      )

    return merge

  branches = [no_merge] + [merge_of(f, names) for f, names in enumerate(layout.plan)]
  flat_updates_out, pending = lax.switch(merge_index, branches, flat_anchor, pending)
  anchor, master = layout.unflatten(flat[0]), layout.master_tree(flat[1])
  residual = state.residual if layout.beta is None else layout.unflatten(flat[2])
  if layout.delay:
    delay = DelayState(layout.unflatten(flat[3]))
    if layout.eager:
      delay = delay._replace(correction=layout.unflatten(flat[4]),
                             previous=layout.unflatten(flat[5]), weight=weights,
                             outer=own_states)
  return layout.unflatten(flat_updates_out), RoundState(
      anchor, master, outer_states, pending, counts, stats, residual, delay)
