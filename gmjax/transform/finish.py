"""``gmjax.finish``: the global model Θ at the end of an in-mesh run."""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from gmjax.transform import explicit, structure
from gmjax.transform.state import DiLoCoState


def finish(state: DiLoCoState, params: Any, *, learner_axis: int | None = None) -> Any:
  """The global model Θ of a ``gmjax.diloco`` run, shaped, typed and laid out as ``params``.

  Θ is every fragment's latest committed value: the anchor each round publishes to all
  learners (``state.anchor``). A fragment whose round has run but whose merge is still
  pending (``overlap_steps`` later) is taken at its new Θ, as the merge would set it with
  ``mixing = 0``; a fragment whose latest round was skipped (not finite, or every delta
  rejected) keeps its previous Θ. The inner steps a learner took after a fragment's
  latest sync are, as in DiLoCo, not part of Θ: end a run on a step that syncs the last
  fragment (a multiple of ``sync_every``) to count as many of them as the schedule can.

  The learners' own parameters still differ from each other and from Θ (each trained
  on its own data since the round); Θ is what every learner agrees on, the model to
  evaluate, save and serve.

  Two ways to call it:

  * inside the learners' mapped axis (under ``vmap``/``shard_map``, with each learner's
    ``state`` and ``params``), or for one learner: ``learner_axis=None``. Every learner
    gets the same Θ, laid out as its ``params``.
  * outside, on states and parameters stacked over the learners (what ``jax.vmap(step)``
    returns): ``learner_axis=0`` (the stacking dimension). Returns one Θ, without that
    dimension, laid out as ``params`` without the learners' mesh axis (replicated over
    it, still split over the others, e.g. FSDP).

  Parameters placed on an explicit mesh carry it: no ``jax.set_mesh`` is needed around
  the call, and Θ is laid out on it under another mesh too. Parameters that carry no
  sharding (host copies) get Θ laid out as the state's anchor is (outside the learners'
  axis, without their dimension).

  Args:
    state: the ``gmjax.DiLoCoState`` of the run, as ``update`` returned it (for
      ``gmjax.diloco`` inside a chain or ``optax.MultiSteps``, the ``DiLoCoState``
      inside their state).
    params: the learner's parameters (stacked with ``learner_axis``); Θ takes their
      dtypes and, on an explicit mesh or for arrays placed with a ``NamedSharding``,
      their sharding.
    learner_axis: None inside the learners' axis, else the dimension the learners are
      stacked on in ``state`` and ``params``.

  Returns:
    Θ, a pytree like ``params`` (without the learners' dimension with ``learner_axis``).

  Raises:
    TypeError: ``state`` is not a ``gmjax.DiLoCoState`` (the message names where one
      lies in it, e.g. ``state.inner_opt_state`` of ``optax.MultiSteps``).
    ValueError: ``params`` is not structured or shaped like the state's anchor, or
      ``learner_axis`` is not the axis ``state`` is stacked over learners on.

  Example:
    >>> import jax, jax.numpy as jnp, optax, gmjax
    >>> config = gmjax.DiLoCo(sync_every=2, overlap_steps=0)
    >>> optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")
    >>> params = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}  # two learners
    >>> state = jax.vmap(optimizer.init, axis_name="learner")(params)
    >>> @jax.vmap
    ... def grads(p):
    ...   return jax.tree.map(jnp.ones_like, p)
    >>> step = jax.vmap(optimizer.update, axis_name="learner")
    >>> for _ in range(2):
    ...   updates, state = step(grads(params), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> gmjax.finish(state, params, learner_axis=0)["w"].shape
    (2,)
  """
  if not isinstance(state, DiLoCoState):
    raise TypeError(not_a_state(state))
  anchor = state.anchor
  found = structure.mismatch(params, anchor, ("params", "the state's anchor"))
  if found is not None and found[0] == "structure":
    same_leaves = [jnp.shape(p) for p in jax.tree.leaves(params)] == [
        jnp.shape(a) for a in jax.tree.leaves(anchor)]
    raise ValueError(
        f"gmjax.finish: params are structured otherwise than the state's anchor"
        f" ({found[1]}); pass the parameters the optimizer was updating"
        + (", in the containers the optimizer saw (their leaves match the anchor's: for"
           " an nnx.Optimizer, pass nnx.as_pure(optimizer.opt_state) and"
           " nnx.as_pure(params))"
           if same_leaves else "") + ".")
  if found is not None:
    _, path, got, want = found
    raise ValueError(
        f"gmjax.finish: params{path} has shape {got} but the state's anchor {want}; pass"
        " the parameters the optimizer was updating"
        + (", stacked like the state" if learner_axis is not None else "") + ".")
  if learner_axis is None and jnp.ndim(state.count):
    raise ValueError(
        f"gmjax.finish: learner_axis=None, but state.count has shape"
        f" {jnp.shape(state.count)}: the state is stacked over learners (as jax.vmap's"
        " init returns it); pass learner_axis=0, the dimension they are stacked on.")
  if learner_axis is not None:
    # Any integer (np.int64 from a shape or a config too), but not a bool: True would
    # take axis 1.
    if isinstance(learner_axis, (bool, np.bool_)) or not hasattr(learner_axis, "__index__"):
      raise ValueError(
          f"gmjax.finish: learner_axis must be None or an int (the dimension the learners"
          f" are stacked on), got {learner_axis!r}.")
    learner_axis = operator.index(learner_axis)
    _check_stacked(state, learner_axis)
  with _their_mesh((params, anchor)):
    return jax.tree.map(lambda a, p: _one(a, p, learner_axis), anchor, params)


