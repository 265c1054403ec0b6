"""The round schedule in the step: its lookups read the table right, and the step's
program does not grow with ``sync_every``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax
from gmjax.transform import structure


def _dense(schedule):
  """``table[t mod H]`` built step by step: 1 + the fragment that syncs at ``t``, or 0."""
  table = np.zeros(schedule.sync_every, np.int32)
  for step in range(1, schedule.sync_every + 1):
    r = schedule.round_at(step)
    if r is not None:
      table[step % schedule.sync_every] = schedule.fragment_of(r) + 1
  return table


@pytest.mark.parametrize("sync_every, fragments, overlap", [(1, 1, 0), (7, 1, 3), (12, 4, 2),
                                                            (10, 3, 0), (9, 9, 0)])
def test_lookup_reads_the_table(sync_every, fragments, overlap):
  config = gmjax.DiLoCo(sync_every=sync_every, fragments=fragments, overlap_steps=overlap)
  schedule = config.schedule(fragments)
  table = structure.sync_table(schedule)
  assert table.positions.size == fragments  # P entries, whatever sync_every
  indexes = jnp.arange(sync_every, dtype=jnp.int32)
  got = jax.jit(jax.vmap(lambda i: structure.lookup(table, i)))(indexes)
  np.testing.assert_array_equal(np.asarray(got), _dense(schedule))
  assert got.dtype == jnp.int32


def test_lookup_of_an_empty_table():
  empty = structure.SyncTable(5, np.zeros(0, np.int32), np.zeros(0, np.int32))
  assert int(structure.lookup(empty, jnp.int32(3))) == 0


def test_a_huge_sync_every_builds_no_table_of_its_length():
  # The table had sync_every entries: sync_every=2**31 - 1 asked init for 8 GiB.
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2**31 - 1, fragments=2))
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  updates, state = jax.jit(optimizer.update)(params, state, params)
  assert int(state.count) == 1 and int(state.stats.rounds) == 0


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


def test_a_sync_every_the_count_cannot_reach_is_refused():
  with pytest.raises(ValueError, match=r"sync_every must be at most 2\*\*31 - 1, got 2147483648"):
    gmjax.DiLoCo(sync_every=2**31)
