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
from jax.sharding import AxisType


def when(condition: Any, fn: Callable[[Any], Any], operand: Any) -> Any:
  """``fn(operand)`` if the scalar ``condition`` holds, else ``operand``, in place.

  ``fn`` must return a value of ``operand``'s structure, shapes, dtypes and types.
  """
  if isinstance(condition, bool):
    return fn(operand) if condition else operand
  condition = jnp.asarray(condition, bool)
  trips = condition.astype(jnp.int32)

  def body(carry):
    done, value = carry
    return done + 1, fn(value)

  if _explicit(operand):
    # ``vmap(..., spmd_axis_name=...)`` cannot batch a loop over values laid out on an
    # explicit mesh (JAX 0.10 names the learners' axis in a mesh the loop's values do
    # not carry): there, a ``lax.cond``, which copies what it passes through.
    return lax.cond(condition, fn, lambda x: x, operand)
  return lax.while_loop(lambda carry: carry[0] < trips, body, (jnp.int32(0), operand))[1]


def _explicit(tree: Any) -> bool:
  """Whether a value of ``tree`` is laid out on an explicit mesh."""
  for leaf in jax.tree.leaves(tree):
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and AxisType.Explicit in tuple(mesh.axis_types):
      return True
  return False
