"""``gmjax.diloco`` on bf16 parameters: dtypes stay put, results track the numpy loop."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gmjax

import transform_harness as harness
import transform_reference as reference

STEPS = 9


def test_bf16_parameters_stay_bf16_and_follow_numpy():
  setup = harness.make_setup(fragments=3, overlap=1, mixing=0.5, tokens=True, steps=STEPS,
                             dtype=ml_dtypes.bfloat16)
  params, state, step = harness.run_vmap(setup, STEPS, dtype=jnp.bfloat16)
  assert step._cache_size() == 1
  for leaf in jax.tree.leaves(params) + jax.tree.leaves(state.anchor):
    assert leaf.dtype == jnp.bfloat16
  # The outer step is sharded (the default): each learner holds its shard, F32.
  for leaf in jax.tree.leaves(state.master) + jax.tree.leaves(state.outer_state):
    assert leaf.dtype == jnp.float32
  # Every bf16 leaf keeps an F32 master: each fragment (one leaf here) one bucket of
  # its rows, a learner's part (F=1, R, 32) of it.
  assert len(jax.tree.leaves(state.master)) == len(harness.SHAPES)
  assert state.master[setup.plan.index(("c",))][0].shape == (3, 1, 1, 32)
  assert state.count.dtype == jnp.int32 and state.stats.rounds.dtype == jnp.int32
  expected = reference.run(setup, STEPS)
  for m in range(3):
    harness.assert_tree_close({n: v[m] for n, v in params.items()}, expected["theta"][m],
                              rtol=3e-2, atol=3e-2, what=f"learner {m}")
  master = harness.masters(setup, state, sharded=True)
  harness.assert_tree_close(master, expected["master"], rtol=3e-2, atol=3e-2, what="master")
  # The published anchor is the master rounded to bf16.
  for name, value in master.items():
    np.testing.assert_array_equal(
        np.asarray(state.anchor[name][0]), np.asarray(value).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_partially_manual_shard_map_starts_every_learner_at_learner_0s_bits(dtype):
  # bf16 parameters aborted the process: the first update broadcast learner 0's
  # parameters with a 16-bit float all-reduce, which XLA:CPU's promotion of it crashed
  # on under a partially manual shard_map. A float sum also made learner 0's -0.0 a 0.0.
  mesh = jax.make_mesh((2, 2), ("learner", "fsdp"), devices=jax.devices()[:4],
                       axis_types=(AxisType.Auto,) * 2)
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2), axis_name="learner")
  start = jnp.asarray([-0.0, 1.5, -2.25, 3.0, 0.0, -7.0, 1e-3], dtype)
  params = {"w": jnp.stack([start, start + 1])}  # learner 1 starts elsewhere
  first = lambda tree: jax.tree.map(lambda v: v[0], tree)
  stack = lambda tree: jax.tree.map(lambda v: v[None], tree)

  def train_step(params, state):
    grads = jax.tree.map(lambda p: jnp.sin(p.astype(jnp.float32)).astype(p.dtype), params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  manual = lambda f: jax.shard_map(f, mesh=mesh, in_specs=P("learner"),
                                   out_specs=P("learner"), axis_names={"learner"})
  with jax.set_mesh(mesh):
    state = jax.jit(manual(lambda p: stack(optimizer.init(first(p)))))(params)
    step = jax.jit(manual(lambda p, s: stack(train_step(*first((p, s))))))
    for count in range(3):
      params, state = jax.block_until_ready(step(params, state))
      if count == 0:
        # Read on the host: an index of the device array is itself a sum over the
        # learners' devices, which makes -0.0 a 0.0.
        bits = np.asarray(state.anchor["w"]).view(f"uint{8 * np.dtype(dtype).itemsize}")
        want = np.asarray(start).view(bits.dtype)
        for m in range(2):
          np.testing.assert_array_equal(bits[m], want)
  assert int(state.stats.rounds[0]) == 1
  assert params["w"].dtype == dtype and bool(jnp.all(jnp.isfinite(params["w"])))


def test_a_bf16_delta_is_taken_from_the_parameters_the_learner_holds():
  # XLA kept θ = params + updates in F32 where the delta read it (excess precision on
  # CPU): Θ differed by a bf16 ulp in 6 of 64 values from the one the learner's own bf16
  # parameters make. With one step of overlap they are the sync step's output.
  bf16, outer_lr = jnp.bfloat16, 0.5
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(
      sync_every=2, overlap_steps=1, outer_learning_rate=outer_lr, outer_momentum=0.0))
  rng = np.random.default_rng(0)
  start = rng.normal(size=64).astype(ml_dtypes.bfloat16)
  goal = (rng.normal(size=64) * 3).astype(np.float32)

  @jax.jit
  def step(params, state):
    grads = {"w": (params["w"].astype(jnp.float32) - goal).astype(bf16)}
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = {"w": jnp.asarray(start)}
  state = optimizer.init(params)
  for _ in range(2):
    params, state = step(params, state)
  theta = np.asarray(params["w"]).astype(np.float32)  # what the learner holds at the sync
  anchor = start.astype(np.float32)
  delta = (anchor - theta).astype(ml_dtypes.bfloat16).astype(np.float32)
  expected = (anchor - np.float32(outer_lr) * delta).astype(ml_dtypes.bfloat16)
  assert int(state.stats.rounds) == 1
  np.testing.assert_array_equal(np.asarray(state.anchor["w"]), expected)
