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


@pytest.mark.parametrize("changed", [{"overlap_steps": 0}, {"overlap_steps": 1},
                                     {"sync_every": 8}], ids=["tau0", "tau1", "H8"])
def test_a_merge_left_pending_by_a_changed_schedule_comes_before_the_next_sync(changed):
  # A state saved between a sync and its merge (overlap_steps=2), continued under another
  # schedule: the merge's step had passed, so the learners never adopted Θ1, and the
  # next round took their delta against it, folding round 0's outer step into it.
  learners = 2

  def make(**settings):
    config = gmjax.DiLoCo(**{"sync_every": 4, "overlap_steps": 2, **settings})
    optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")

    def step(params, state, x):
      grads = jax.grad(lambda p: jnp.mean((x @ p["w"] - 1.0) ** 2))(params)
      updates, state = optimizer.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return optimizer, jax.jit(jax.vmap(step, axis_name="learner"))

  batch = lambda t: jax.random.normal(jax.random.key(t), (learners, 8, 4))
  optimizer, step = make()
  params = {"w": jnp.zeros((learners, 4, 1))}
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  for t in range(5):  # round 0 syncs at step 4, its merge due at step 6
    params, state = step(params, state, batch(t))
  assert np.asarray(state.pending).tolist() == [[1]] * learners
  theta_1 = np.asarray(state.anchor["w"])
  _, step = make(**changed)
  for t in range(5, 8):  # the next sync is step 8 under every schedule here
    params, state = step(params, state, batch(t))
  # The merge came first: every learner stood on Θ1 (to the rounding of θ = params +
  # updates), so each sent a zero delta (0.196 before).
  assert np.asarray(state.stats.rounds).tolist() == [2] * learners
  assert (np.asarray(state.stats.delta_norm) < 1e-6).all(), state.stats.delta_norm
  assert not np.array_equal(np.asarray(state.anchor["w"]), theta_1)  # momentum moved Θ
  if changed.get("overlap_steps") == 0:  # merged at once: the learners stand on Θ2
    assert np.asarray(state.pending).tolist() == [[0]] * learners
    np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(state.anchor["w"]),
                               rtol=1e-6, atol=1e-7)
