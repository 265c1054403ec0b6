"""The outer step: momentum SGD on the F32 master, publishing Θ, rebuilding it, aligning.

All functions are pure and traceable: the mail closer calls them jitted on host values,
the in-mesh transformation calls them inside its jitted step, and a learner rebuilds Θ
from a commit's update with the very same function the closer used.

References:
  Douillard et al., *DiLoCo*, arXiv 2311.08105 (outer Nesterov, η=0.7, μ=0.9).
  Douillard et al., *Streaming DiLoCo*, arXiv 2501.18512 (fragments, mixing, quantization).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gmjax.core.codec import _JNP, decode_values, _encode_values
from gmjax.core.records import Precision
from gmjax.core.schema import ParameterSpec

Tree = Any


def weighted_sum(deltas: Sequence[Tree], weights: Sequence[Any]) -> Tree:
  """``Σ_m w_m · Δ_m`` in F32, summed in the given (sorted learner) order."""
  total = None
  for delta, weight in zip(deltas, weights):
    term = jax.tree.map(lambda d, w=weight: jnp.float32(w) * d.astype(jnp.float32), delta)
    total = term if total is None else jax.tree.map(jnp.add, total, term)
  return total


def outer_step(
    gradient: Tree,
    momentum: Tree,
    master: Tree,
    *,
    learning_rate: float,
    momentum_coef: float,
    nesterov: bool,
) -> tuple[Tree, Tree]:
  """One outer SGD step in the torch convention, in F32.

  ``u ← μ·u + g``; Nesterov: ``master ← master − η·(g + μ·u)``; plain:
  ``master ← master − η·u``. Here ``η`` is ``learning_rate`` and ``μ`` ``momentum_coef``.

  Returns:
    ``(new_master, new_momentum)``.
  """
  lr = jnp.float32(learning_rate)
  mu = jnp.float32(momentum_coef)
  new_momentum = jax.tree.map(lambda u, g: mu * u + g, momentum, gradient)
  if nesterov:
    new_master = jax.tree.map(
        lambda m, g, u: m - lr * (g + mu * u), master, gradient, new_momentum
    )
  else:
    new_master = jax.tree.map(lambda m, u: m - lr * u, master, new_momentum)
  return new_master, new_momentum


def rebuild(
    theta: Mapping[str, Any],
    update: Mapping[str, Any],
    specs: Sequence[ParameterSpec],
    precision: Precision,
) -> dict[str, jax.Array]:
  """``Θ_v = cast(Θ_{v-1} + decode(update), schema dtype)``, leaf by leaf."""
  decoded = decode_values(update, specs, precision)
  return {
      spec.name: (theta[spec.name].astype(jnp.float32) + decoded[spec.name]).astype(
          _JNP[spec.dtype]
      )
      for spec in specs
  }


def publish(
    master: Mapping[str, Any],
    theta: Mapping[str, Any],
    specs: Sequence[ParameterSpec],
    commit_precision: Precision,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array] | None]:
  """The published Θ of a new master, and the update a commit carries (or None).

  With ``commit_precision=None``, ``Θ = cast(master, schema dtype)``. Otherwise the update is
  ``encode(master − Θ_old, commit_precision)`` and ``Θ = rebuild(Θ_old, update)``.
  """
  if commit_precision is None:
    return {s.name: master[s.name].astype(_JNP[s.dtype]) for s in specs}, None
  change = {s.name: master[s.name] - theta[s.name].astype(jnp.float32) for s in specs}
  update, _ = _encode_values(change, {s.name: s.dtype for s in specs}, commit_precision)
  return rebuild(theta, update, specs, commit_precision), update


def pseudo_gradient(anchor: Tree, theta: Tree) -> Tree:
  """``Δ = anchor − θ`` in F32, leaf by leaf: the delta a learner publishes."""
  return jax.tree.map(
      lambda a, t: jnp.asarray(a).astype(jnp.float32) - jnp.asarray(t).astype(jnp.float32),
      anchor,
      theta,
  )


def align(theta: Tree, anchor: Tree, mixing: float) -> Tree:
  """``mixing·θ + (1 − mixing)·Θ`` in F32, returned at θ's dtype; ``Θ`` itself at 0."""
  if mixing == 0:
    return jax.tree.map(lambda t, a: a.astype(t.dtype), theta, anchor)
  m = jnp.float32(mixing)
  return jax.tree.map(
      lambda t, a: (m * t.astype(jnp.float32) + (1 - m) * a.astype(jnp.float32)).astype(
          t.dtype
      ),
      theta,
      anchor,
  )


@functools.partial(jax.jit, static_argnames=("specs", "precision"))
def rebuild_jit(theta, update, specs, precision):
  return rebuild(theta, update, specs, precision)
