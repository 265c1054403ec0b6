"""``gmjax.diloco`` on a ``(learner, fsdp, tensor)`` mesh with Megatron-style leaves.

Weights are split on their first dimension over ``fsdp`` and on their last over
``tensor``. A sync must move data only between learners: every gather and all-to-all
of the compiled step has replica groups along the ``learner`` axis alone (read from the
groups' device ids, mapped to mesh coordinates), and what crosses is a quarter of what
the same learners send without the other axes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
import transform_harness as harness
from gmjax.transform import hlo

LEARNERS = 2
# w1: columns split over tensor in runs of 64 values (whole rows of 32·M); w2: runs of
# 32 (whole codec blocks only); b: split over tensor on its only dimension.
SHAPES = {"w1": (64, 128), "w2": (128, 64), "b": (128,)}
SPECS = {"w1": P("learner", "fsdp", "tensor"), "w2": P("learner", "fsdp", "tensor"),
         "b": P("learner", "tensor")}


def _run(mesh_shape, config, steps=6):
  rng = np.random.default_rng(0)
  one = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
  params = {n: np.stack([v] * LEARNERS) for n, v in one.items()}
  targets = {n: rng.standard_normal((LEARNERS, *s)).astype(np.float32)
             for n, s in SHAPES.items()}
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")
  step = harness.learner_step(optimizer, with_tokens=False)
  names = ("learner", "fsdp", "tensor")[:len(mesh_shape)]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Explicit,) * len(names))
  specs = {n: P(*(a if a in names else None for a in s)) for n, s in SPECS.items()}
  with jax.set_mesh(mesh):
    put = lambda tree: {n: jax.device_put(v, NamedSharding(mesh, specs[n]))
                        for n, v in tree.items()}
    params, targets = put(params), put(targets)
    curvature = jax.device_put(jnp.ones([LEARNERS], jnp.float32),
                               NamedSharding(mesh, P("learner")))
    jitted = jax.jit(jax.vmap(step, axis_name="learner", spmd_axis_name="learner"))
    state = jax.vmap(optimizer.init, axis_name="learner")(params)
    text = jitted.lower(params, state, targets, curvature, None).compile().as_text()
    for _ in range(steps):
      params, state = jax.block_until_ready(jitted(params, state, targets, curvature, None))
  return mesh, text, params, state


@pytest.mark.parametrize("config", [
    gmjax.DiLoCo(sync_every=3, delta_precision="I4"),
    gmjax.DiLoCo(sync_every=3, delta_precision="F8_E4M3", commit_precision="F8_E4M3"),
], ids=["i4", "f8-commits"])
def test_tensor_parallel_sync_moves_data_between_learners_only(config):
  mesh, text, params, state = _run((LEARNERS, 2, 2), config)
  _, alone_text, alone, _ = _run((LEARNERS,), config)
  collectives = hlo.collective_bytes(text)
  assert collectives
  for c in collectives:
    for group in c.groups:
      axes = hlo.spanned_axes(mesh, group)
      if c.op == "all-reduce" and c.bytes <= 64:
        continue  # partial sums of the screening (norms, Gram entries, counts)
      assert axes <= {"learner"}, f"{c.op} {c.shape} over {axes}: {c.op_name}"
  # Each device sends a quarter of what a device of the learner-only mesh sends.
  over_learners = hlo.total_bytes_sent(c for c in collectives if c.bytes > 64)
  alone_bytes = hlo.total_bytes_sent(c for c in hlo.collective_bytes(alone_text)
                                     if c.bytes > 64)
  assert over_learners <= alone_bytes / 4 * 1.05, (over_learners, alone_bytes)
  for name in SHAPES:
    assert tuple(params[name].sharding.spec) == tuple(SPECS[name])
    assert tuple(state.anchor[name].sharding.spec) == tuple(SPECS[name])
    np.testing.assert_allclose(np.asarray(params[name]), np.asarray(alone[name]),
                               rtol=2e-5, atol=2e-6, err_msg=name)
