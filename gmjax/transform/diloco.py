"""``gmjax.diloco``: DiLoCo and Streaming DiLoCo inside the mesh, as an optax transformation.

Learners are the members of a named mapped axis (``vmap``, ``shard_map``, ``pmap``). Each
runs the inner optimizer every step; on the steps the schedule names, the fragment's
delta ``anchor − θ`` crosses the axis, the outer optimizer runs on the F32 master (each
learner on its own shard, or every learner on all of it), and the new Θ is merged
``overlap_steps`` later.

References:
  Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language
  Models*, arXiv 2311.08105.
  Douillard et al., *Streaming DiLoCo with overlapping communication: Towards a
  Distributed Free Lunch*, arXiv 2501.18512.
"""

from __future__ import annotations

import difflib
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gmjax.core.diloco import DiLoCo
from gmjax.transform import between, checks, elementwise, explicit, finite, rounds
from gmjax.transform import finish as finish_lib
from gmjax.transform import structure
from gmjax.transform import tokens as token_counts
from gmjax.transform.state import DiLoCoState, RoundState, initial_statistics


def _unbatched(count: jax.Array, dropped: jax.Array,
               axis_name: Any) -> tuple[jax.Array, jax.Array]:
  """The step count, and whether a learner's step is dropped, as values ``lax.cond``
  can branch on without a select.

  Under ``shard_map`` and ``pmap`` the learners' axis is a manual mesh axis and each
  learner's count is a plain scalar. Under ``vmap`` it is batched, and a batched
  predicate turns every ``lax.cond`` into a select that computes the rare steps on every
  step (and, on an explicit mesh, cannot select between FSDP-sharded values). Every
  learner holds the same count, so its maximum over the axis is the count, unbatched,
  and the maximum of the learners' ``dropped`` says whether any step is dropped: one
  all-reduce of two scalars a step keeps the rare work rare.
  """
  if axis_name is None or explicit.manual(axis_name):
    return count, dropped
  both = explicit.pmax(jnp.stack([count, dropped.astype(jnp.int32)]), axis_name)
  return both[0], both[1] > 0