def _check_stacked(state: DiLoCoState, learner_axis: int) -> None:
  """Raises a ValueError unless ``state`` is stacked over learners on ``learner_axis``:
  its count (a scalar a learner) one-dimensional, and every anchor leaf as long on that
  axis as the count. Taking index 0 of another axis would give a slice of Θ."""
  count = jnp.shape(state.count)
  if len(count) != 1:
    raise ValueError(
        f"gmjax.finish: learner_axis={learner_axis}, but state.count has shape {count},"
        " not (learners,): the state is not stacked over learners (one learner's, or a"
        " call inside the learners' axis); pass learner_axis=None.")
  # state.pending, (fragments,) a learner, shows the axis the state was stacked on where
  # the learners' and the fragments' counts differ: (learners, P) for jax.vmap's.
  pending = jnp.shape(state.pending)
  stacked = {axis for axis in (0, 1) if len(pending) == 2 and pending[axis] == count[0]}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.anchor)[0]:
    shape = jnp.shape(leaf)
    # pending's axis 0 is every leaf's first, its axis 1 every leaf's last.
    if not -len(shape) <= learner_axis < len(shape) or shape[learner_axis] != count[0] or (
        len(stacked) == 1 and learner_axis % len(shape) != (
            0 if stacked == {0} else len(shape) - 1)):
      raise ValueError(
          f"gmjax.finish: learner_axis={learner_axis}, but state.anchor"
          f"{jax.tree_util.keystr(path)} has shape {shape} while the state holds"
          f" {count[0]} learners (state.count has shape {count}, state.pending {pending});"
          " pass the dimension the learners are stacked on (0 for jax.vmap's).")


