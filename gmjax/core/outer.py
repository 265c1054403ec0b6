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
import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gmjax.core.schema import ParameterSpec
from gmjax.core.wire import F32_MAX, JNP_DTYPES, Wire

Tree = Any


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
    commit_wire: Wire,
) -> dict[str, jax.Array]:
  """``Θ_v = cast(Θ_{v-1} + decode(update), schema dtype)``, leaf by leaf."""
  decoded = commit_wire.decode_values(update, specs)
  return {
      spec.name: (theta[spec.name].astype(jnp.float32) + decoded[spec.name]).astype(
          JNP_DTYPES[spec.dtype]
      )
      for spec in specs
  }


def publish(
    master: Mapping[str, Any],
    theta: Mapping[str, Any],
    specs: Sequence[ParameterSpec],
    commit_wire: Wire,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array] | None]:
  """The published Θ of a new master, and the update a commit carries (or None).

  With ``commit_wire.precision=None``, ``Θ = cast(master, schema dtype)``. Otherwise the
  update is ``commit_wire``'s encoding of ``master − Θ_old`` and
  ``Θ = rebuild(Θ_old, update)``.
  """
  if commit_wire.precision is None:
    return {s.name: master[s.name].astype(JNP_DTYPES[s.dtype]) for s in specs}, None
  change = {s.name: master[s.name] - theta[s.name].astype(jnp.float32) for s in specs}
  update, _ = commit_wire.encode_values(change, {s.name: s.dtype for s in specs})
  return rebuild(theta, update, specs, commit_wire), update


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


@functools.partial(jax.jit, static_argnames=("specs", "commit_wire"))
def rebuild_jit(theta, update, specs, commit_wire):
  return rebuild(theta, update, specs, commit_wire)


def _option(value: Any, where: str) -> Any:
  """A JSON option value, with ``{"schedule": NAME, ...}`` built as ``optax.NAME(...)``."""
  if isinstance(value, Mapping) and "schedule" in value:
    arguments = {k: _option(v, f"{where}.{k}") for k, v in value.items() if k != "schedule"}
    name = value["schedule"]
    schedule = getattr(optax, name, None) if isinstance(name, str) else None
    if not callable(schedule):
      raise ValueError(
          f"DiLoCo {where}: schedule={name!r} is not an optax schedule; use one such as"
          " 'cosine_decay_schedule' or 'warmup_cosine_decay_schedule'."
      )
    try:
      return schedule(**arguments)
    except TypeError as error:
      raise ValueError(f"DiLoCo {where}: optax.{name}(**{arguments!r}) failed: {error}") from None
  return value


def transformation(name: str, options: Mapping[str, Any]) -> optax.GradientTransformation:
  """The outer optimizer ``optax.<name>(**options)``, as a JSON description builds it.

  An option ``{"schedule": "cosine_decay_schedule", "init_value": 0.7, ...}`` stands for
  ``optax.cosine_decay_schedule(init_value=0.7, ...)`` (e.g. as the learning rate).

  Raises:
    ValueError: ``name`` is no optax optimizer, or the options do not fit it.
  """
  built = _build(name, options)
  _check_numbers(options)
  _probe(name, options)
  return built


