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

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gmjax.core.diloco import CUSTOM, DiLoCo
from gmjax.transform import control, elementwise, explicit, finite, rounds, structure
from gmjax.transform import tokens as token_counts
from gmjax.transform.state import DiLoCoState, RoundState, initial_statistics


def _check(inner: Any, config: Any, axis_name: Any, outer: Any, shard_outer: Any) -> None:
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
  if config.adaptive_steps:
    raise ValueError(
        "gmjax.diloco: config.adaptive_steps=True lets each learner train as many steps as"
        " its speed allows in a round's wall time, but in-mesh learners step in lockstep"
        " (one program, one step count); use dataclasses.replace(config,"
        " adaptive_steps=False), or the mail runtime (gmjax.mail) for learners of"
        " different speeds."
    )
  for what, value in (("inner", inner), ("outer", outer)):
    if value is not None and not (hasattr(value, "init") and hasattr(value, "update")):
      raise TypeError(
          f"gmjax.diloco: {what} must be an optax GradientTransformation, got {value!r};"
          " pass e.g. optax.adamw(1e-3)."
      )
  if inner is None:
    raise TypeError("gmjax.diloco: inner must be an optax GradientTransformation, got None.")
  if isinstance(axis_name, (list, set, dict)):
    raise TypeError(
        f"gmjax.diloco: axis_name must be None, an axis name or a tuple of them, got"
        f" {axis_name!r}."
    )
  if shard_outer not in (None, True, False):
    raise ValueError(f"gmjax.diloco: shard_outer must be None or a bool, got {shard_outer!r}.")
  if outer is not None and config.eager:
    raise ValueError(
        "gmjax.diloco: config.eager=True runs each learner's own copy of the outer step,"
        " which it builds from the config (outer SGD); leave outer=None.")
  if outer is not None and config.outer != CUSTOM:
    raise ValueError(
        f"gmjax.diloco: outer= was given, but {config.outer_description()} is what the"
        f" config says would run (and what config.to_json() records); pass"
        f" dataclasses.replace(config, outer={CUSTOM!r}) to run the outer= optimizer, or"
        " drop outer= to run the config's.")
  if outer is None and config.outer == CUSTOM:
    raise ValueError(
        f"gmjax.diloco: config.outer={CUSTOM!r} means the outer optimizer is given in code,"
        " but outer= is None; pass gmjax.diloco(inner, config, outer=tx), or name an optax"
        " optimizer in the config, e.g. dataclasses.replace(config, outer='sgd').")
  if shard_outer and axis_name is None:
    raise ValueError(
        "gmjax.diloco: shard_outer=True shards the outer state over the learners' axis,"
        " but axis_name is None; pass axis_name=... or leave shard_outer unset."
    )


def _bound_axes() -> tuple[str, ...]:
  """The mapped axis names bound here (``vmap``/``pmap`` names, ``shard_map``'s manual
  axes), as far as JAX says: for error messages only."""
  names = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
  try:
    # JAX has no public query for the names vmap binds; a message can do without them.
    from jax._src import core as jax_core  # pylint: disable=g-import-not-at-top

    mapped = jax_core.get_axis_env().axis_names()
  except Exception:  # pylint: disable=broad-except
    mapped = ()
  return tuple(sorted(str(n) for n in names | set(mapped)))


def _axis_size(axis_name: Any, where: str, sharded: bool) -> int:
  """``M``, the size of the learners' axis, which must be bound here (raises otherwise).

  ``where`` is ``"init"`` or ``"update"``, for the message.
  """
  try:
    return int(lax.psum(1, axis_name))
  except NameError:
    bound = _bound_axes()
  here = (f"the mapped axes bound here are {list(bound)}" if bound
          else "no mapped axis is bound here")
  fix = (f"pass axis_name={bound[0]!r} to gmjax.diloco if that is the learners' axis, or"
         f" map {where} over axis_name={axis_name!r}" if bound else
         f"call {where} inside the mapped axis, e.g. jax.vmap(optimizer.{where},"
         f" axis_name={axis_name!r}), or inside the shard_map / pmap of the step")
  why = ("so that the state holds one learner's shard of the outer state" if where == "init"
         else "whose learners it synchronizes")
  raise ValueError(
      f"gmjax.diloco: {where} must run inside the learners' mapped axis {axis_name!r},"
      f" {why}, but {here}: {fix}."
      + (" Or pass shard_outer=False to replicate the outer state (then init may run"
         " outside the axis)." if sharded and where == "init" else "")
  ) from None


