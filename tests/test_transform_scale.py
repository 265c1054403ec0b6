"""The compiled step does not grow with the learner count, nor its collectives with leaves.

Compile-only, on small trees: ``jit(vmap(step, spmd_axis_name="learner"))`` on an
explicit mesh of ``M`` learners, the outer step sharded (the default). A fragment's
leaves travel as buckets (``gmjax.transform.buckets``) and the learners are an array
dimension of every round computation (``gmjax.core.round``), so:

* the collectives of the step are the same at ``M = 2`` and ``M = 8``, and the same for
  a tree of 4 leaves and one of 16 (a few per fragment, whatever the leaf count);
* the compiled HLO text at ``M = 8`` is within 1.25x of that at ``M = 2``.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
from gmjax.transform import hlo


def _tree(leaves):
  shapes = [(8, 16), (16,), (3, 5), (40,)]
  return {f"p{i:02d}": jnp.ones(shapes[i % len(shapes)], jnp.float32)
          for i in range(leaves)}


def _compiled(config, learners, leaves):
  optimizer = gmjax.diloco(optax.adamw(1e-3), config, axis_name="learner")
  mesh = jax.make_mesh((learners,), ("learner",), devices=jax.devices()[:learners])
  sharding = NamedSharding(mesh, P("learner"))

  def step(params, state):
    updates, state = optimizer.update(params, state, params)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    params = jax.device_put(
        jax.tree.map(lambda x: jnp.stack([x] * learners), _tree(leaves)), sharding)
    init = jax.jit(jax.vmap(optimizer.init, axis_name="learner", spmd_axis_name="learner"))
    state = jax.device_put(init(params), sharding)
    text = jax.jit(jax.vmap(step, axis_name="learner", spmd_axis_name="learner")).lower(
        params, state).compile().as_text()
  names = {c.name for c in hlo.collective_bytes(text)}
  return len(text), len(names)


CONFIGS = {
    "diloco-f32": gmjax.DiLoCo(sync_every=4),
    "streaming-i4-bf16-commits": gmjax.DiLoCo(sync_every=4, fragments=2,
                                              delta_precision="I4",
                                              commit_precision="BF16"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_is_the_same_size_at_any_learner_count(name):
  small_text, small_collectives = _compiled(CONFIGS[name], 2, 8)
  large_text, large_collectives = _compiled(CONFIGS[name], 8, 8)
  assert large_collectives == small_collectives
  assert large_text <= 1.25 * small_text, (small_text, large_text)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_collectives_do_not_grow_with_leaves(name):
  _, few = _compiled(CONFIGS[name], 4, 4)
  _, many = _compiled(CONFIGS[name], 4, 16)
  assert many == few
  # Per fragment: the token counts' gather, the deltas' all-to-all (codes and scales),
  # the screening's psum, Θ's all-gather and the closing psum; plus the step's own.
  fragments = CONFIGS[name].fragments
  assert few <= 8 * fragments + 4, few
