"""The learners' collectives of a round, as XLA keeps the other mesh axes' split.

Under ``shard_map`` with only the learners' axis manual (the other axes, FSDP or tensor
parallel, left to XLA), XLA (jax 0.10.2) all-gathers an operand over the auto axes
before an ``all_to_all``, ``all_gather`` or ``reduce_scatter`` over the manual axis,
which would gather an FSDP-sharded delta onto every device; a ``ppermute`` (and a
``psum``) it leaves in place. There these collectives run on each device's own piece of
the operand, one collective an array whatever the number of learners ``M``, with the
bytes of the plain ``lax`` collective:

* ``all_to_all`` in a ``shard_map`` nested in the partially manual one that makes the
  other axes manual too: each device exchanges its piece with the devices that hold the
  same piece on the other learners (one ``lax.all_to_all`` over the learners' axis).
  The pieces are the operand's split over the other axes: on an explicit mesh its
  sharding's; on an Auto mesh, where XLA chooses the split as it propagates, the first
  dimension before the exchanged one that the other axes divide, which is the rows of a
  bucket (``gmjax.transform.buckets``: ``(1, S, M, …)`` there), as XLA lays them out
  from an FSDP split of the parameters' leading dimension. That split is then fixed:
  the rows of a leaf that was replicated over the other axes are split for the
  exchange too (sending less), and XLA may keep the leaf split after the step. An
  operand with no such dimension is exchanged whole on every device (gathered over the
  other axes if XLA had split it).
* ``all_gather`` likewise in a nested ``shard_map`` on an explicit mesh; on an Auto
  mesh as a ring, which fixes no split: ``M − 1`` turns of a ``fori_loop`` whose one
  ``ppermute`` passes the piece last received on to the next learner (the compiled
  step holds one ``collective-permute`` an array, run ``M − 1`` times:
  ``gmjax.transform.hlo.trip_counts``).

Everywhere else (``vmap``, ``shard_map`` with every axis manual, ``pmap``) they are the
plain ``lax`` collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gmjax.transform import explicit


def _other_axes() -> tuple[str, ...]:
  """The mesh axes of size > 1 that are not manual here (XLA partitions them)."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types)
               if t != AxisType.Manual and mesh.shape[n] > 1)


def _pieces(x: jax.Array, axis: int, new_axis: bool, others: tuple[str, ...]) -> tuple:
  """``x``'s split over ``others``, one entry a dimension.

  On an explicit mesh, its sharding's (the exchanged dimension whole); on an Auto mesh,
  the first dimension before ``axis`` that ``others`` divide (none: ``x`` is whole).
  """
  entries = explicit.spec(x)
  if entries is not None:
    kept = []
    for entry in entries:
      names = [n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in others]
      kept.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    if not new_axis:  # a split of the exchanged dimension would exchange parts of pieces
      kept[axis] = None
    return tuple(kept)
  mesh = jax.sharding.get_abstract_mesh()
  devices = math.prod(mesh.shape[n] for n in others)
  split = others if len(others) > 1 else others[0]
  for dim, size in enumerate(x.shape[:axis]):
    if size % devices == 0:
      return (*(None,) * dim, split, *(None,) * (x.ndim - dim - 1))
  return (None,) * x.ndim


def _each_piece(exchange, arrays: Sequence[jax.Array], axis: int, new_axis: bool
                ) -> list[jax.Array]:
  """``exchange`` of every array, run on each device's pieces with every axis manual.

  Args:
    exchange: the collective over the learners' axis, of one array.
    arrays: the operands.
    axis: the exchanged dimension (``all_to_all``) or the position of the new one
      (``all_gather``), never split over the other axes.
    new_axis: whether ``exchange`` inserts a dimension at ``axis``.

  Returns:
    The results, split over the other axes as the operands are.
  """
  others = _other_axes()
  ins = [_pieces(x, axis, new_axis, others) for x in arrays]
  outs = [(*s[:axis], None, *s[axis:]) if new_axis else s for s in ins]
  body = lambda xs: [exchange(x) for x in xs]
  return list(jax.shard_map(body, in_specs=([P(*s) for s in ins],),
                            out_specs=[P(*s) for s in outs],
                            axis_names=set(others))(list(arrays)))


def all_to_all(arrays: Sequence[jax.Array], axis_name: Any, axis: int = 1
               ) -> list[jax.Array]:
  """Each array's dimension ``axis`` (size ``M``) exchanged by a tiled ``all_to_all``.

  Args:
    arrays: this learner's operands; piece ``j`` of dimension ``axis`` goes to learner
      ``j``.
    axis_name: the learners' axis.
    axis: the exchanged dimension.

  Returns:
    The results, shaped as the operands: learner ``j``'s piece for this learner at
    index ``j`` of dimension ``axis``.
  """
  if not explicit.partially_manual(axis_name):
    return list(lax.all_to_all(list(arrays), axis_name, axis, axis, tiled=True))
  exchange = lambda x: lax.all_to_all(x, axis_name, axis, axis, tiled=True)
  return _each_piece(exchange, arrays, axis, new_axis=False)


def all_gather(arrays: Sequence[jax.Array], axis_name: Any, learners: int, axis: int = 1
               ) -> list[jax.Array]:
  """``all_gather`` of each array over ``axis_name`` along a new dimension ``axis``.

  Args:
    arrays: this learner's operands.
    axis_name: the learners' axis.
    learners: ``M``, the axis' size.
    axis: where the new dimension (size ``M``) goes.

  Returns:
    The results: learner ``j``'s operand at index ``j`` of dimension ``axis``.
  """
  if not explicit.partially_manual(axis_name):
    return list(lax.all_gather(list(arrays), axis_name, axis=axis, tiled=False))
  if all(explicit.spec(x) is not None for x in arrays):
    exchange = lambda x: lax.all_gather(x, axis_name, axis=axis, tiled=False)
    return _each_piece(exchange, arrays, axis, new_axis=True)
  return _ring_gather(arrays, axis_name, learners, axis)


def _ring_gather(arrays: Sequence[jax.Array], axis_name: Any, learners: int, axis: int
                 ) -> list[jax.Array]:
  """``all_gather`` as a ring: ``M − 1`` turns of a loop, each passing the piece last
  received on to the next learner (one ``ppermute``, the same bytes in all)."""
  me = lax.axis_index(axis_name)
  ring = [(j, (j + 1) % learners) for j in range(learners)]
  mine = [jnp.expand_dims(x, axis) for x in arrays]
  out = [lax.dynamic_update_index_in_dim(
      jnp.zeros((*x.shape[:axis], learners, *x.shape[axis:]), x.dtype), m, me, axis)
         for x, m in zip(arrays, mine)]

  def turn(shift, carry):
    out, pieces = carry
    pieces = lax.ppermute(pieces, axis_name, ring)
    out = [lax.dynamic_update_index_in_dim(o, p, (me - shift) % learners, axis)
           for o, p in zip(out, pieces)]
    return out, pieces

  return lax.fori_loop(1, learners, turn, (out, mine))[0]
