"""Conditionals that update the state in place.

XLA compiles a ``lax.cond``/``lax.switch`` whose branches return the state (changed in
one branch, passed through in the others) with a copy of every value a branch returns
unchanged: into a temporary buffer inside the branch, and out of it again into the
donated output. For the optimizer's state that is a copy of the whole state on every
step, and as much scratch as the state. A ``while_loop`` that runs its body zero times
or once is the same conditional for a state the loop carries in place: what the body
does not change is never copied, and what it changes is written where it lies.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, PartitionSpec


_NO_READS = object()


def when(condition: Any, fn: Callable[..., Any], operand: Any, *,
         reads: Any = _NO_READS) -> Any:
  """``fn(operand)`` if the scalar ``condition`` holds, else ``operand``, in place.

  ``fn`` must return a value of ``operand``'s structure, shapes, dtypes and types.
  With ``reads`` (values from outside that ``fn`` reads but does not change) it is
  ``fn(operand, reads)``, and ``reads`` enter the loop behind an optimization barrier
  with its carry: XLA's loop-invariant code motion would otherwise compute what ``fn``
  derives from them alone before the loop, on every step, and hold it there (a bf16
  leaf's F32 conversion: a whole F32 buffer per leaf in the step's scratch).
  """
  if reads is not _NO_READS:
    return when(condition, lambda value: fn(*lax.optimization_barrier((value, reads))),
                operand)
  if isinstance(condition, bool):
    return fn(operand) if condition else operand
  condition = jnp.asarray(condition, bool)
  trips = condition.astype(jnp.int32)

  def body(carry):
    done, value = carry
    return done + 1, _on_mesh(fn(value))

  return lax.while_loop(lambda carry: carry[0] < trips, body,
                        (jnp.int32(0), _on_mesh(operand)))[1]


def _on_mesh(tree: Any) -> Any:
  """``tree`` with every value that carries no mesh laid out on the current explicit
  mesh (replicated): ``vmap(..., spmd_axis_name=...)`` batches a loop's values by
  naming the learners' axis in their mesh (JAX 0.10), which a value made without one
  (a scalar count computed in the step) lacks."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
    return tree

  def one(x):
    have = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if have is not None and have.empty:
      return jax.sharding.reshard(x, PartitionSpec(*([None] * jnp.ndim(x))))
    return x

  return jax.tree.map(one, tree)
