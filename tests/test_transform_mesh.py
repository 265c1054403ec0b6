"""``gmjax.diloco`` across devices: shard_map (learners × data parallel) and pmap."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
import transform_harness as harness
import transform_reference as reference

STEPS = 9
LEARNERS = 4


def _setup(**settings):
  return harness.make_setup(
      learners=LEARNERS, fragments=3, tokens=True, steps=STEPS,
      **{"mixing": 0.5, "overlap": 1, **settings},
  )


def _first(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _shard_map_step(optimizer, mesh):
  """A step on a (learner, data) mesh: each learner's batch is split over ``data``."""

  def body(params, state, targets, curvature, tokens):
    params, state, targets = _first(params), _first(state), _first(targets)
    grads = jax.lax.pmean(harness.grads_of(params, targets, curvature[0]), "data")
    updates, state = optimizer.update(grads, state, params, tokens=tokens[0])
    new = optax.apply_updates(params, updates)
    return jax.tree.map(lambda x: x[None], (new, state))

  return jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=P("learner"), out_specs=P("learner")
  ))


def _check(setup, params, state):
  params, state = jax.device_get((params, state))
  expected = reference.run(setup, STEPS)
  for m in range(LEARNERS):
    harness.assert_tree_close({n: v[m] for n, v in params.items()}, expected["theta"][m],
                              what=f"learner {m}")
  harness.assert_tree_close({n: v[m] for n, v in state.anchor.items()}, expected["anchor"],
                            what="anchor")
  np.testing.assert_allclose(np.asarray(state.stats.cosine),
                             expected["log"][-1]["cosine"], atol=1e-5)


DELAYED = {"outer_delay": 1, "mixing": 0.0, "overlap": 0}


@pytest.mark.parametrize("delta_precision,shard,settings,axis_type", [
    (None, True, {}, "explicit"),
    ("I4", False, {}, "explicit"),
    (None, True, {**DELAYED, "eager": True}, "explicit"),
    ("F8_E4M3", False, DELAYED, "auto"),
])
def test_shard_map_learners_by_data_parallel_matches_numpy(delta_precision, shard, settings,
                                                           axis_type):
  setup = _setup(delta_precision=delta_precision, **settings)
  optimizer = gmjax.diloco(optax.sgd(setup.lr), harness.config_of(setup),
                           axis_name="learner", shard_outer=shard)
  kind = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
  mesh = jax.make_mesh((LEARNERS, 2), ("learner", "data"), axis_types=(kind[axis_type],) * 2)
  sharding = NamedSharding(mesh, P("learner"))
  params = harness.stacked(setup)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  params, state, targets, curvature = jax.device_put(
      (params, state, harness.stacked(setup, "targets"),
       jnp.asarray(setup.curvature, jnp.float32)), sharding)
  step = _shard_map_step(optimizer, mesh)
  for t in range(STEPS):
    tokens = jax.device_put(harness.tokens_at(setup, t), sharding)
    params, state = jax.block_until_ready(step(params, state, targets, curvature, tokens))
    if t == 1:
      # The first call's inputs carry the spec P("learner"), the outputs the equivalent
      # P("learner", None, ...): one more entry, and then no more.
      compiled = step._cache_size()
  _check(setup, params, state)
  assert step._cache_size() == compiled <= 2


def test_pmap_matches_numpy():
  setup = _setup(delta_precision="F8_E4M3", nesterov=False)
  optimizer = gmjax.diloco(optax.sgd(setup.lr), harness.config_of(setup),
                           axis_name="learner")
  step = jax.pmap(harness.learner_step(optimizer), axis_name="learner",
                  devices=jax.devices()[:LEARNERS])
  params = harness.stacked(setup)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  targets = harness.stacked(setup, "targets")
  curvature = jnp.asarray(setup.curvature, jnp.float32)
  for t in range(STEPS):
    params, state = jax.block_until_ready(
        step(params, state, targets, curvature, harness.tokens_at(setup, t)))
  _check(setup, params, state)
