"""``gmjax.diloco`` refuses what it cannot run, with messages that say how to fix it."""

import dataclasses

import jax

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax


def test_public_names():
  assert gmjax.diloco is not None
  assert {"diloco", "DiLoCoState", "DiLoCoStatistics"} <= set(gmjax.__all__)


def test_overlap_none_is_refused():
  config = gmjax.DiLoCo(sync_every=4, overlap_steps=None)
  with pytest.raises(ValueError, match="overlap_steps=None"):
    gmjax.diloco(optax.sgd(0.1), config)


def test_config_and_inner_types_are_checked():
  with pytest.raises(TypeError, match="gmjax.DiLoCo"):
    gmjax.diloco(optax.sgd(0.1), {"sync_every": 4})
  with pytest.raises(TypeError, match="GradientTransformation"):
    gmjax.diloco("adam", gmjax.DiLoCo(sync_every=4))


def test_update_needs_params_and_scalar_tokens():
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4))
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  with pytest.raises(ValueError, match="needs params"):
    optimizer.update(params, state)
  with pytest.raises(ValueError, match="tokens must be one number"):
    optimizer.update(params, state, params, tokens=jnp.ones(2))


def test_initial_state():
  config = dataclasses.replace(gmjax.DiLoCo(sync_every=6, fragments=2), mixing=0.5)
  params = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros(4)}
  state = gmjax.diloco(optax.adam(1e-3), config).init(params)
  assert isinstance(state, gmjax.DiLoCoState)
  assert state.count.dtype == jnp.int32 and int(state.count) == 0
  assert state.anchor["w"].dtype == jnp.bfloat16
  assert state.master["w"].dtype == jnp.float32
  assert isinstance(state.master["b"], optax.MaskedNode)  # F32: Θ is its own master
  assert state.pending.shape == (2,) and state.tokens.shape == (2,)
  assert int(state.stats.rounds) == 0 and int(state.stats.fragment) == -1
  assert np.isnan(state.stats.cosine)


def test_state_shares_no_buffer_with_params():
  config = gmjax.DiLoCo(sync_every=4, commit_precision="I4")
  params = {"w": jnp.ones((3, 2)), "h": jnp.ones(4, jnp.bfloat16)}
  state = gmjax.diloco(optax.sgd(0.1), config).init(params)
  pointers = lambda tree: {x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}
  assert not pointers(params) & pointers((state.anchor, state.master))
  assert not pointers(state.anchor) & pointers(state.master)
