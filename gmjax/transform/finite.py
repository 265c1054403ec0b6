"""Dropping a learner's step that would make its parameters non-finite.

A NaN or Inf in one learner's update (a NaN gradient, a bf16 overflow) would stay in its
parameters for good: ``gmjax.diloco`` returns additive updates, and ``NaN + (Θ − NaN)``
is NaN, so no later merge could repair them. So every step checks, for each learner and
its whole tree at once, ``params + updates`` formed leaf by leaf at the parameters'
dtype as ``optax.apply_updates`` forms it, with the updates marked NaN wherever a
gradient was not finite: one fused reduction a leaf (``gmjax.core.round.
non_finite_flag``), no mask. If any value is NaN or Inf, the step is dropped:

* its update is zero (on a sync or merge step, the merge still applies);
* its learner's next delta of every fragment is withheld
  (``gmjax.transform.tokens.WITHHELD``), and the round treats it as the non-finite delta
  the step would have made: the screening rejects it, its error-feedback residual
  restarts at zeros, and the learner rejoins Θ at the fragment's merge.

The inner optimizer runs on the gradients with each NaN or Inf replaced by zero (as
``optax.zero_nans`` does for NaN), so that its state stays finite: the state is updated
in place, and keeping the one from before the step would copy it on every step. After
a NaN loss, whose gradients are all NaN, it steps on zeros (with momentum, its moments
decay by one step).

Each learner decides for itself. Only the dropping of the update needs every learner's
verdict, among the rare steps (``lax.cond``), whose predicate under ``vmap`` is the
maximum over the learners' axis that the step count already takes (one all-reduce of
two scalars); under ``shard_map`` and ``pmap`` it needs no collective.

Parameters that already hold a NaN or Inf fail the check on every step and cannot be
repaired through ``optax.apply_updates`` (``NaN + u`` is NaN for every ``u``): replace
them with ``state.anchor`` (or ``gmjax.finish``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gmjax.core import round as round_ops
from gmjax.transform import explicit


def _floating(x: Any) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)


def finite_gradients(grads: Any) -> Any:
  """``grads`` with each NaN or Inf replaced by zero (elementwise: it fuses into the
  inner optimizer's update)."""
  return jax.tree.map(
      lambda g: jnp.where(jnp.isfinite(g), g, jnp.zeros_like(g)) if _floating(g) else g,
      grads)


def marked(updates: Any, grads: Any) -> Any:
  """``updates``, NaN wherever the gradient is not finite.

  ``u − (g − g)`` is ``u`` exactly (signed zeros included) for a finite ``g``, and NaN
  otherwise; elementwise, it fuses into the inner optimizer's update.
  """

  def mark(u, g):
    if not (_floating(u) and _floating(g)):
      return u
    return u - (jnp.asarray(g) - g).astype(jnp.asarray(u).dtype)  # a Python float too

  return jax.tree.map(mark, updates, grads)


def applied(p: jax.Array, u: jax.Array) -> jax.Array:
  """``p + u`` at ``p``'s dtype, rounded to it as ``optax.apply_updates`` stores it.

  XLA may keep a 16-bit float sum in F32 where an F32 operation reads it (excess
  precision, on CPU): ``reduce_precision`` rounds it to the dtype's bits there too, so
  that a delta or a finiteness check reads the parameters the learner holds.
  """
  result = (p + u).astype(p.dtype)
  if jnp.issubdtype(result.dtype, jnp.floating) and jnp.finfo(result.dtype).bits == 16:
    info = jnp.finfo(result.dtype)
    result = lax.reduce_precision(result, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  return result


def non_finite(params: Any, updates: Any) -> jax.Array:
  """Whether ``params + updates`` (each leaf at its parameter's dtype) holds a NaN or
  Inf anywhere in the tree: a bool scalar."""
  results = [applied(p, u)
             for p, u in zip(jax.tree.leaves(params), jax.tree.leaves(updates))]
  return round_ops.count_non_finite(results, explicit.total) > 0
