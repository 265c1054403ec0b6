"""Schemas: names from pytree paths, dtypes, round trips and rejected names."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import optax
from flax import nnx

import gmjax


class Pair(NamedTuple):
  left: jax.Array
  right: jax.Array


def test_names_sorted_and_joined():
  tree = {"params": {"dense": {"kernel": jnp.zeros((2, 3)), "bias": jnp.zeros(3)}},
          "layers": [jnp.zeros(1, jnp.bfloat16), (jnp.zeros(2, jnp.float16),)],
          "pair": Pair(jnp.zeros(4), jnp.zeros(5))}
  schema = gmjax.Schema.from_tree(tree)
  assert schema.names == ("layers/0", "layers/1/0", "pair/left", "pair/right",
                          "params/dense/bias", "params/dense/kernel")
  assert schema["layers/0"].dtype == "BF16" and schema["layers/1/0"].dtype == "F16"
  assert schema["params/dense/kernel"].shape == (2, 3)
  assert schema.nbytes == 4 * (6 + 3 + 4 + 5) + 2 + 4
  flat = schema.flatten(tree)
  assert set(flat) == set(schema.names)
  back = schema.unflatten(flat)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  assert isinstance(back["pair"], Pair)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    assert a is b


class Block(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(2, 3, rngs=rngs)
    self.norm = nnx.LayerNorm(3, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(2)])


def test_nnx_state():
  state = nnx.state(Block(nnx.Rngs(0)), nnx.Param)
  schema = gmjax.Schema.from_tree(state)
  assert schema.names == ("dense/bias", "dense/kernel", "layers/0/bias", "layers/0/kernel",
                          "layers/1/bias", "layers/1/kernel", "norm/bias", "norm/scale")
  flat = schema.flatten(state)
  doubled = schema.unflatten({k: v * 2 for k, v in flat.items()})
  np.testing.assert_array_equal(
      np.asarray(schema.flatten(doubled)["dense/kernel"]), 2 * np.asarray(flat["dense/kernel"])
  )
  entries = gmjax.encode(state, "BF16")
  back = gmjax.decode(entries, schema, "BF16")
  assert jax.tree.structure(back) == jax.tree.structure(state)


@pytest.mark.parametrize(
    "tree",
    [{"w": jnp.zeros(2), "momentum.w": jnp.zeros(2)},
     {"w": jnp.zeros(2), "master.w": jnp.zeros(2)},
     {"w": jnp.zeros(2), "w.scale": jnp.zeros(2)},
     {"w": jnp.zeros(2), "w.index": jnp.zeros(2)},
     {"a/b": jnp.zeros(2), "a": {"b": jnp.zeros(2)}},
     {"w": jnp.zeros(2), "outer.0.mu.w": jnp.zeros(2)},
     {"outer.0.count": jnp.zeros(())},
     {"__metadata__": jnp.zeros(3)}],  # a payload's header key: the file would not load
)
def test_colliding_names_rejected(tree):
  with pytest.raises(ValueError, match="rename"):
    gmjax.Schema.from_tree(tree)


def test_dtypes():
  with pytest.raises(ValueError, match="'count'"):
    gmjax.Schema.from_tree({"count": jnp.zeros(2, jnp.int32)})
  with pytest.raises(ValueError):
    gmjax.Schema.from_tree({"x": np.zeros(2, np.int64)})
  # A PRNG key's dtype is none numpy knows: named like any other, not a TypeError.
  with pytest.raises(ValueError, match=r"'rng' has dtype key<fry>.*nnx.Param"):
    gmjax.Schema.from_tree({"rng": jax.random.key(0), "w": jnp.zeros(3)})
  schema = gmjax.Schema.from_tree({"x": np.zeros(3, np.float64)})
  assert schema["x"].dtype == "F32"
  with pytest.raises(ValueError):
    gmjax.Schema.from_tree({})


def test_json_and_subset():
  schema = gmjax.Schema.from_tree({"a": jnp.zeros((2, 2)), "b": jnp.zeros(3, jnp.bfloat16)})
  again = gmjax.Schema.from_json(schema.to_json())
  assert again == schema and again.treedef is None
  assert schema.subset(["b"]).names == ("b",)
  with pytest.raises(KeyError):
    schema.subset(["zzz"])
  with pytest.raises(ValueError):
    schema.flatten({"a": jnp.zeros((2, 2))})
  with pytest.raises(ValueError):
    again.unflatten({})


class CountingName(str):
  """A leaf name that counts the comparisons made with it."""

  comparisons = 0

  def _count(self, other, compare):
    CountingName.comparisons += 1
    return compare(str(self), other)

  def __eq__(self, other):
    return self._count(other, str.__eq__)

  def __lt__(self, other):
    return self._count(other, str.__lt__)

  def __gt__(self, other):
    return self._count(other, str.__gt__)

  __hash__ = str.__hash__


def test_building_and_lookups_are_indexed():
  n = 3000
  rng = np.random.default_rng(0)
  names = [CountingName(f"layers/{i}/w") for i in rng.permutation(n)]
  specs = tuple(gmjax.ParameterSpec(name, "F32", (2,)) for name in names)
  CountingName.comparisons = 0
  schema = gmjax.Schema(specs)
  # A sort (n·log2(n) comparisons) and a linear pass; counting duplicates name by name
  # (n² = 9,000,000) would be far above this.
  assert CountingName.comparisons <= 2 * n * np.log2(n) + 4 * n
  CountingName.comparisons = 0
  for name in names:
    assert schema[str(name)].name == name and str(name) in schema
  assert CountingName.comparisons <= 4 * n
  assert "layers/x" not in schema
  with pytest.raises(KeyError):
    schema["layers/x"]


def test_many_leaves():
  tree = {f"block{i}": {"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)}
          for i in range(10_000)}
  schema = gmjax.Schema.from_tree(tree)
  assert len(schema) == 20_000 and schema["block9999/w"].shape == (2,)
  assert schema.unflatten(schema.flatten(tree)).keys() == tree.keys()


def test_a_tree_without_arrays_is_refused_saying_what_to_pass():
  # gmjax.diloco(...).init({}) said only "Schema.from_tree got a tree with no array
  # leaves.", naming neither what was given nor what to give.
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2))
  with pytest.raises(ValueError, match=r"no array leaves \(dict \{\}\): pass the parameters"):
    optimizer.init({})


@pytest.mark.parametrize("spec, match", [
    (("w", "F32", (-64,)), "shape must be a tuple of non-negative ints"),
    (("w", "F32", (4.0,)), "shape must be a tuple of non-negative ints"),
    (("w", "F32", 4), "shape must be a tuple of non-negative ints"),
    (("w", "F64", (4,)), r"dtype='F64' is not one of \[.*'F32'"),
])
def test_a_spec_is_checked_as_it_is_made(spec, match):
  # A negative dimension gave a layout of -256 bytes; an unknown dtype code failed with a
  # bare KeyError at the first plan; a fractional dimension was taken.
  with pytest.raises(ValueError, match=match):
    gmjax.ParameterSpec(*spec)
  assert gmjax.ParameterSpec("w", "F32", [np.int64(4), 2]).shape == (4, 2)
  with pytest.raises(ValueError, match=r"entry must be \[name, dtype, shape\]"):
    gmjax.Schema.from_json([["a", "F32"]])
  with pytest.raises(ValueError, match="non-negative"):
    gmjax.Schema.from_json([["a", "F32", [-1]]])


def test_an_empty_key_named_like_another_leaf_is_said_so():
  # The message blamed keys containing '/' only.
  with pytest.raises(ValueError, match=r"duplicate leaf names \['_'\].*an empty key .* is"
                                       r" named '_'"):
    gmjax.Schema.from_tree({"": jnp.ones(2), "_": jnp.ones(2)})
