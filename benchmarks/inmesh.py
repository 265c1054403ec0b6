"""Shared set-up of the in-mesh benchmarks: fake CPU devices, layouts, a learner step.

Imported by ``sync_bytes.py``, ``outer_state_memory.py`` and ``transform_overhead.py``
(run from the repository root, so this directory is on ``sys.path``).
"""

from __future__ import annotations

import inspect
import os
import re

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import gmjax


def fake_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` CPU devices; call before JAX creates its CPU client."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def layouts() -> list[tuple[str, dict]]:
  """``(label, diloco keyword arguments)`` of each outer-step layout ``gmjax.diloco`` has."""
  if "shard_outer" not in inspect.signature(gmjax.diloco).parameters:
    return [("replicated", {})]
  return [("sharded", {"shard_outer": True}), ("replicated", {"shard_outer": False})]


def learner_step(optimizer, mesh, *, count=None, donate=False):
  """``jit(shard_map(step))`` over ``mesh``'s ``"learner"`` axis, stacked by learner.

  ``step(params, state, grads)`` applies ``optimizer.update`` and returns the new params
  and state; every argument carries a leading learner dimension.

  Args:
    optimizer: a ``gmjax.diloco`` transformation on ``axis_name="learner"``.
    mesh: a mesh with a ``"learner"`` axis.
    count: if set, the state's step counter is replaced by this constant inside the
      step, so XLA folds the schedule's branches at compile time and the compiled step
      holds only what that step runs (``count > 0``: no first-update broadcast).
    donate: donate the parameters and state, as training loops do.
  """
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)

  def body(params, state, grads):
    params, state, grads = first(params), first(state), first(grads)
    if count is not None:
      state = state._replace(count=jnp.asarray(count, state.count.dtype))
    updates, state = optimizer.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    return jax.tree.map(lambda a: a[None], (new, state))

  return jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=P("learner"), out_specs=P("learner")),
      donate_argnums=(0, 1) if donate else (),
  )


def learner_init(optimizer, mesh):
  """``jit(shard_map(optimizer.init))`` on parameters stacked by learner over ``mesh``.

  Call it, or pass it to ``jax.eval_shape`` for the state's shapes without building it.
  """
  body = lambda p: jax.tree.map(
      lambda a: a[None], optimizer.init(jax.tree.map(lambda a: a[0], p)))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("learner"),
                               out_specs=P("learner")))
