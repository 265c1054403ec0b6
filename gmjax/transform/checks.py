"""The checks ``gmjax.diloco`` makes of its arguments, at build and at trace time.

Each raises a ``ValueError`` or ``TypeError`` that names the argument, the value and
the fix; none adds anything to the compiled step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gmjax.core.diloco import CUSTOM, DiLoCo
from gmjax.transform import explicit, structure


def arguments(inner: Any, config: Any, axis_name: Any, outer: Any, shard_outer: Any) -> None:
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
  if shard_outer is not None and not isinstance(shard_outer, bool):  # 1 == True
    raise ValueError(f"gmjax.diloco: shard_outer must be None or a bool, got {shard_outer!r}"
                     " (None shards the outer state whenever axis_name is set).")
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


def axis_size(axis_name: Any, where: str, sharded: bool) -> int:
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


def one_vmap_axis(axis_name: Any) -> None:
  """Raises unless a tuple of several ``axis_name``s is manual here (``shard_map``,
  ``pmap``): JAX's ``all_gather`` over several ``vmap`` axes fails inside JAX."""
  if isinstance(axis_name, tuple) and len(axis_name) > 1 and not explicit.manual(axis_name):
    raise ValueError(
        f"gmjax.diloco: axis_name={axis_name!r} names several axes, which the round's"
        " collectives cross only as manual mesh axes (shard_map, pmap); under jax.vmap,"
        " map the learners over one axis (reshape them to one dimension) and pass its"
        " name.")


def _check_like(what: str, tree: Any, like: Any, structured: str, shaped: str,
                fix: str) -> None:
  """Raises unless ``tree`` (named ``what``) has the structure and leaf shapes of
  ``like``. ``structured`` names ``like`` and ``shaped`` says what it is (it may name
  the leaf's ``{path}``); ``fix`` ends the message."""
  found = structure.mismatch(tree, like, (what, structured))
  if found is None:
    return
  kind, path, got, want = found
  if kind == "structure":
    raise ValueError(f"gmjax.diloco: update got {what} structured otherwise than"
                     f" {structured} ({path}); {fix}.")
  raise ValueError(f"gmjax.diloco: update got {what}{path} of shape {got}, but"
                   f" {shaped.format(path=path)} {want}; {fix}.")


def params(params: Any, anchor: Any) -> None:
  """Raises unless ``params`` has the structure, shapes and dtypes the state was built
  for (float64 is taken as float32, as ``init`` takes it)."""
  fix = "build the state with optimizer.init on the parameters as they are now"
  _check_like("params", params, anchor, "the state's anchor",
              "the state was built for shape", fix)
  # The state's layout follows the dtypes (a master is kept beside 16-bit parameters):
  # named here, rather than as a state that does not fit.
  as_built = lambda x: (jnp.dtype(jnp.float32) if jnp.result_type(x) == jnp.float64
                        else jnp.result_type(x))
  for (path, p), a in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(anchor)):
    if as_built(p) != as_built(a):
      raise ValueError(
          f"gmjax.diloco: update got params{jax.tree_util.keystr(path)} of dtype"
          f" {jnp.result_type(p)}, but the state was built for {jnp.result_type(a)} (its"
          f" anchor); {fix}, or pass them at the dtype init saw.")


def updates(updates: Any, params: Any) -> None:
  """Raises unless ``updates`` (the gradients) have the structure and shapes of
  ``params``: the inner optimizer and the step combine them leaf by leaf."""
  _check_like("updates", updates, params, "params",
              "params{path} has shape",
              "pass the gradients of these params, shaped and structured like them:"
              " update(grads, state, params)")


def inner_state(new: Any, old: Any, grads: Any, params: Any) -> None:
  """Raises unless the inner optimizer's ``new`` state is laid out as its ``old`` one:
  the next update would refuse it (``state``), and the round's loops carry it. optax's
  moments take the gradients' dtype, so gradients of another dtype than ``params`` are
  the usual cause, named with the cast that mends it."""
  found = structure.state_mismatch(new, old)
  if found is None:
    return
  path, got, want = found
  cause = ("; check that the inner optimizer's update returns a state laid out as its"
           " init builds it")
  for (where, g), p in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                           jax.tree.leaves(params)):
    if structure.dtype(g) != structure.dtype(p):
      where = jax.tree_util.keystr(where)
      cause = (f": it follows the gradients, and updates{where} are {structure.dtype(g)}"
               f" where params{where} are {structure.dtype(p)}; pass gradients at the"
               " parameters' dtypes, e.g. jax.tree.map(lambda g, p: g.astype(p.dtype),"
               " grads, params), or train parameters of the gradients' dtype")
      break
  raise ValueError(
      f"gmjax.diloco: the inner optimizer's update returns state.inner_state{path} as"
      f" {got}, where the state holds {want} (a state that init did not build){cause}.")


def state(state: Any, expected: Any) -> None:
  """Raises unless ``state`` is laid out as ``expected``, what ``init`` builds for the
  parameters now: kinds, shapes and dtypes (as ``jit`` canonicalizes them), not the
  arrays' sharding or memory layout, so that a checkpoint restored as numpy arrays
  counts as the state it was."""
  found = structure.state_mismatch(state, expected)
  if found is None:
    return
  path, got, want = found
  raise ValueError(
      f"gmjax.diloco: update got a state whose state{path} is {got}, where this"
      f" optimizer's init builds {want}: the state was built for another configuration"
      " (fragments, layer_axis, error_feedback, commit_precision, outer_delay, the outer"
      " optimizer or its options, shard_outer, the learners' count, the inner"
      " optimizer); build it with this optimizer's init, or, for a checkpoint, restore"
      " it with the config it was saved with.")
