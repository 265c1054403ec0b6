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
      learners=LEARNERS, fragments=3, mixing=0.5, overlap=1, tokens=True, steps=STEPS,
      **settings,
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


@pytest.mark.parametrize("delta_precision", [None, "I4"])
def test_shard_map_learners_by_data_parallel_matches_numpy(delta_precision):
  setup = _setup(delta_precision=delta_precision)
  optimizer = gmjax.diloco(optax.sgd(setup.lr), harness.config_of(setup),
                           axis_name="learner")
  mesh = jax.make_mesh((LEARNERS, 2), ("learner", "data"))
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


def _collectives(jaxpr):
  """(primitive, dtype, size) of every collective in ``jaxpr`` and its sub-jaxprs."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("psum", "psum_invariant", "all_gather", "all_gather_invariant"):
      for var in eqn.invars:
        found.append((eqn.primitive.name, np.dtype(var.aval.dtype), int(var.aval.size)))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "eqns"):  # a Jaxpr
          found += _collectives(sub)
        elif hasattr(getattr(sub, "jaxpr", None), "eqns"):  # a ClosedJaxpr
          found += _collectives(sub.jaxpr)
  return found


def _sync_bytes(delta_precision):
  """Bytes each learner puts on the axis in a sync (the start broadcast left out)."""
  setup = _setup(delta_precision=delta_precision)
  optimizer = gmjax.diloco(optax.sgd(setup.lr), harness.config_of(setup),
                           axis_name="learner")
  mesh = jax.make_mesh((LEARNERS, 2), ("learner", "data"))

  def body(params, state, grads):
    updates, state = optimizer.update(_first(grads), _first(state), _first(params))
    return jax.tree.map(lambda x: x[None], (updates, state))

  params = harness.stacked(setup)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  params, state = jax.device_put((params, state), NamedSharding(mesh, P("learner")))
  jaxpr = jax.make_jaxpr(jax.shard_map(
      body, mesh=mesh, in_specs=P("learner"), out_specs=P("learner")))(params, state, params)
  found = _collectives(jaxpr.jaxpr)
  start = [f for f in found if f[0].startswith("psum") and f[1] == np.float32
           and f[2] in (8, 12, 40)][:3]
  for f in start:
    found.remove(f)
  return found, sum(dtype.itemsize * size for _, dtype, size in found)


def test_quantized_deltas_cross_the_axis_as_codes():
  plain, plain_bytes = _sync_bytes(None)
  quantized, quantized_bytes = _sync_bytes("I4")
  # F32: the weighted deltas and their unit vectors (for the cosine), all leaves.
  assert plain_bytes >= 2 * 4 * (8 + 12 + 40)
  # I4: packed codes (4 bits each) and one F32 scale per block of 32, per fragment.
  gathered = [(dtype, size) for name, dtype, size in quantized if name.startswith("all_gather")]
  assert (np.dtype(np.uint8), 20) in gathered and (np.dtype(np.float32), 2) in gathered
  assert not [f for f in quantized if f[1] == np.float32 and f[2] > 2]
  assert quantized_bytes <= (8 + 12 + 40) // 2 + 4 * 4 + 4 * 8
  assert quantized_bytes * 8 < plain_bytes
