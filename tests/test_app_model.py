"""The demo job's inner step compiles once: its first call's state and its later ones'
are placed alike."""

import os

import jax
import numpy as np
import pytest

from gmjax.app import config as config_lib
from gmjax.app import model, worker


def test_the_inner_step_compiles_once():
  cfg = config_lib.load(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                     "quickstart.toml"))
  small = model.ModelConfig(d_model=16, layers=1, heads=2, mlp=32, seq_len=8)
  graphdef, params = model.build(small, seed=0)
  params = jax.device_put(params, jax.devices()[0])  # as learner.pull returns them
  optimizer = worker.inner_optimizer(cfg, 0)
  train_step, _ = model.make_train_step(graphdef, optimizer)
  state = model.init_state(optimizer, params)
  batch = np.zeros((2, small.seq_len + 1), np.int32)
  for _ in range(3):
    params, state, _ = train_step(params, state, batch)
  assert train_step._cache_size() == 1  # pylint: disable=protected-access


@pytest.mark.parametrize("config", [model.ModelConfig(), model.ModelConfig(
    vocab=300, d_model=16, layers=3, heads=2, mlp=40, seq_len=10)])
def test_parameter_count_is_the_built_models(config):
  # The config check bounds the model by this count, computed from the sizes alone.
  _, params = model.build(config)
  assert model.parameter_count(config) == sum(p.size for p in jax.tree.leaves(params))
