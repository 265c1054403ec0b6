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


def test_a_tuple_of_axes_is_manual_axes_not_nested_vmaps():
  # Two manual mesh axes hold the learners (shard_map): the same run as one vmap axis.
  # Two nested vmaps: JAX's all_gather across them failed at the first sync inside JAX.
  config = gmjax.DiLoCo(sync_every=4, overlap_steps=1, fragments=2, delta_precision="I4")
  learners = 4
  params = {"w": jnp.arange(learners * 40 * 3, dtype=jnp.float32).reshape(learners, 40, 3)
                 / 500.0, "b": jnp.ones((learners, 3))}
  shift = jnp.arange(learners, dtype=jnp.float32)

  def make(axis):
    optimizer = gmjax.diloco(optax.adam(1e-2), config, axis_name=axis)

    def step(p, s, a):
      updates, s = optimizer.update(jax.tree.map(lambda v: jnp.sin(2 * v) + a, p), s, p)
      return optax.apply_updates(p, updates), s
    return optimizer, step

  optimizer, step = make("learner")
  plain = jax.jit(jax.vmap(step, axis_name="learner"))
  p, s = params, jax.vmap(optimizer.init, axis_name="learner")(params)
  for _ in range(6):
    p, s = jax.block_until_ready(plain(p, s, shift))

  optimizer, step = make(("a", "b"))
  mesh = jax.make_mesh((2, 2), ("a", "b"))
  spec = P(("a", "b"))
  one = lambda t: jax.tree.map(lambda x: x[0], t)
  stacked = lambda t: jax.tree.map(lambda x: x[None], t)
  init = jax.jit(jax.shard_map(lambda q: stacked(optimizer.init(one(q))), mesh=mesh,
                               in_specs=spec, out_specs=spec))
  manual = jax.jit(jax.shard_map(lambda q, t, a: stacked(step(one(q), one(t), a[0])),
                                 mesh=mesh, in_specs=(spec, spec, spec),
                                 out_specs=(spec, spec)))
  place = lambda tree: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)),
                                    tree)
  q = place(params)
  t = init(q)
  for _ in range(6):
    q, t = jax.block_until_ready(manual(q, t, place(shift)))
  for a, b in zip(jax.tree.leaves((q, t.anchor)), jax.tree.leaves((p, s.anchor))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

  nested = lambda f: jax.vmap(jax.vmap(f, axis_name="b"), axis_name="a")
  grid = jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]), params)
  state = nested(optimizer.init)(grid)
  with pytest.raises(ValueError, match=r"axis_name=\('a', 'b'\) names several axes.*one"
                                       r" axis"):
    nested(lambda q, t, a: step(q, t, a))(grid, state, shift.reshape(2, 2))
