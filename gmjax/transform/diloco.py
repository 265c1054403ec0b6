"""``gmjax.diloco``: DiLoCo and Streaming DiLoCo inside the mesh, as an optax transformation.

Learners are the members of a named mapped axis (``vmap``, ``shard_map``, ``pmap``). Each
runs the inner optimizer every step; on the steps the schedule names, the fragment's
delta ``anchor − θ`` crosses the axis, every learner applies the same outer step to the
replicated F32 master and momentum, and merges the new Θ ``overlap_steps`` later.

References:
  Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language
  Models*, arXiv 2311.08105.
  Douillard et al., *Streaming DiLoCo with overlapping communication: Towards a
  Distributed Free Lunch*, arXiv 2501.18512.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gmjax.core import outer
from gmjax.core.codec import JNP_DTYPES
from gmjax.core.diloco import DiLoCo
from gmjax.core.schedule import RoundSchedule
from gmjax.core.schema import Schema
from gmjax.transform import collective
from gmjax.transform.state import (
    MERGE,
    NOTHING,
    RESET,
    DiLoCoState,
    DiLoCoStatistics,
    initial_statistics,
)


def _vary_like(new: Any, old: Any) -> Any:
  """``new`` typed as varying over every manual axis ``old`` varies over.

  Under ``shard_map`` a collective's result is invariant across the axis, while the
  state it replaces varies; ``lax.cond`` branches must agree on that type.
  """

  def one(n, o):
    missing = tuple(sorted(_varying(o) - _varying(n), key=str))
    return lax.pcast(n, missing, to="varying") if missing else n

  return jax.tree.map(one, new, old)


def _varying(x: Any) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def _sync_table(schedule: RoundSchedule) -> np.ndarray:
  """``table[t mod H]``: 1 + the fragment that syncs at global step ``t``, or 0."""
  table = np.zeros(schedule.sync_every, np.int32)
  for step in range(1, schedule.sync_every + 1):
    r = schedule.round_at(step)
    if r is not None:
      table[step % schedule.sync_every] = schedule.fragment_of(r) + 1
  return table


class _Layout:
  """What a parameter tree's structure fixes: schema, fragments, schedule, masters."""

  def __init__(self, config: DiLoCo, params: Any):
    self.schema = Schema.from_tree(params)
    self.plan = config.plan(self.schema)
    self.schedule = config.schedule(len(self.plan))
    self.table = _sync_table(self.schedule)
    self.keep = {s.name: config.keeps_master(s.dtype) for s in self.schema}
    self.names = self.schema.leaf_names

  def flatten(self, tree: Any) -> dict[str, Any]:
    return dict(zip(self.names, self.schema.treedef.flatten_up_to(tree)))

  def unflatten(self, flat: dict[str, Any]) -> Any:
    return self.schema.treedef.unflatten([flat[n] for n in self.names])

  def master_of(self, theta: Any) -> Any:
    """The F32 master of Θ where one is kept, ``optax.MaskedNode`` elsewhere."""
    flat = self.flatten(theta)
    return self.unflatten({
        n: jnp.array(v, jnp.float32, copy=True) if self.keep[n] else optax.MaskedNode()
        for n, v in flat.items()
    })

  def cast(self, tree: Any) -> Any:
    """A copy of ``tree`` at the schema dtypes (float64 input becomes F32).

    A copy, so that the state never shares a buffer with the parameters (both can be
    donated to a jitted step).
    """
    flat = self.flatten(tree)
    return self.unflatten(
        {n: jnp.array(v, JNP_DTYPES[self.schema[n].dtype], copy=True) for n, v in flat.items()}
    )


def _check(inner: Any, config: Any, axis_name: Any) -> None:
  if not isinstance(config, DiLoCo):
    raise TypeError(
        f"gmjax.diloco: config must be a gmjax.DiLoCo, got {type(config).__name__};"
        " build one with gmjax.DiLoCo(sync_every=...)."
    )
  if config.overlap_steps is None:
    raise ValueError(
        "gmjax.diloco: config.overlap_steps=None bounds waiting by in_flight, which only the"
        " mail runtime does; in-mesh training needs an int in [0, sync_every), e.g."
        " dataclasses.replace(config, overlap_steps=0)."
    )
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
        f"gmjax.diloco: inner must be an optax GradientTransformation, got {inner!r}; pass"
        " e.g. optax.adamw(1e-3)."
    )
  if isinstance(axis_name, (list, set, dict)):
    raise TypeError(
        f"gmjax.diloco: axis_name must be None, an axis name or a tuple of them, got"
        f" {axis_name!r}."
    )