def _check_like(what: str, tree: Any, like: Any, structured: str, shaped: str,
                fix: str) -> None:
  """Raises unless ``tree`` (named ``what``) has the structure and leaf shapes of
  ``like``. ``structured`` and ``shaped`` say what ``like`` is (``shaped`` may name the
  leaf's ``{path}``); ``fix`` ends the message."""
  found = structure.mismatch(tree, like)
  if found is None:
    return
  kind, path, got, want = found
  if kind == "structure":
    raise ValueError(f"gmjax.diloco: update got {what} structured as {got}, but"
                     f" {structured} {want}; {fix}.")
  raise ValueError(f"gmjax.diloco: update got {what}{path} of shape {got}, but"
                   f" {shaped.format(path=path)} {want}; {fix}.")


def _check_params(params: Any, anchor: Any) -> None:
  """Raises unless ``params`` has the structure and shapes the state was built for."""
  _check_like("params", params, anchor, "the state was built for",
              "the state was built for shape",
              "build the state with optimizer.init on the parameters as they are now")


def _check_updates(updates: Any, params: Any) -> None:
  """Raises unless ``updates`` (the gradients) have the structure and shapes of
  ``params``: the inner optimizer and the step combine them leaf by leaf."""
  _check_like("updates", updates, params, "params are structured as",
              "params{path} has shape",
              "pass the gradients of these params, shaped and structured like them:"
              " update(grads, state, params)")


