"""Record names of outer optimizer states: the seed's for SGD, derived ones otherwise."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax
from gmjax.core import outer_records
from gmjax.core.aggregator import DiLoCoAggregator

PARAMS = {"dense/kernel": jnp.ones((2, 3)), "norm.scale": jnp.ones(4)}


@pytest.mark.parametrize(
    "outer, transform, names",
    [("sgd", optax.sgd(0.7, momentum=0.9, nesterov=True),
      ["momentum.dense/kernel", "momentum.norm.scale"]),
     ("sgd", optax.sgd(0.7), []),
     ("sgd", optax.sgd(optax.linear_schedule(1.0, 0.0, 10), momentum=0.5),
      ["momentum.dense/kernel", "momentum.norm.scale", "outer.1.count"]),
     ("adam", optax.adam(0.1),
      ["outer.0.count", "outer.0.mu.dense/kernel", "outer.0.mu.norm.scale",
       "outer.0.nu.dense/kernel", "outer.0.nu.norm.scale"]),
     ("lion", optax.lion(0.1), ["outer.0.count", "outer.0.mu.dense/kernel",
                                "outer.0.mu.norm.scale"]),
     # Only optax.sgd's trace keeps the seed's name: another optimizer's is derived.
     ("chain", optax.chain(optax.trace(0.9), optax.scale(-0.1)),
      ["outer.0.trace.dense/kernel", "outer.0.trace.norm.scale"])],
)
def test_names_and_round_trip(outer, transform, names):
  aliases = outer_records.seed_aliases(outer)
  state = transform.init(PARAMS)
  assert sorted(outer_records.record_names(state, aliases)) == names
  # A state a few steps on survives flatten → host numpy → unflatten, leaf for leaf.
  for _ in range(2):
    _, state = transform.update(PARAMS, state, PARAMS)
  records = {k: np.asarray(v) for k, v in outer_records.flatten(state, aliases).items()}
  records["master.norm.scale"] = np.zeros(4, np.float32)  # other records are ignored
  back = outer_records.unflatten(records, transform.init(PARAMS), aliases)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_unflatten_is_traceable():
  transform = optax.adam(0.1)
  aliases = outer_records.seed_aliases("adam")

  @jax.jit
  def step(records, gradient):
    template = jax.eval_shape(transform.init, gradient)
    state = outer_records.unflatten(records, template, aliases)
    _, state = transform.update(gradient, state, gradient)
    return outer_records.flatten(state, aliases)

  records = outer_records.flatten(transform.init(PARAMS), aliases)
  records = step(records, PARAMS)
  records = step(records, PARAMS)
  assert int(records["outer.0.count"]) == 2 and records["outer.0.count"].dtype == jnp.int32


def test_unflatten_refuses_missing_and_misshapen_records():
  transform = optax.adam(0.1)
  template = transform.init(PARAMS)
  records = outer_records.flatten(template)
  with pytest.raises(ValueError, match="lacks record 'outer.0.count'"):
    outer_records.unflatten({k: v for k, v in records.items() if k != "outer.0.count"},
                            template)
  with pytest.raises(ValueError, match=r"'outer.0.mu.norm.scale' has shape \(5,\)"):
    outer_records.unflatten({**records, "outer.0.mu.norm.scale": jnp.zeros(5)}, template)


def test_colliding_record_names_refused():
  state = {"mu": {"a.b": jnp.zeros(1)}, "mu.a": {"b": jnp.zeros(1)}}
  with pytest.raises(ValueError, match="both map to the record name 'outer.mu.a.b'"):
    outer_records.flatten(state)


def test_initial_state_records():
  tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)}
  schema = gmjax.Schema.from_tree(tree)
  sgd = DiLoCoAggregator(gmjax.DiLoCo(sync_every=2), schema).initial_state(tree)
  assert sorted(sgd.outer) == ["momentum.b", "momentum.w"]
  adam = DiLoCoAggregator(gmjax.DiLoCo(sync_every=2, outer="adam", commit_precision="BF16"),
                          schema).initial_state(tree)
  assert sorted(adam.outer) == ["master.b", "master.w", "outer.0.count", "outer.0.mu.b",
                                "outer.0.mu.w", "outer.0.nu.b", "outer.0.nu.w"]
  np.testing.assert_array_equal(adam.outer["master.w"], tree["w"])
  assert all(isinstance(v, np.ndarray) for v in adam.outer.values())