def diloco(
    inner: optax.GradientTransformation,
    config: DiLoCo,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """DiLoCo / Streaming DiLoCo around an inner optimizer, across a named mapped axis.

  Every call runs ``inner``; the global step ``t`` (``state.count``) drives the schedule
  ``config.schedule(len(config.plan(Schema.from_tree(params))))``. With ``M`` learners
  on ``axis_name``:

  1. First update: the inner step runs on each learner's own parameters (where its
     gradients were taken) and is then applied to learner 0's parameters, which every
     learner adopts (one broadcast) and which become the anchor Θ and the F32 master.
  2. Each update: ``θ ← θ + inner_update``; tokens (1 per step when not given) are
     counted per fragment.
  3. At ``t = step_of(r)``, for fragment ``f = r mod P``: ``Δ_m = anchor_f − θ_m,f`` at
     ``delta_precision``; ``g = Σ_m w_m · decode(Δ_m)`` with
     ``w_m = tokens_m / Σ tokens``; ``u ← μ·u + g``; Nesterov:
     ``master ← master − η·(g + μ·u)`` (plain: ``master ← master − η·u``); Θ is
     published from the master (``commit_precision``: Θ rebuilt from the encoded
     update). If ``g`` is not finite, the outer step is skipped, the anchor kept, and
     ``stats.skipped`` counts it.
  4. At ``t = step_of(r) + τ`` (``τ = overlap_steps``; ``τ = 0``: the same step), the
     merge: ``θ_m,f ← mixing·θ_m,f + (1 − mixing)·Θ_f``, where ``θ_m,f`` is the learner's
     current fragment, trained ``τ`` steps past its delta (so with ``mixing = 0`` those
     ``τ`` steps of the fragment are replaced by Θ, as in Streaming DiLoCo); after a
     skipped round the fragment is reset to its anchor instead.

  The outer work sits under ``lax.cond``/``lax.switch``: under ``shard_map``/``pmap`` the
  other steps skip it; under ``vmap`` a batched ``count`` turns it into a select.
  Between merges the returned updates are exactly the inner optimizer's; on a merge
  they are ``θ_new − params`` at the updates' dtype, so with 16-bit parameters
  ``params + updates`` matches Θ up to one rounding, which the next delta absorbs.
  Updates are additive, so the reset after a skipped round repairs finite parameters
  only: a learner whose parameters already hold NaN/Inf should take ``state.anchor``.

  Bytes each learner sends per sync, for ``n`` parameters of the fragment (ring
  collectives): F32 deltas use one ``psum`` of the weighted deltas and their unit
  vectors (for the cosine), ``≈ 2·2(M−1)/M·4n``; F16/BF16 all-gather ``(M−1)·2n``;
  F8_E4M3 all-gathers codes and scales, ``(M−1)·(1 + 4/32)n``; F4/I4
  ``(M−1)·(0.5 + 4/32)n``. The first update broadcasts the parameters once.

  Args:
    inner: the inner optimizer (any optax ``GradientTransformation``).
    config: a ``gmjax.DiLoCo``; ``overlap_steps`` must be an int.
    axis_name: the learners' mapped axis name (or tuple of names); None is one learner.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state, params,
    *, tokens=None, **extra_args)`` needs ``params`` and passes ``extra_args`` to
    ``inner``. Its state is a ``DiLoCoState``; log ``state.stats``.

  Raises:
    ValueError: ``config.overlap_steps`` is None; ``update`` without params, or with
      non-scalar tokens.
    TypeError: ``config`` is not a ``gmjax.DiLoCo``, or ``inner`` not a transformation.

  References:
    Douillard et al., arXiv 2311.08105; Douillard et al., arXiv 2501.18512.
  """
  _check(inner, config, axis_name)
  inner = optax.with_extra_args_support(inner)
  tau = config.overlap_steps
  sync_every = config.sync_every

  def init_fn(params):
    layout = _Layout(config, params)
    anchor = layout.cast(params)
    return DiLoCoState(
        inner_state=inner.init(params),
        count=jnp.zeros([], jnp.int32),
        anchor=anchor,
        master=layout.master_of(anchor),
        momentum=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), anchor),
        pending=jnp.zeros([len(layout.plan)], jnp.int32),
        tokens=jnp.zeros([len(layout.plan)], jnp.float32),
        stats=initial_statistics(),
    )

  def update_fn(updates, state, params=None, *, tokens=None, **extra_args):
    if params is None:
      raise ValueError(
          "gmjax.diloco: update needs params (the deltas are anchor − params); call"
          " update(grads, state, params)."
      )
    layout = _Layout(config, params)
    if tokens is None:
      step_tokens = jnp.float32(1)
    else:
      step_tokens = jnp.asarray(tokens, jnp.float32)
      if step_tokens.shape:
        raise ValueError(
            f"gmjax.diloco: tokens must be one number per learner and step, got shape"
            f" {step_tokens.shape}; pass e.g. the number of tokens in this learner's batch."
        )
    first = state.count == 0
    # The inner step takes each learner's own parameters, where its gradients were
    # taken; on the first step the result is moved onto learner 0's start (in ``rare``),
    # so the common step carries no alignment at all.
    inner_updates, inner_state = inner.update(
        updates, state.inner_state, params, **extra_args
    )
    t = optax.safe_int32_increment(state.count)
    table = jnp.asarray(layout.table)
    sync_index = table[t % sync_every]
    merge_index = jnp.where(t > tau, table[(t - tau) % sync_every], 0)
    outer_state = (state.anchor, state.master, state.momentum, state.pending,
                   state.tokens + step_tokens, state.stats)

    def common(inner_updates, params, outer_state):
      del params
      return inner_updates, outer_state

    def rare(inner_updates, params, outer_state):
      outer_state_in = outer_state
      anchor, master, *rest = outer_state
      if axis_name is None:
        start = params
        anchor, master = lax.cond(
            first, _start(layout, None), lambda p, a, m: (a, m), params, anchor, master
        )
      else:
        start, anchor, master = lax.cond(
            first, _start(layout, axis_name), lambda p, a, m: (p, a, m),
            params, anchor, master,
        )
      new_updates, outer_state = _round(
          layout, config, axis_name, (start, params, inner_updates),
          (anchor, master, *rest), first, sync_index, merge_index,
      )
      return _vary_like((new_updates, outer_state), (inner_updates, outer_state_in))

    rare_step = first | (sync_index > 0) | (merge_index > 0)
    new_updates, outer_state = lax.cond(
        rare_step, rare, common, inner_updates, params, outer_state
    )
    anchor, master, momentum, pending, token_counts, stats = outer_state
    return new_updates, DiLoCoState(
        inner_state=inner_state, count=t, anchor=anchor, master=master,
        momentum=momentum, pending=pending, tokens=token_counts, stats=stats,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _start(layout: _Layout, axis_name: Any):
  """The first update: learner 0's parameters everywhere, as anchor and master.

  With ``axis_name=None`` the learner's own parameters are the start, and only the
  anchor and the master are returned.
  """

  def start(params, anchor, master):
    if axis_name is None:
      theta = layout.cast(params)
      return theta, layout.master_of(theta)
    source = lax.axis_index(axis_name) == 0
    # A masked sum is a broadcast from learner 0 that is exact in any dtype.
    shared = jax.tree.map(
        lambda p: lax.psum(jnp.where(source, p, jnp.zeros_like(p)), axis_name), params
    )
    theta = layout.cast(shared)
    return _vary_like((shared, theta, layout.master_of(theta)), (params, anchor, master))

  return start


def _round(layout, config, axis_name, inputs, outer_state, first, sync_index, merge_index):
  """The sync of the fragment ``sync_index − 1`` and the merge of ``merge_index − 1``.

  ``inputs`` is ``(start, params, inner_updates)``; the learner's ``θ = start +
  inner_updates`` is formed leaf by leaf inside each branch, from buffers that exist
  already, so no branch operand is a new parameter-sized array. Returns the updates and
  the new outer state.
  """
  anchor, master, momentum, pending, tokens, stats = outer_state
  flat_start, flat_params, flat_updates = (layout.flatten(x) for x in inputs)
  flat = (layout.flatten(anchor), layout.flatten(master), layout.flatten(momentum))

  def theta_of(n):
    """``θ`` of leaf ``n``, at the parameter dtype, as ``optax.apply_updates`` forms it."""
    start = flat_start[n]
    return (start + flat_updates[n]).astype(start.dtype)

  def no_sync(flat, pending, tokens, stats):
    return flat, pending, tokens, stats

  def sync_of(fragment, names):
    specs = layout.schema.subset(names).parameters

    def sync(flat, pending, tokens, stats):
      state = (pending, tokens, stats)
      anchor, master, momentum = (dict(x) for x in flat)
      delta = {
          n: anchor[n].astype(jnp.float32) - theta_of(n).astype(jnp.float32) for n in names
      }
      gradient, cosine = collective.aggregate(
          delta, tokens[fragment], specs, config.delta_precision, axis_name
      )
      old_master = {
          n: master[n] if layout.keep[n] else anchor[n].astype(jnp.float32) for n in names
      }
      new_master, new_momentum = outer.outer_step(
          gradient, {n: momentum[n] for n in names}, old_master,
          learning_rate=float(config.outer_learning_rate),
          momentum_coef=float(config.outer_momentum),
          nesterov=config.nesterov,
      )
      new_theta, _ = outer.publish(
          new_master, {n: anchor[n] for n in names}, specs, config.commit_precision
      )
      finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in gradient.values()]))
      for n in names:
        anchor[n] = jnp.where(finite, new_theta[n], anchor[n])
        momentum[n] = jnp.where(finite, new_momentum[n], momentum[n])
        if layout.keep[n]:
          master[n] = jnp.where(finite, new_master[n], master[n])
      squared = sum(jnp.sum(jnp.square(g)) for g in gradient.values())
      stats = DiLoCoStatistics(
          rounds=stats.rounds + 1,
          skipped=stats.skipped + (~finite).astype(jnp.int32),
          fragment=jnp.int32(fragment),
          delta_norm=jnp.sqrt(squared).astype(jnp.float32),
          cosine=cosine,
      )
      pending = pending.at[fragment].set(jnp.where(finite, MERGE, RESET))
      tokens = tokens.at[fragment].set(0.0)
      return _vary_like(
          ((anchor, master, momentum), pending, tokens, stats), (flat, *state)
      )

    return sync

  branches = [no_sync] + [sync_of(f, names) for f, names in enumerate(layout.plan)]
  flat, pending, tokens, stats = lax.switch(sync_index, branches, flat, pending, tokens, stats)
  flat_anchor = flat[0]

  def difference(n, theta):
    """The update that takes the parameters to ``theta``, at the updates' dtype."""
    u = flat_updates[n]
    return (theta.astype(jnp.float32) - flat_params[n].astype(jnp.float32)).astype(u.dtype)

  def no_merge(flat_anchor, pending):
    if axis_name is None:
      return dict(flat_updates), pending
    # The first update moves every learner onto learner 0's start.
    updates = {
        n: jnp.where(first, difference(n, theta_of(n)), u) for n, u in flat_updates.items()
    }
    return _vary_like((updates, pending), (flat_updates, pending))

  def merge_of(fragment, names):
    def merge(flat_anchor, pending):
      code = pending[fragment]
      current = {n: theta_of(n) for n in names}
      target = {n: flat_anchor[n] for n in names}
      mixed = outer.align(current, target, config.mixing)
      reset = outer.align(current, target, 0.0)
      updates = {}
      for n in layout.names:
        theta = theta_of(n)
        if n in current:
          theta = jnp.where(
              code == MERGE, mixed[n], jnp.where(code == RESET, reset[n], current[n])
          )
        updates[n] = difference(n, theta)
      return _vary_like(
          (updates, pending.at[fragment].set(NOTHING)), (flat_updates, pending)
      )

    return merge

  branches = [no_merge] + [merge_of(f, names) for f, names in enumerate(layout.plan)]
  flat_updates_out, pending = lax.switch(merge_index, branches, flat_anchor, pending)
  anchor, master, momentum = (layout.unflatten(x) for x in flat)
  return layout.unflatten(flat_updates_out), (anchor, master, momentum, pending, tokens, stats)