def _check_state(state: Any, expected: Any) -> None:
  """Raises unless ``state`` is laid out as ``expected``, what ``init`` builds for the
  parameters now (shapes only, so that no layout or dtype detail of a restored
  checkpoint counts)."""
  found = structure.state_mismatch(state, expected)
  if found is None:
    return
  path, got, want = found
  raise ValueError(
      f"gmjax.diloco: update got a state whose state{path} is {got}, where this"
      f" optimizer's init builds {want}: the state was built for another configuration"
      " (fragments, layer_axis, error_feedback, commit_precision, outer_delay, the outer"
      " optimizer, shard_outer, the learners' count, the inner optimizer); build it with"
      " this optimizer's init, or, for a checkpoint, restore it with the config it was"
      " saved with.")


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
  Between merges the returned updates are exactly the inner optimizer's; on a merge
  those of the merged fragment are ``θ_new − params`` at the updates' dtype, so with
  16-bit parameters ``params + updates`` matches Θ up to one rounding, which the next
  delta absorbs.

  **Non-finite steps** (``gmjax.transform.finite``). A step never makes finite
  parameters non-finite: where a learner's gradients, or ``params + updates`` at the
  parameters' dtype (as ``optax.apply_updates`` forms it), hold a NaN or Inf anywhere,
  its update is dropped (zero, or the merge alone on a merge step) and counted in
  ``stats.dropped``; its inner optimizer runs on the gradients with their NaN/Inf
  zeroed, so that its state stays finite; and its next delta of every fragment is
  withheld, which the round rejects as it rejects a non-finite delta, so that the
  learner rejoins Θ at the merge. Updates are additive, so parameters that already
  hold a NaN or Inf cannot be repaired through ``optax.apply_updates`` (every later
  step is dropped too): give such a learner ``state.anchor``.

  Args:
    inner: the inner optimizer (any optax ``GradientTransformation``).
    config: a ``gmjax.DiLoCo``; ``overlap_steps`` must be an int.
    outer: the outer optimizer, applied to ``g`` as a gradient, when ``config.outer`` is
      ``"custom"`` (``dataclasses.replace(config, outer="custom")``), so that the config
      records that the optimizer was given in code; None builds it from the config
      (``config.outer_transform()``), which must then name an optax optimizer.
    axis_name: the learners' mapped axis name (or tuple of names); None is one learner.
    shard_outer: shard the master and outer state over ``axis_name`` (None: whenever
      ``axis_name`` is set). Sharded, ``init`` must run inside the mapped axis, e.g.
      ``jax.vmap(optimizer.init, axis_name="learner")``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state, params,
    *, tokens=None, **extra_args)`` needs ``params`` and passes ``extra_args`` to
    ``inner``. Its state is a ``DiLoCoState``; log ``state.stats``.

  Raises:
    ValueError: ``config.overlap_steps`` is None; ``outer`` given with a
      ``config.outer`` other than ``"custom"``, or ``"custom"`` without ``outer``; a
      sharded outer step with an outer optimizer that is not elementwise (pass
      ``shard_outer=False``), or with ``init`` outside the mapped axis; ``update``
      without params, with params or updates unlike the state's or each other's
      shapes, with a state that ``init`` would lay out otherwise for these params
      (built under another configuration), or with ``tokens`` that is not one number,
      or, when static, not a non-negative whole number below 2^31.
    TypeError: ``config`` is not a ``gmjax.DiLoCo``, or ``inner``/``outer`` not a
      transformation.

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
  _check(inner, config, axis_name, outer, shard_outer)
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
  sync_every = config.sync_every

  def layout_of(params, where):
    learners = _axis_size(axis_name, where, sharded) if sharded else None
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

  def update_fn(updates, state, params=None, *, tokens=None, **extra_args):
    if params is None:
      raise ValueError(
          "gmjax.diloco: update needs params (the deltas are anchor − params); call"
          " update(grads, state, params)."
      )
    _check_params(params, state.anchor)
    _check_updates(updates, params)
    if axis_name is not None and not sharded:
      _axis_size(axis_name, "update", sharded)  # the learners' axis must be bound
    layout = layout_of(params, "update")  # checks that the learners' axis is bound
    _check_state(state, jax.eval_shape(init_fn, params))
    step_tokens, bad_tokens = token_counts.step_tokens(tokens)
    learner = lax.axis_index(axis_name) if sharded else None
    # The inner step takes each learner's own parameters, where its gradients were
    # taken; on the first step the result is moved onto learner 0's start
    # (``rounds.run_round``), so the common step carries no alignment at all. A step that would make the
    # parameters non-finite is dropped (``gmjax.transform.finite``).
    inner_updates, inner_state = inner.update(
        finite.finite_gradients(updates), state.inner_state, params, **extra_args
    )
    inner_updates = finite.marked(inner_updates, updates)
    dropped = finite.non_finite(params, inner_updates)
    count, anyone_dropped = _unbatched(state.count, dropped, axis_name)
    first = count == 0
    t = optax.safe_int32_increment(count)
    sync_index = structure.lookup(layout.table, t % sync_every)
    merge_index = jnp.where(t > tau, structure.lookup(layout.table, (t - tau) % sync_every), 0)
    counts = token_counts.withhold(token_counts.add(state.tokens, step_tokens), dropped)
    stats = state.stats._replace(
        dropped=state.stats.dropped + dropped.astype(jnp.int32),
        bad_tokens=state.stats.bad_tokens + bad_tokens.astype(jnp.int32))
    round_state = RoundState(state.anchor, state.master, state.outer_state, state.pending,
                             counts, stats, state.residual, state.delay)

    new_updates, round_state = rounds.run_round(
        layout, config, tx, axis_name, learner, (params, inner_updates), round_state,
        first, sync_index, merge_index, dropped, anyone_dropped,
    )
    return new_updates, DiLoCoState(inner_state, t, *round_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
