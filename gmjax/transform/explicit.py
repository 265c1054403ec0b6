"""Values of the rare steps laid out as the state they replace, on explicit meshes.

Under explicit sharding (``jax.make_mesh``'s default ``AxisType.Explicit``) every array's
type carries its sharding, and ``select`` (``jnp.where``) and the branches of
``lax.cond``/``lax.switch`` require the same sharding on every case. Values built inside
the rare steps from constants (masks, zeros) are replicated, while the parameters and the
state they are combined with are sharded over other mesh axes (FSDP). ``like`` gives such
a value the sharding of the value it meets. Resharding a replicated value to a sharded
one slices it where it lies, so it moves no data; the rare steps only ever do that
direction (the state is created with the shardings the steps produce), which the
compiled-step test checks (no all-gather over the parameters' axes).

Reductions over the learners' axis under ``vmap(..., spmd_axis_name=...)`` lower, on an
explicit mesh, to a reduction of the batch dimension that keeps that dimension's
sharding on the result, which XLA's lowering rejects (JAX 0.10: ``AssertionError:
(0, P('learner',))``). ``psum`` and ``pmax`` run them with the mesh's axes made Auto
(``jax.sharding.auto_axes``) and give the result the input's layout again.

Outside explicit meshes (Auto axes, ``shard_map`` with every axis manual, ``pmap``, no
mesh) a value's type has no sharding to match, and every function here is the identity.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def spec(x: Any) -> tuple | None:
  """``x``'s explicit sharding, one entry per dimension; None off explicit meshes."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
    return None
  entries = tuple(sharding.spec)
  return entries + (None,) * (jnp.ndim(x) - len(entries))


def like(x: jax.Array, reference: jax.Array) -> jax.Array:
  """``x`` laid out as ``reference`` (same shape) on an explicit mesh, else ``x``."""
  want, have = spec(reference), spec(x)
  if want is None or have is None or want == have:
    return x
  return jax.sharding.reshard(x, PartitionSpec(*want))


def pin(x: jax.Array, entries: tuple | None) -> jax.Array:
  """A collective's result laid out as ``entries`` on an explicit mesh (on an Auto one,
  constrained to it, each dimension ``entries`` leaves out XLA's to place), else ``x``.

  Always a ``reshard``, even when ``x``'s type already says ``entries``: inside
  ``lax.cond`` branches traced under ``vmap`` the type is that of one learner, and only
  the batching of ``all_to_all``/``all_gather`` with ``spmd_axis_name`` splits the
  exchanged dimension over the learners' axis, which this undoes (every learner needs
  all of that dimension).
  """
  if spec(x) is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
      return x  # no mesh, or manual axes (shard_map): nothing to place
    # An Auto mesh (under vmap's spmd_axis_name): a constraint, or XLA's partitioner
    # places the exchange itself (gathers of decoded F32 where codes should cross).
    entries = entries or (PartitionSpec.UNCONSTRAINED,) * jnp.ndim(x)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*entries))
  if entries is None:
    return x
  return jax.sharding.reshard(x, PartitionSpec(*entries))


def where(condition: Any, on_true: Any, on_false: Any) -> jax.Array:
  """``jnp.where`` whose condition and cases take the sharding of the kept value.

  The kept value is ``on_false`` (the state, the current parameters: what stays when
  nothing happens), or ``on_true`` where ``on_false`` is a broadcast scalar; the result
  is laid out as it is.
  """
  shape = jnp.broadcast_shapes(jnp.shape(condition), jnp.shape(on_true), jnp.shape(on_false))
  dtype = jnp.result_type(on_true, on_false)
  reference = on_false if jnp.shape(on_false) == shape else on_true
  on_true, on_false = (like(jnp.broadcast_to(jnp.asarray(x, dtype), shape), reference)
                       for x in (on_true, on_false))
  condition = jnp.asarray(condition, bool)
  if condition.ndim:  # a scalar condition selects whole arrays, whatever their layout
    condition = like(jnp.broadcast_to(condition, shape), reference)
  return jnp.where(condition, on_true, on_false)


def choose(condition: Any, on_true: Any, on_false: Any) -> Any:
  """The tree ``on_true`` if the scalar ``condition`` holds, else ``on_false``.

  One ``lax.cond`` for the whole tree: selects leaf by leaf would each get a copy of the
  computation of ``condition`` from XLA, which fuses cheap scalar work into every reader
  (a program quadratic in the leaf count). On an explicit mesh, where a learner-batched
  condition makes the ``cond`` a select whose operands must agree on their sharding, it
  is ``where`` leaf by leaf.
  """
  if any(spec(x) is not None for x in jax.tree.leaves(on_false)):
    return jax.tree.map(lambda a, b: where(condition, a, b), on_true, on_false)
  return lax.cond(condition, lambda a, b: a, lambda a, b: b, on_true, on_false)