def not_a_state(state: Any, where: str = "gmjax.finish") -> str:
  """The message for a ``state`` that is not a ``DiLoCoState``: where one lies in it."""
  is_state = lambda x: isinstance(x, DiLoCoState)
  found = [jax.tree_util.keystr(path) for path, leaf in
           jax.tree_util.tree_flatten_with_path(state, is_leaf=is_state)[0]
           if is_state(leaf)]
  head = (f"{where}: state must be the gmjax.DiLoCoState of gmjax.diloco, got"
          f" {type(state).__name__}")
  if len(found) == 1:
    return (f"{head}, which holds one at state{found[0]} (gmjax.diloco inside another"
            f" optax transformation): "
            + (f"call gmjax.finish(state{found[0]}, params)." if where == "gmjax.finish"
               else f"pass state{found[0]}."))
  if found:
    return (f"{head}, which holds several, at {['state' + p for p in found]}: pass the"
            " one of the run whose params these are.")
  return (f"{head}, with no gmjax.DiLoCoState in it; pass the optimizer state that"
          " gmjax.diloco's init or update returned (for optax.chain(clip,"
          " gmjax.diloco(...)), state[1]; an Orbax restore needs that state as its"
          " target, or it returns plain dicts).")


def _their_mesh(arrays: Any) -> contextlib.AbstractContextManager:
  """The explicit mesh the first of ``arrays`` that lies on one lies on, set for Θ's
  layout (the parameters', else the state's).

  Laying Θ out on an explicit mesh (``auto_axes``, ``reshard``) needs the mesh in
  context; arrays placed on one carry it in their type, so ``finish`` works outside
  ``jax.set_mesh`` too, and under another mesh (one to serve on): Θ is laid out on the
  run's.
  """
  for leaf in jax.tree.leaves(arrays):
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
      continue
    if mesh == jax.sharding.get_abstract_mesh():
      return contextlib.nullcontext()
    concrete = getattr(leaf, "sharding", None)
    if isinstance(concrete, NamedSharding) and not isinstance(leaf, jax.core.Tracer):
      return jax.set_mesh(concrete.mesh)
    return jax.sharding.use_abstract_mesh(mesh)
  return contextlib.nullcontext()


def _one(theta: jax.Array, param: jax.Array, learner_axis: int | None) -> jax.Array:
  """One leaf of Θ at ``param``'s dtype and layout (learner 0's copy, with an axis)."""
  dtype = jnp.result_type(param)
  if learner_axis is None:
    return explicit.like(jnp.asarray(theta, dtype), param)
  if not -jnp.ndim(param) <= learner_axis < jnp.ndim(param):
    raise ValueError(
        f"gmjax.finish: learner_axis={learner_axis} is not a dimension of a parameter of"
        f" shape {jnp.shape(param)}; pass the dimension the learners are stacked on.")
  axis = learner_axis % jnp.ndim(param)
  theta = jnp.asarray(theta, dtype)
  # Every learner holds the same Θ (the round publishes it to all): learner 0's copy.
  index = (slice(None),) * axis + (0,)
  # Traced or placed on an explicit mesh, the parameter's type says where Θ goes; for
  # one that says nothing (a host copy), the state's.
  entries = explicit.spec(param)
  entries = explicit.spec(theta) if entries is None else entries
  if entries is not None:
    return _learner_0(theta, axis=axis,
                      spec=PartitionSpec(*(entries[:axis] + entries[axis + 1:])))
  out = theta[index]
  sharding = getattr(param, "sharding", None)
  if isinstance(sharding, NamedSharding) and not isinstance(out, jax.core.Tracer):
    spec = tuple(sharding.spec) + (None,) * (jnp.ndim(param) - len(sharding.spec))
    return jax.device_put(out, NamedSharding(sharding.mesh,
                                             PartitionSpec(*(spec[:axis] + spec[axis + 1:]))))
  return out


@functools.partial(jax.jit, static_argnames=("axis", "spec"))
def _learner_0(theta: jax.Array, *, axis: int, spec: PartitionSpec) -> jax.Array:
  """Learner 0's copy of ``theta``, stacked on ``axis`` of an explicit mesh, laid out as
  ``spec``: compiled once for each shape, not again on each call.

  Explicit sharding has no rule for one index of a sharded dimension; XLA places it (a
  copy from learner 0's devices) with the mesh's axes made Auto.
  """
  take = lambda t: lax.index_in_dim(t, 0, axis, keepdims=False)
  return jax.sharding.auto_axes(take, out_sharding=spec)(theta)