def diloco(
    inner: optax.GradientTransformation,
    config: DiLoCo,
    *,
    outer: optax.GradientTransformation | None = None,
    axis_name: Any = None,
    shard_outer: bool | None = None,
    drop_non_finite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """DiLoCo / Streaming DiLoCo around an inner optimizer, across a named mapped axis.

  Every call runs ``inner``; the global step ``t`` (``state.count``) drives the schedule
  ``config.schedule(len(config.plan(Schema.from_tree(params))))``. With ``M`` learners
  on ``axis_name``:

  1. First update: the inner step runs on each learner's own parameters (where its
     gradients were taken) and is then applied to learner 0's parameters, which every
     learner adopts (one broadcast) and which become the anchor Θ and the F32 master.
  2. Each update: ``θ ← θ + inner_update``; tokens (1 per step when not given; exact
     past 2^24) are counted per fragment. A count must be a non-negative whole number,
     as the mail runtime's ``Learner.step`` requires: a static one that is not raises a
     ``ValueError``; a traced one is clamped (negative or non-finite to 0, fractional
     down) and the step counted in ``stats.bad_tokens``.
  3. At ``t = step_of(r)``, for fragment ``f = r mod P``: ``Δ_m = anchor_f − θ_m,f`` at
     ``delta_precision``; ``g = Σ_m w_m · decode(Δ_m)`` in F32, in learner order, with
     ``w_m = tokens_m / Σ tokens``; the outer step ``master ← master +
     outer.update(g, state, master)`` (default: Nesterov SGD, ``u ← μ·u + g``,
     ``master ← master − η·(g + μ·u)``); Θ is published from the master
     (``commit_precision``: Θ rebuilt from the encoded update). If ``g``, the new master
     or the new Θ is not finite, the outer step is dropped, the anchor kept, and
     ``stats.skipped`` counts it. With ``config.error_feedback = β`` each learner sends
     ``q = encode(β·e + Δ_m)`` instead and keeps ``e ← β·e + Δ_m − decode(q)`` in
     ``state.residual`` (F32, shaped like the parameters; zeros again when not finite).
  4. At ``t = step_of(r) + τ`` (``τ = overlap_steps``; ``τ = 0``: the same step), the
     merge: ``θ_m,f ← mixing·θ_m,f + (1 − mixing)·Θ_f``, where ``θ_m,f`` is the learner's
     current fragment, trained ``τ`` steps past its delta (so with ``mixing = 0`` those
     ``τ`` steps of the fragment are replaced by Θ, as in Streaming DiLoCo); after a
     skipped round the fragment is reset to its anchor instead.
  5. With ``config.outer_delay = 1`` (Kale et al., arXiv 2502.12996) the delta is
     ``start − θ``, from the phase's own start (``state.delay.start``), and the merge
     adopts the next start, the Θ *before* this round's outer step; with ``eager`` plus
     the learner's correction for its fresh delta (``gmjax.core.eager``).

  **Sharded outer step** (``shard_outer``, the default with an ``axis_name``): each leaf
  is padded to a multiple of ``32·M`` and learner ``k`` owns every ``M``-th codec block
  of it (``gmjax.transform.shards``): shard ``k`` of the F32 master and of the outer
  state, ``1/M`` of the replicated memory. A round ``all_to_all``-s the encoded deltas
  by shard, sums them in learner order, runs the outer step on the shard and
  ``all_gather``-s the new Θ (or the update at ``commit_precision``). Bytes each learner
  sends per sync of ``n`` parameters: ``(M−1)/M · (b_delta + b_publish) · n`` plus one
  ``psum`` of ``M² + 2`` F32 values (the Gram matrix of the deltas, for an exact cosine),
  e.g. F8 deltas and bf16 Θ: ``(M−1)/M · 3.125n``. The outer optimizer must be
  elementwise: an alias in ``gmjax.transform.elementwise.ELEMENTWISE`` when built from
  the config, else it must pass a probe (whole vector against its halves).

  **Replicated** (``shard_outer=False``, or no ``axis_name``): every learner holds the
  whole master and outer state and runs the same outer step; any optax optimizer works.
  F32 deltas: one ``psum`` of ``(w·Δ, Δ/‖Δ‖)``, ``≈ 2·2(M−1)/M·4n``; other precisions
  all-gather the encoded deltas, ``(M−1)·b_delta·n``.

  **Buckets.** A round works on each fragment's *buckets* (``gmjax.transform.buckets``):
  the rows of 32 values of its leaves that travel and publish alike, laid end to end,
  and the masters and outer states are held as such buckets (``DiLoCoState.master``),
  so a round is a few operations a fragment whatever its number of leaves. An outer
  optimizer that is not elementwise (replicated only: global-norm clipping, LAMB) is
  given the fragment's leaves in their own shapes instead.

  The outer work sits in loops that run once or not at all
  (``gmjax.transform.control.when``), and the other steps skip it; they update the state
  in place (a ``lax.cond`` would copy the whole state in and out on every step). Under
  ``vmap`` the (batched) count and the learners' verdicts on their steps (below) are
  replaced by their maxima over the axis, one all-reduce of two scalars a step, so that
  the predicate is not batched.

  **Steps between rounds.** Most updates do no round work, and the host knows which
  from the step count (``config.schedule(state).due(count)``).
  ``update(..., between_rounds=True)`` on those, passed as a static argument of the
  jitted step, traces the update without the round (``gmjax.transform.between``): the
  same results bit for bit, without the loops that make XLA write the updates out, and
  with nothing crossing the learners' axis. On an update that is due it drops the step
  and leaves the count as it was.

  Between merges the returned updates are exactly the inner optimizer's; on a merge
  those of the merged fragment are ``θ_new − params`` at the updates' dtype, so
  ``params + updates`` matches Θ up to one rounding at the parameters' dtype (in F32 too:
  ``p + (Θ − p)`` need not be ``Θ``), which the next delta absorbs.

  **Non-finite steps** (``gmjax.transform.finite``). A step never makes finite
  parameters non-finite: where a learner's gradients, or ``params + updates`` at the
  parameters' dtype (as ``optax.apply_updates`` forms it), hold a NaN or Inf anywhere,
  its update is dropped (zero, or the merge alone on a merge step) and counted in
  ``stats.dropped``; its inner optimizer runs on the gradients with their NaN/Inf
  zeroed, so that its state stays finite; and its next delta of every fragment is
  withheld, which the round rejects as it rejects a non-finite delta, so that the
  learner rejoins Θ at the merge. Updates are additive, so parameters that already
  hold a NaN or Inf cannot be repaired through ``optax.apply_updates`` (every later
  step is dropped too): give such a learner ``state.anchor``. The check reads the
  updates before ``apply_updates`` may write them, so XLA writes them out: on CPU a step
  between rounds costs 1.04-1.15x plain optax's with it, and plain optax's without it
  (``drop_non_finite=False``, as plain optax leaves it to ``optax.apply_if_finite``).

  Args:
    inner: the inner optimizer (any optax ``GradientTransformation``).
    config: a ``gmjax.DiLoCo``; ``overlap_steps`` must be an int.
    outer: the outer optimizer, applied to ``g`` as a gradient, when ``config.outer`` is
      ``"custom"`` (``dataclasses.replace(config, outer="custom")``), so that the config
      records that the optimizer was given in code; None builds it from the config
      (``config.outer_transform()``), which must then name an optax optimizer.
    axis_name: the learners' mapped axis name (or a tuple of names, as manual mesh axes of
      ``shard_map`` or ``pmap``: not several ``vmap`` axes); None is one learner.
    shard_outer: shard the master and outer state over ``axis_name`` (None: whenever
      ``axis_name`` is set). Sharded, ``init`` must run inside the mapped axis, e.g.
      ``jax.vmap(optimizer.init, axis_name="learner")``.
    drop_non_finite: drop a learner's step that would make its parameters non-finite
      (above). False runs the inner optimizer as it is: a learner whose gradients or
      parameters go non-finite stays so, and every round rejects its deltas.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state, params,
    *, tokens=None, between_rounds=False, **extra_args)`` needs ``params`` and passes
    ``extra_args`` to ``inner`` (one named within a typo of ``tokens`` or
    ``between_rounds``, e.g. ``token=``, is refused). Its state is a ``DiLoCoState``;
    log ``state.stats``.

  Raises:
    ValueError: ``config.overlap_steps`` is None; ``outer`` given with a
      ``config.outer`` other than ``"custom"``, or ``"custom"`` without ``outer``; a
      sharded outer step with an outer optimizer that is not elementwise (pass
      ``shard_outer=False``), or with ``init`` outside the mapped axis; ``update``
      without params, with params or updates unlike the state's or each other's
      shapes, with a state that ``init`` would lay out otherwise for these params
      (built under another configuration), or with ``tokens`` that is not one number,
      or, when static, not a non-negative whole number below 2^31.
    TypeError: ``config`` is not a ``gmjax.DiLoCo``, ``inner``/``outer`` not a
      transformation, or ``between_rounds`` or ``drop_non_finite`` not a Python bool.

  Example:
    Two learners on a ``vmap`` axis, syncing every 2 steps:

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import gmjax
    >>> optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2),
    ...                          axis_name="learner")
    >>> def train_step(params, state, x):
    ...   grads = jax.grad(lambda p: jnp.mean((x @ p["w"] - 1.0) ** 2))(params)
    ...   updates, state = optimizer.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> step = jax.jit(jax.vmap(train_step, axis_name="learner"))
    >>> params = {"w": jnp.zeros((2, 3, 1))}  # the leading axis holds the learners
    >>> state = jax.vmap(optimizer.init, axis_name="learner")(params)
    >>> x = jnp.arange(12.0).reshape(2, 2, 3) / 10  # each learner's own batch
    >>> for _ in range(4):
    ...   params, state = step(params, state, x)
    >>> params["w"].shape, state.stats.rounds.tolist()  # rounds done, per learner
    ((2, 3, 1), [2, 2])

  References:
    Douillard et al., arXiv 2311.08105; Douillard et al., arXiv 2501.18512.
  """
  checks.arguments(inner, config, axis_name, outer, shard_outer)
  if not isinstance(drop_non_finite, bool):
    raise TypeError(f"gmjax.diloco: drop_non_finite={drop_non_finite!r} must be a bool"
                    " (True drops a step that would make the parameters non-finite).")
  sharded = axis_name is not None if shard_outer is None else shard_outer
  tx = config.outer_transform() if outer is None else outer
  alias = config.outer if outer is None else None
  if sharded:
    elementwise.check(tx, alias)
  # Masters and outer states are held in buckets; an optimizer that is not elementwise
  # (replicated only) runs on the pieces in their own shapes.
  acts_elementwise = sharded or elementwise.acts_elementwise(tx, alias)
  inner = optax.with_extra_args_support(inner)
  tau = config.overlap_steps

  def layout_of(params, where):
    learners = checks.axis_size(axis_name, where, sharded) if sharded else None
    return structure.Layout(config, params, learners, tx, axis_name, acts_elementwise)

  def init_fn(params):
    layout = layout_of(params, "init")
    anchor = layout.cast(params)
    master, outer_state = layout.master_init(params)
    return DiLoCoState(
        inner_state=inner.init(params),
        count=jnp.zeros([], jnp.int32),
        anchor=anchor,
        master=master,
        outer_state=outer_state,
        pending=jnp.zeros([len(layout.plan)], jnp.int32),
        tokens=token_counts.zeros(len(layout.plan)),
        stats=initial_statistics(),
        residual=layout.residual_init(params),
        delay=layout.delay_init(tx, params),
    )

  def update_fn(updates, state, params=None, *, tokens=None, between_rounds=False,
                **extra_args):
    if not isinstance(between_rounds, bool):
      raise TypeError(
          f"gmjax.diloco: update(between_rounds={between_rounds!r}) must be a Python bool"
          " (it chooses the program: pass it as a static argument of the jitted step).")
    # Other keywords go to the inner optimizer, whose parts ignore those they do not take
    # (optax's way): a misspelt tokens= (token=500) was dropped, one token a step counted.
    for name in extra_args:
      close = difflib.get_close_matches(name, ["tokens", "between_rounds"], n=1, cutoff=0.8)
      if close:
        raise TypeError(
            f"gmjax.diloco: update got {name}=, which is not gmjax.diloco's {close[0]}= and"
            f" would go to the inner optimizer, which ignores what it does not take; did"
            f" you mean {close[0]}=?")
    if not isinstance(state, DiLoCoState):
      raise TypeError(finish_lib.not_a_state(state, "gmjax.diloco: update"))
    if params is None:
      raise ValueError(
          "gmjax.diloco: update needs params (the deltas are anchor − params); call"
          " update(grads, state, params)."
      )
    checks.one_vmap_axis(axis_name)
    checks.params(params, state.anchor)
    checks.updates(updates, params)
    if axis_name is not None and not sharded:
      checks.axis_size(axis_name, "update", sharded)  # the learners' axis must be bound
    layout = layout_of(params, "update")  # checks that the learners' axis is bound
    checks.state(state, jax.eval_shape(init_fn, params))
    step_tokens, bad_tokens = token_counts.step_tokens(tokens)
    learner = lax.axis_index(axis_name) if sharded else None
    # The inner step takes each learner's own parameters, where its gradients were
    # taken; on the first step the result is moved onto learner 0's start
    # (``rounds.run_round``), so the common step carries no alignment at all. A step that would make the
    # parameters non-finite is dropped (``gmjax.transform.finite``).
    if drop_non_finite:
      inner_updates, inner_state = inner.update(
          finite.finite_gradients(updates), state.inner_state, params, **extra_args)
      inner_updates = finite.marked(inner_updates, updates)
      dropped = finite.non_finite(params, inner_updates)
    else:
      inner_updates, inner_state = inner.update(updates, state.inner_state, params,
                                                **extra_args)
      dropped = jnp.zeros([], bool)
    checks.inner_state(inner_state, state.inner_state, updates, params)
    counts = token_counts.withhold(token_counts.add(state.tokens, step_tokens), dropped)
    stats = state.stats._replace(
        dropped=state.stats.dropped + dropped.astype(jnp.int32),
        bad_tokens=state.stats.bad_tokens + bad_tokens.astype(jnp.int32))
    if between_rounds:
      return between.update(state, between.schedule(layout.table, tau, state.count),
                            inner_updates, inner_state, dropped, counts, stats)
    count, anyone_dropped = _unbatched(state.count, dropped, axis_name)
    t, first, sync_index, merge_index = between.schedule(layout.table, tau, count)
    round_state = RoundState(state.anchor, state.master, state.outer_state, state.pending,
                             counts, stats, state.residual, state.delay)

    new_updates, round_state = rounds.run_round(
        layout, config, tx, axis_name, learner, (params, inner_updates), round_state,
        first, sync_index, merge_index, dropped, anyone_dropped,
    )
    # The count laid out as it came (batched under vmap, as the steps between rounds
    # return it): one program a kind of step, not one a switch between them.
    return new_updates, DiLoCoState(inner_state, state.count + (t - count), *round_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
