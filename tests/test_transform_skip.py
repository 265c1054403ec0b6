"""A round with no delta to aggregate, or whose outer step is not finite, is skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax


@pytest.mark.parametrize("overlap", [0, 1])
def test_round_without_a_kept_delta_is_skipped_and_learners_reset(overlap):
  # Every learner jumps far away: their deltas overflow F16 on the wire, so each is
  # rejected (one such learner alone is left out: tests/test_transform_screen.py) while
  # every learner's parameters are still finite.
  config = gmjax.DiLoCo(sync_every=4, delta_precision="F16",
                        overlap_steps=overlap, mixing=0.5)
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")
  learners = 3
  start = {"w": jnp.linspace(-1.0, 1.0, 6), "b": jnp.ones(2)}
  params = jax.tree.map(lambda p: jnp.stack([p] * learners), start)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)

  def one(params, state, poison):
    grads = jax.tree.map(lambda p: jnp.where(poison, -1e6, p), params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(one, axis_name="learner"))
  no = jnp.zeros(learners, bool)
  for t in range(1, 4 + overlap + 1):
    poison = jnp.full(learners, t == 3)
    params, state = step(params, state, poison)
  stats = jax.tree.map(lambda x: int(x[0]) if x.dtype == jnp.int32 else x[0], state.stats)
  assert stats.rounds == 1 and stats.skipped == 1 and stats.rejected == learners
  for name, value in start.items():
    np.testing.assert_array_equal(state.anchor[name][0], value)  # no outer step
    for m in range(learners):  # reset, not mixed
      np.testing.assert_allclose(params[name][m], value, atol=1e-2)

  for _ in range(4):
    params, state = step(params, state, no)
  assert int(state.stats.rounds[0]) == 2 and int(state.stats.skipped[0]) == 1
  assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(params))
  assert step._cache_size() == 1


@pytest.mark.parametrize("shard_outer", [True, False], ids=["sharded", "replicated"])
def test_non_finite_outer_result_is_skipped(shard_outer):
  # Every delta is finite (g = 2 everywhere), but the outer step η·(g + μ·u) with
  # η = 3e38 overflows the F32 master to -inf: the round is dropped after the step.
  config = gmjax.DiLoCo(sync_every=2, outer_learning_rate=3e38, overlap_steps=0)
  optimizer = gmjax.diloco(optax.sgd(1.0), config, axis_name="learner",
                           shard_outer=shard_outer)
  learners = 2
  start = {"w": jnp.linspace(-1.0, 1.0, 40, dtype=jnp.float32)}
  params = jax.tree.map(lambda p: jnp.stack([p] * learners), start)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  initial_outer = state.outer_state

  def one(params, state):
    updates, state = optimizer.update(jax.tree.map(jnp.ones_like, params), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(one, axis_name="learner"))
  for _ in range(2):
    params, state = jax.block_until_ready(step(params, state))
  assert int(state.stats.rounds[0]) == 1 and int(state.stats.skipped[0]) == 1
  np.testing.assert_allclose(state.stats.delta_norm[0], 2.0 * np.sqrt(40), rtol=1e-6)
  np.testing.assert_array_equal(state.anchor["w"][0], start["w"])  # anchor kept
  for kept, initial in zip(jax.tree.leaves(state.outer_state), jax.tree.leaves(initial_outer)):
    np.testing.assert_array_equal(kept, initial)  # no outer step kept
  for m in range(learners):  # reset to the anchor, by an additive update (one rounding)
    np.testing.assert_allclose(params["w"][m], start["w"], rtol=0, atol=1e-6)
  assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(state))


@pytest.mark.parametrize("shard_outer", [True, False])
@pytest.mark.parametrize("commit_precision", [None, "F8_E4M3", "F16", "F32"])
def test_a_round_whose_theta_overflows_the_parameters_dtype_is_skipped(commit_precision,
                                                                      shard_outer):
  # F16 parameters near their largest value: the new F32 master is finite, Θ at F16 is
  # not. With a commit precision only the update was checked, and Θ = inf was kept (the
  # parameters inf, then NaN); the mail closer skipped the round.
  config = gmjax.DiLoCo(sync_every=1, commit_precision=commit_precision)
  optimizer = gmjax.diloco(optax.sgd(1.0), config, axis_name="learner",
                           shard_outer=shard_outer)

  def step(params, state, grads):
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = {"w": jnp.full((2, 4), 65000.0, jnp.float16)}
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  grads = {"w": jnp.full((2, 4), -500.0, jnp.float16)}  # each delta -500: Θ past 65504
  params, state = jax.jit(jax.vmap(step, axis_name="learner"))(params, state, grads)
  assert state.stats.skipped.tolist() == [1, 1] and state.stats.rounds.tolist() == [1, 1]
  np.testing.assert_array_equal(np.asarray(state.anchor["w"], np.float32), 64992.0)
  assert bool(jnp.all(jnp.isfinite(params["w"])))
