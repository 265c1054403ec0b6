"""``gmjax.diloco`` on bf16 parameters: dtypes stay put, results track the numpy loop."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

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
