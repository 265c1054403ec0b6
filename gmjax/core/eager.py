"""Delayed outer gradients and eager updates, the parts both runtimes share.

With ``outer_delay = 1`` (Kale et al., Algorithm "delayed outer gradients") a learner
that ends inner phase ``k`` of a fragment sends ``Δ_k = S_k − θ`` (``S_k``: the phase's
start) and starts phase ``k + 1`` at once from ``S_{k+1} = Θ_{k−1}``, the fragment's
Θ after the outer step on round ``k − 1``'s aggregate ``g_{k−1}``, which had the whole
phase ``k`` to arrive. The closer (mail) or the sync (in-mesh) still computes
``Θ_k = outer(Θ_{k−1}, g_k)`` as in DiLoCo: only the learner's start lags one round.

Eager updates (``eager=True``) let each learner apply its own fresh delta as a proxy
for its stale share of the aggregate. Learner ``m``'s outer gradient at phase ``k`` is

    g̃_{m,k} = g_{k−1} − w_{m,k−1}·Δ_{m,k−1} + w_{m,k−1}·Δ_{m,k},

the paper's mixture of the current local outer gradient with the delayed ones of all
the other learners (``w = 1/M`` there; here the weight the learner had in round
``k − 1``, ``1/M`` before any round, with ``M`` the learners), and each learner runs its
own outer optimizer on ``g̃``. For an outer optimizer that is linear in its gradients
(SGD with or without (Nesterov) momentum, at a constant learning rate) that start splits
exactly into the shared part and a learner-local one:

    S_{m,k+1} = Θ_{k−1} + p_{m,k+1},    (u, c_m) ← outer.update(d_{m,k}, c_m),
    p_{m,k+1} = p_{m,k} + u,            d_{m,k} = w_{m,k−1}·(Δ_{m,k} − Δ_{m,k−1}),

where ``c_m`` is an outer-optimizer state of the learner's own (zeros at first): the
shared Θ is committed once for everyone and each learner keeps ``p``, ``c``, its last
decoded delta and its weight (16 bytes per parameter). The deltas here are the decoded
ones that travel (with error feedback, the compensated ones), so that the stale share
the learner subtracts is the one the aggregate holds.

References:
  Kale, Douillard and Donchev, *Eager Updates For Overlapped Communication and
  Computation in DiLoCo*, arXiv 2502.12996.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gmjax.core import round as round_ops


def check(config: Any) -> None:
  """Checks ``config.outer_delay`` and ``config.eager`` against the rest of ``config``.

  Raises:
    ValueError: ``outer_delay`` not 0 or 1; ``eager`` not a bool, or True without
      ``outer_delay=1``; a delay with ``overlap_steps`` other than 0 or with mixing;
      ``eager`` with an outer optimizer other than SGD at a constant learning rate.
  """
  delay = config.outer_delay
  if type(delay) is not int or delay not in (0, 1):  # 1.0 would be recorded as 1.0
    raise ValueError(
        f"DiLoCo outer_delay must be 0 (DiLoCo) or 1 (delayed outer gradients), got"
        f" {delay!r}.")
  if not isinstance(config.eager, bool):
    raise ValueError(f"DiLoCo eager must be a bool, got {config.eager!r}.")
  if config.eager and delay != 1:
    raise ValueError(
        f"DiLoCo eager=True needs outer_delay=1, got outer_delay={delay!r}: eager updates"
        " stand in for the round still in flight, which only a delayed outer step has;"
        " set outer_delay=1 or eager=False.")
  if delay == 0:
    return
  if config.overlap_steps != 0:
    raise ValueError(
        f"DiLoCo outer_delay=1 overlaps the exchange with a whole inner phase, so it needs"
        f" overlap_steps=0, got overlap_steps={config.overlap_steps!r}; set overlap_steps=0"
        " or outer_delay=0.")
  if config.mixing != 0:
    raise ValueError(
        f"DiLoCo outer_delay=1 starts each phase at the delayed Θ (its delta counts the"
        f" whole phase), so it needs mixing=0, got mixing={config.mixing!r}; set mixing=0"
        " or outer_delay=0.")
  if config.eager:
    options = dict(config.outer_options or {})
    if config.outer != "sgd" or any(isinstance(v, Mapping) for v in options.values()):
      raise ValueError(
          f"DiLoCo eager=True runs each learner's correction through its own copy of the"
          f" outer optimizer, which is exact only for an outer step linear in its"
          f" gradients: outer='sgd' at a constant learning rate, got outer={config.outer!r}"
          f" with outer_options={options!r}; use outer='sgd' without a schedule, or"
          " eager=False.")


def proxy(sent: Mapping[str, Any], previous: Mapping[str, Any], weight: Any) -> dict:
  """``d = w·(Δ_k − Δ_{k−1})`` leaf by leaf, F32: the learner's own part of ``g̃``."""
  w = jnp.asarray(weight, jnp.float32)
  return {n: w * (jnp.asarray(v, jnp.float32) - jnp.asarray(previous[n], jnp.float32))
          for n, v in sent.items()}


def correct(tx: optax.GradientTransformation, d: Mapping[str, Any], state: Any,
            correction: Mapping[str, Any], names: tuple[str, ...]) -> tuple[dict, Any]:
  """``(p + u, c)`` with ``(u, c) = tx.update(d, state)``, over the fragment ``names``.

  ``state`` is ``tx``'s state over the tuple of the fragment's leaves (``tx.init`` of
  zeros); returns the new correction (name → F32) and the new state.
  """
  updates, state = tx.update(tuple(d[n] for n in names), state,
                             tuple(correction[n] for n in names))
  return {n: correction[n] + u for n, u in zip(names, updates)}, state


def start_finite(theta: Mapping[str, Any], correction: Mapping[str, Any]) -> jax.Array:
  """Whether the start ``Θ + p`` is finite at each parameter's dtype (a bool scalar).

  Θ is committed only when finite, but a learner's own outer step can overflow (a large
  outer learning rate, a huge delta): a correction that would make its start, and so its
  parameters, non-finite is dropped (``restart``), and the learner starts at Θ.
  """
  dtype = lambda x: jnp.asarray(x).dtype
  return finite({n: (jnp.asarray(theta[n], jnp.float32) + c).astype(dtype(theta[n]))
                 for n, c in correction.items()})


def restart(tx: optax.GradientTransformation, keep: Any, correction: Mapping[str, Any],
            state: Any, names: tuple[str, ...], where: Any = jnp.where) -> tuple[dict, Any]:
  """``(correction, state)`` where ``keep``, else zeros and ``tx``'s state of zeros (as
  a learner that joins starts): ``where(keep, kept, dropped)`` chooses, leaf by leaf."""
  zeros = {n: jnp.zeros_like(correction[n]) for n in names}
  fresh = initial_state(tx, zeros, names)
  return ({n: where(keep, correction[n], zeros[n]) for n in names},
          jax.tree.map(lambda a, b: where(keep, a, b), state, fresh))


def initial_state(tx: optax.GradientTransformation, zeros: Mapping[str, Any],
                  names: tuple[str, ...]) -> Any:
  """``tx``'s state over the fragment's leaves, from F32 zeros like them."""
  return tx.init(tuple(zeros[n] for n in names))


def first_weight(learners: int) -> float:
  """The weight of a learner's first fresh delta: ``1/M``."""
  return 1.0 / max(1, int(learners))


def finite(tree: Mapping[str, Any]) -> jax.Array:
  """Whether every value of ``tree`` is finite (a bool scalar)."""
  return round_ops.count_non_finite(tree.values()) == 0
