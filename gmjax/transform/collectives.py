"""The learners' collectives of a round, as XLA keeps the other mesh axes' split.

Under ``shard_map`` with only the learners' axis manual (the other axes, FSDP or tensor
parallel, left to XLA), XLA (jax 0.10) all-gathers an operand over the auto axes before
an ``all_to_all``, ``all_gather`` or ``reduce_scatter`` over the manual axis, which
would gather an FSDP-sharded delta onto every device; a ``ppermute`` (and a ``psum``) it
leaves in place. There these collectives are ``M − 1`` ``ppermute``s of one piece each,
which send the same bytes; everywhere else they are the plain ``lax`` collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gmjax.transform import explicit


def all_to_all(arrays: Sequence[jax.Array], axis_name: Any, axis: int = 1
               ) -> list[jax.Array]:
  """``all_to_all`` of each array's dimension ``axis`` (size ``M``, tiled) over
  ``axis_name``: piece ``j`` goes to learner ``j``, which puts it at this learner's index."""
  if not explicit.partially_manual(axis_name):
    return list(lax.all_to_all(list(arrays), axis_name, axis, axis, tiled=True))
  learners = arrays[0].shape[axis]
  me = lax.axis_index(axis_name)
  out = []
  for x in arrays:
    result = x  # chunk ``me`` is this learner's own
    for shift in range(1, learners):
      chunk = lax.dynamic_index_in_dim(x, (me + shift) % learners, axis)
      got = lax.ppermute(chunk, axis_name, [(j, (j + shift) % learners)
                                            for j in range(learners)])
      result = lax.dynamic_update_index_in_dim(result, got, (me - shift) % learners, axis)
    out.append(result)
  return out


def all_gather(arrays: Sequence[jax.Array], axis_name: Any, learners: int, axis: int = 1
               ) -> list[jax.Array]:
  """``all_gather`` of each array over ``axis_name`` along a new dimension ``axis``
  (``M``)."""
  if not explicit.partially_manual(axis_name):
    return list(lax.all_gather(list(arrays), axis_name, axis=axis, tiled=False))
  me = lax.axis_index(axis_name)
  out = []
  for x in arrays:
    mine = jnp.expand_dims(x, axis)
    entries = explicit.spec(x)
    result = explicit.zeros((*x.shape[:axis], learners, *x.shape[axis:]), x.dtype,
                            None if entries is None else
                            (*entries[:axis], None, *entries[axis:]))
    result = lax.dynamic_update_index_in_dim(result, mine, me, axis)
    for shift in range(1, learners):
      got = lax.ppermute(mine, axis_name, [(j, (j + shift) % learners)
                                           for j in range(learners)])
      result = lax.dynamic_update_index_in_dim(result, got, (me - shift) % learners, axis)
    out.append(result)
  return out
