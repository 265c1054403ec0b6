"""``gmjax.diloco`` composes with optax: inside ``optax.chain`` and around other transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gmjax
import transform_harness as harness

STEPS = 9


def _run(optimizer, setup):
  params = harness.stacked(setup)
  targets = harness.stacked(setup, "targets")
  curvature = jnp.asarray(setup.curvature, jnp.float32)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(harness.learner_step(optimizer), axis_name="learner"))
  for t in range(STEPS):
    params, state = step(params, state, targets, curvature, harness.tokens_at(setup, t))
  assert step._cache_size() == 1
  return params, state


def test_wrapper_inside_chain_equals_chain_inside_wrapper():
  setup = harness.make_setup(fragments=3, overlap=1, mixing=0.5, tokens=True, steps=STEPS,
                             delta_precision="F8_E4M3")
  config = harness.config_of(setup)
  clip = lambda: optax.clip_by_global_norm(0.5)
  outside = optax.chain(clip(), gmjax.diloco(optax.adam(0.05), config, axis_name="learner"))
  inside = gmjax.diloco(optax.chain(clip(), optax.adam(0.05)), config, axis_name="learner")
  params_outside, state_outside = _run(outside, setup)
  params_inside, state_inside = _run(inside, setup)
  for name in params_inside:
    np.testing.assert_array_equal(params_outside[name], params_inside[name])
  stats = optax.tree_utils.tree_get(state_outside, "stats")
  np.testing.assert_array_equal(stats.rounds, state_inside.stats.rounds)
  assert int(stats.rounds[0]) > 0


def test_extra_args_reach_the_inner_transformation():
  seen = []

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None, *, loss=None, **extra):
    del params, extra
    seen.append(loss)
    return updates, state

  probe = optax.GradientTransformationExtraArgs(init, update)
  optimizer = gmjax.diloco(optax.chain(probe, optax.sgd(0.1)), gmjax.DiLoCo(sync_every=2))
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  optimizer.update(params, state, params, loss=jnp.float32(1.5), tokens=7)
  assert seen and float(seen[0]) == 1.5
