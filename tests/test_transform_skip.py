"""A round whose aggregated delta is not finite skips the outer step and resets learners."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax


@pytest.mark.parametrize("overlap", [0, 1])
def test_non_finite_round_is_skipped_and_learners_reset(overlap):
  # Learner 1 jumps far away: its delta overflows F16 on the wire, so the aggregate is
  # not finite while every learner's parameters still are.
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
    poison = no.at[1].set(t == 3)
    params, state = step(params, state, poison)
  stats = jax.tree.map(lambda x: int(x[0]) if x.dtype == jnp.int32 else x[0], state.stats)
  assert stats.rounds == 1 and stats.skipped == 1
  assert not np.isfinite(stats.delta_norm)
  for name, value in start.items():
    np.testing.assert_array_equal(state.anchor[name][0], value)  # no outer step
    pass
    for m in range(learners):  # reset, not mixed
      np.testing.assert_allclose(params[name][m], value, atol=1e-2 if m == 1 else 1e-7)

  for _ in range(4):
    params, state = step(params, state, no)
  assert int(state.stats.rounds[0]) == 2 and int(state.stats.skipped[0]) == 1
  assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(params))
  assert step._cache_size() == 1