def total(values: Any) -> jax.Array:
  """The F32 sum of scalars (one a leaf, say), or of arrays of one shape.

  One reduction of their vector: written as a chain of additions, XLA copies the chain
  into each fusion that reads the total (one or more a leaf), a program quadratic in the
  leaf count. On an explicit mesh, where learner-batched and unbatched scalars cannot be
  stacked, it is that chain.
  """
  values = [jnp.asarray(v).astype(jnp.float32) for v in values]
  if any(spec(v) is not None for v in values):
    return sum(values[1:], values[0])
  return jnp.sum(jnp.stack(values), axis=0)


def flatten(x: jax.Array, block: int) -> jax.Array:
  """``jnp.ravel(x)`` whose pieces on an explicit mesh are whole blocks of ``block``.

  The row-major flattening keeps a split of the leading dimension; a leaf split over
  another dimension, or whose pieces are not whole blocks (the codec's blocks of 32
  values, or rows of ``32·M``), is first replicated over its mesh axes, the one case
  that gathers a parameter (for the round only; the state keeps its layout).
  """
  entries = spec(x)
  flat = jnp.ravel(x)
  if entries is None or all(e is None for e in entries):
    return flat
  mesh = jax.typeof(x).sharding.mesh
  lead = entries[0]
  devices = 1
  if lead is not None:
    for axis in lead if isinstance(lead, tuple) else (lead,):
      devices *= mesh.shape[axis]
  whole = lead is not None and all(e is None for e in entries[1:]) and (
      flat.size % (devices * block) == 0)
  if whole:
    return flat
  return jax.sharding.reshard(jnp.ravel(jax.sharding.reshard(x, PartitionSpec())),
                              PartitionSpec(None))


def unflatten(flat: jax.Array, reference: jax.Array) -> jax.Array:
  """``flat`` (``reference``'s size) in ``reference``'s shape and layout."""
  entries = spec(reference)
  if entries is None:
    return flat.reshape(reference.shape)
  if spec(flat) == (entries[0],) and all(e is None for e in entries[1:]):
    # Splitting the leading dimension keeps the split where it lies.
    return jnp.reshape(flat, reference.shape, out_sharding=PartitionSpec(*entries))
  return like(flat.reshape(reference.shape), reference)


def zeros(shape: tuple[int, ...], dtype: Any, entries: tuple | None) -> jax.Array:
  """F32 (``dtype``) zeros of ``shape`` sharded as ``entries`` (None: replicated)."""
  if entries is None or all(e is None for e in entries):
    return jnp.zeros(shape, dtype)
  return jnp.zeros(shape, dtype, out_sharding=PartitionSpec(*entries))


def manual(axis_name: Any) -> bool:
  """Whether ``axis_name`` (a name or tuple) is manual here (``shard_map``, ``pmap``)."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  axes = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
  return all(name in axes for name in names)


def partially_manual(axis_name: Any) -> bool:
  """Whether ``axis_name`` is manual here while another mesh axis of size > 1 is not.

  That is ``shard_map(..., axis_names={learner})`` over a mesh whose other axes (FSDP,
  tensor parallel) XLA partitions.
  """
  if not manual(axis_name):
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return any(t != AxisType.Manual and mesh.shape[n] > 1
             for n, t in zip(mesh.axis_names, mesh.axis_types))


def _reduce(reduction, x: Any, axis_name: Any) -> Any:
  leaves = jax.tree.leaves(x)
  layouts = [spec(leaf) for leaf in leaves]
  if manual(axis_name) or all(layout is None for layout in layouts):
    return reduction(x, axis_name)
  mesh = next(jax.typeof(leaf).sharding.mesh for leaf, layout in zip(leaves, layouts)
              if layout is not None)
  axes = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)
  out = jax.tree.map(
      lambda leaf: NamedSharding(mesh, PartitionSpec(*(spec(leaf) or ()))), x)
  return jax.sharding.auto_axes(lambda v: reduction(v, axis_name), axes=axes,
                                out_sharding=out)(x)


def psum(x: Any, axis_name: Any) -> Any:
  """``lax.psum(x, axis_name)`` that also lowers under ``vmap`` on an explicit mesh."""
  return _reduce(lax.psum, x, axis_name)


def pmax(x: Any, axis_name: Any) -> Any:
  """``lax.pmax(x, axis_name)`` that also lowers under ``vmap`` on an explicit mesh."""
  return _reduce(lax.pmax, x, axis_name)