def takes(name: Any, argument: str) -> bool:
  """Whether ``optax.<name>`` takes ``argument`` (True where it cannot tell)."""
  factory = getattr(optax, name, None) if isinstance(name, str) else None
  try:
    parameters = inspect.signature(factory).parameters
  except (TypeError, ValueError):  # not a function (refused later), or no signature
    return True
  return argument in parameters or any(
      p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _build(name: str, options: Mapping[str, Any]) -> optax.GradientTransformation:
  """``optax.<name>(**options)``, checked to be a transformation."""
  factory = getattr(optax, name, None) if isinstance(name, str) else None
  if not callable(factory) or name.startswith("_"):
    raise ValueError(
        f"DiLoCo outer must name an optax optimizer (an attribute of optax such as 'sgd',"
        f" 'adam', 'lion'), got {name!r}."
    )
  arguments = {k: _option(v, f"outer_options.{k}") for k, v in options.items()}
  try:
    built = factory(**arguments)
  except (TypeError, ValueError) as error:
    raise ValueError(
        f"DiLoCo outer_options do not fit optax.{name}: {error}; got {dict(options)!r}."
    ) from None
  if not (hasattr(built, "init") and hasattr(built, "update")):
    raise ValueError(
        f"DiLoCo outer: optax.{name}(...) is not a GradientTransformation, got {built!r}."
    )
  return built


# Options optax takes as a rate in [0, 1) (a momentum, a moment's decay), where it takes
# them at all.
_RATES = ("momentum", "b1", "b2", "decay")


def _check_numbers(options: Mapping[str, Any]) -> None:
  """Raises a ValueError for a learning rate that is not a positive number (or a
  schedule), or a rate outside ``[0, 1)``: optax takes either and steps wrongly, or
  fails only when it first steps (a string)."""
  for key, value in options.items():
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if key == "learning_rate" and isinstance(value, Mapping):
      _check_schedule(value)
    elif key == "learning_rate" and not (number and 0 < value <= F32_MAX):
      raise ValueError(
          f"DiLoCo outer_options.learning_rate must be a positive number (at most F32's"
          f" largest) or a schedule ({{'schedule': 'cosine_decay_schedule', ...}}), got"
          f" {value!r}.")
    if key == "nesterov" and not isinstance(value, bool):  # "false" would mean True
      raise ValueError(f"DiLoCo outer_options.nesterov must be true or false, got {value!r}.")
    if key in _RATES and value is not None and not (number and 0 <= value < 1):
      raise ValueError(f"DiLoCo outer_options.{key} must be a number in [0, 1), got {value!r}.")


# Outer steps a schedule's rate is read at: a schedule that turns negative, vanishes or
# overflows within a run's rounds does so by one of them.
_SCHEDULE_STEPS = (0, 1, 10, 100, 10**3, 10**4, 10**5, 10**6)


def _check_schedule(value: Mapping[str, Any]) -> None:
  """Raises a ValueError for a learning-rate schedule that gives a negative, non-finite
  or too large rate at one of ``_SCHEDULE_STEPS``, or zero at all of them, as a number
  would be refused."""
  schedule = _option(value, "outer_options.learning_rate")
  if not callable(schedule):
    raise ValueError(
        f"DiLoCo outer_options.learning_rate must be a positive number or a schedule"
        f" ({{'schedule': 'cosine_decay_schedule', ...}}), got {dict(value)!r}.")
  try:
    rates = {t: float(schedule(t)) for t in _SCHEDULE_STEPS}
  except Exception as error:  # pylint: disable=broad-except
    # The schedule's own code on a step count: its arguments do not fit.
    raise ValueError(
        f"DiLoCo outer_options.learning_rate: the schedule {dict(value)!r} fails on an outer"
        f" step count ({type(error).__name__}: {error}); check its arguments against"
        f" optax.{value.get('schedule')}'s.") from None
  bad = {t: r for t, r in rates.items() if not 0 <= r <= F32_MAX}
  if bad or not any(rates.values()):
    raise ValueError(
        f"DiLoCo outer_options.learning_rate: the schedule {dict(value)!r} gives"
        f" {bad or rates} at outer steps {list(bad or rates)}; a rate must be in"
        f" [0, {F32_MAX:.4g}] at every step and positive at some (a negative one moves Θ"
        " against the learners' progress, zero throws it away).")


@functools.lru_cache(maxsize=64)
def _probed(name: str, options: str) -> str | None:
  """Why ``optax.<name>(**options)`` (``options`` as JSON) fails a step, or None."""
  built = _build(name, json.loads(options))
  probe = jax.ShapeDtypeStruct((2,), jnp.float32)
  try:
    jax.eval_shape(lambda p: built.update(p, built.init(p), p), probe)
  except Exception as error:  # pylint: disable=broad-except
    # Any failure of the optimizer's own code on a plain vector: the options do not fit.
    return f"{type(error).__name__}: {error}"
  # An optimizer moves against the gradient: a few steps on a constant one (from 0.5: a
  # scale by the parameters' norm, fromage's or lars', needs some; 64 values: noisy_sgd's
  # noise averages out). A transformation that is not one (identity, clip,
  # scale_by_adam, set_to_zero, ...) would move Θ with the learners' deltas reversed, or
  # not at all. A step may overflow (a rate near F32's largest): that is a direction too.
  params = jnp.full(64, 0.5, jnp.float32)
  gradient = jnp.ones(64, jnp.float32)
  state, moved = built.init(params), 0.0
  for _ in range(_DIRECTION_STEPS):
    updates, state = built.update(gradient, state, params)
    moved += float(jnp.vdot(updates, gradient))
    params = params + updates
  # A schedule may hold its rate at zero for the first steps (a warmup that begins
  # later): then only moving along the gradient is refused (its values are checked).
  scheduled = any(isinstance(v, Mapping) for v in json.loads(options).values())
  if moved > 0 or (moved == 0 and not scheduled):
    return (f"{_NOT_AN_OPTIMIZER}: {_DIRECTION_STEPS} steps on a constant gradient"
            f" of ones moved along it by {moved:.6g} in all, where an optimizer moves"
            " against it")
  return None


_DIRECTION_STEPS = 4
_NOT_AN_OPTIMIZER = "is not an optimizer"


def _probe(name: str, options: Mapping[str, Any]) -> None:
  """Raises a ValueError if ``optax.<name>(**options)`` cannot take one (abstract) step
  on an F32 vector, so that options of the wrong type fail where they are written, not
  at the first round (the result is kept per JSON of the options)."""
  problem = _probed(name, json.dumps(dict(options), sort_keys=True))
  if problem is not None and problem.startswith(_NOT_AN_OPTIMIZER):
    raise ValueError(
        f"DiLoCo outer={name!r} (outer_options {dict(options)!r}) {problem}; name an optax"
        " optimizer, e.g. 'sgd', 'adam' or 'lion'.")
  if problem is not None:
    raise ValueError(
        f"DiLoCo outer_options do not fit optax.{name}: a step on a probe vector fails"
        f" ({problem}); got {dict(options)!r}.")


def apply_outer(
    transform: optax.GradientTransformation, gradient: Tree, state: Any, master: Tree,
    with_updates: bool = False,
) -> tuple[Tree, Any] | tuple[Tree, Any, Tree]:
  """One outer step: ``master ← master + transform.update(g, state, master)``, in F32.

  The outer gradient ``g`` is taken as a gradient (SGD moves against it). Returns
  ``(new_master, new_state)``, and with ``with_updates`` the updates in F32 too
  (``new_master`` is ``master + updates``).
  """
  updates, state = transform.update(gradient, state, master)
  updates = jax.tree.map(lambda u: u.astype(jnp.float32), updates)
  new_master = jax.tree.map(lambda m, u: (m + u).astype(jnp.float32), master, updates)
  if with_updates:
    return new_master, state, updates
  return new_master, state
