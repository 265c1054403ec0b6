"""The round schedule in the step: its lookups read the table right, and the step's
program does not grow with ``sync_every``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax
from gmjax.transform import structure


@pytest.mark.parametrize("sync_every, fragments, overlap", [(1, 1, 0), (7, 1, 3), (12, 4, 2),
                                                            (10, 3, 0)])
def test_lookup_reads_the_table(sync_every, fragments, overlap):
  config = gmjax.DiLoCo(sync_every=sync_every, fragments=fragments, overlap_steps=overlap)
  table = structure.sync_table(config.schedule(fragments))
  indexes = jnp.arange(sync_every, dtype=jnp.int32)
  got = jax.jit(jax.vmap(lambda i: structure.lookup(table, i)))(indexes)
  np.testing.assert_array_equal(np.asarray(got), table)
  assert got.dtype == table.dtype


def test_lookup_of_an_all_zero_table():
  assert int(structure.lookup(np.zeros(5, np.int32), jnp.int32(3))) == 0


def _step_text(sync_every):
  optimizer = gmjax.diloco(optax.adamw(1e-3), gmjax.DiLoCo(sync_every=sync_every,
                                                            fragments=2))
  params = {"a": jnp.ones((8, 16)), "b": jnp.ones((16,))}
  state = optimizer.init(params)

  def step(params, state):
    updates, state = optimizer.update(params, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step).lower(params, state).compile().as_text()


def test_step_does_not_grow_with_sync_every():
  # A table of sync_every entries compared whole would put an s32[100003] constant and
  # its masked sum in every step.
  short, long = _step_text(16), _step_text(100_003)
  assert "[100003]" not in long
  assert len(long) < 1.05 * len(short)
