"""A ``DiLoCoState`` saved with Orbax and restored continues exactly as the original."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import gmjax
import transform_harness as harness


@pytest.mark.parametrize("commit_precision", [None, "I4"])
def test_restored_state_continues_identically(tmp_path, commit_precision):
  setup = harness.make_setup(fragments=3, overlap=2, mixing=0.5, tokens=True, steps=12,
                             commit_precision=commit_precision)
  optimizer = gmjax.diloco(optax.adam(0.05), harness.config_of(setup), axis_name="learner")
  step = jax.jit(jax.vmap(harness.learner_step(optimizer), axis_name="learner"))
  targets = harness.stacked(setup, "targets")
  curvature = jnp.asarray(setup.curvature, jnp.float32)
  params = harness.stacked(setup)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  for t in range(5):  # stops between a sync and its merge
    params, state = step(params, state, targets, curvature, harness.tokens_at(setup, t))
  assert int(state.pending.max()) > 0

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", {"params": params, "state": state})
  checkpointer.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
  restored = checkpointer.restore(tmp_path / "state", abstract)
  restored_params, restored_state = restored["params"], restored["state"]
  assert jax.tree.structure(restored_state) == jax.tree.structure(state)

  for t in range(5, 12):
    params, state = step(params, state, targets, curvature, harness.tokens_at(setup, t))
    restored_params, restored_state = step(
        restored_params, restored_state, targets, curvature, harness.tokens_at(setup, t))
  for a, b in zip(jax.tree.leaves((params, state)),
                  jax.tree.leaves((restored_params, restored_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
