"""``gmjax.diloco`` computes what a plain numpy DiLoCo loop computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transform_harness as harness
import transform_reference as reference

STEPS = 13

# (learners, fragments, mixing, overlap, outer, delta_precision, commit_precision, tokens,
# shard_outer): a covering set, every value of each setting at least once, the quantized
# formats spread over the others. "nesterov"/"momentum" are outer SGD with and without
# Nesterov. Leaves hold 8, 12 and 40 values: none a multiple of 32·M for M > 1, and with
# M = 3 the learners' shards are filled unequally.
CASES = [
    (3, 1, 0.0, 0, "nesterov", None, None, False, True),
    (3, 3, 0.0, 0, "nesterov", None, None, True, False),
    (3, 3, 0.5, 1, "momentum", None, None, False, True),
    (3, 3, 0.5, 2, "nesterov", "I4", None, True, True),
    (2, 1, 0.5, 2, "momentum", "F8_E4M3", None, False, True),
    (4, 3, 0.0, 2, "nesterov", "BF16", "F8_E4M3", True, True),
    (8, 1, 0.0, 1, "adam", "F4", None, True, True),
    (3, 3, 0.5, 0, "nesterov", "F8_E4M3", "I4", False, False),
    (1, 1, 0.5, 1, "momentum", "F16", None, True, True),
    (4, 3, 0.5, 0, "adam", "F32", "BF16", True, False),
    (2, 3, 0.0, 1, "adam", None, "F16", False, True),
    (4, 3, 0.5, 1, "nesterov", "I2", None, True, True),
    (3, 1, 0.0, 2, "momentum", "I2", "I2", False, False),
]


def _check_against_reference(setup, params, state, learners, sharded=False):
  expected = reference.run(setup, STEPS)
  for m in range(learners):
    harness.assert_tree_close(
        {n: v[m] for n, v in params.items()} if state.count.ndim else params,
        expected["theta"][m], what=f"learner {m} θ",
    )
  one = state.anchor if state.count.ndim == 0 else {n: v[0] for n, v in state.anchor.items()}
  harness.assert_tree_close(one, expected["anchor"], what="anchor")
  field = "trace" if setup.outer == "sgd" else "mu"
  momentum = harness.outer_field(setup, state, field, sharded)
  harness.assert_tree_close(momentum, expected["momentum"], what="momentum")
  if setup.outer == "adam":
    harness.assert_tree_close(harness.outer_field(setup, state, "nu", sharded),
                              expected["second"], rtol=1e-4, atol=1e-9, what="nu")
  stats = jax.tree.map(lambda x: np.asarray(x).reshape(-1)[0], state.stats)
  log = expected["log"]
  assert int(stats.rounds) == len(log)
  assert int(stats.skipped) == 0
  assert int(stats.fragment) == log[-1]["fragment"]
  np.testing.assert_allclose(stats.delta_norm, log[-1]["delta_norm"], rtol=1e-5)
  np.testing.assert_allclose(stats.cosine, log[-1]["cosine"], atol=1e-5)


@pytest.mark.parametrize(
    "learners,fragments,mixing,overlap,outer,delta_precision,commit_precision,tokens,shard",
    CASES,
)
def test_learners_match_numpy_diloco(learners, fragments, mixing, overlap, outer,
                                     delta_precision, commit_precision, tokens, shard):
  setup = harness.make_setup(
      learners=learners, fragments=fragments, mixing=mixing, overlap=overlap,
      nesterov=outer == "nesterov", outer="adam" if outer == "adam" else "sgd",
      outer_lr=0.05 if outer == "adam" else 0.7, delta_precision=delta_precision,
      commit_precision=commit_precision, tokens=tokens, steps=STEPS,
  )
  params, state, step = harness.run_vmap(setup, STEPS, shard_outer=shard)
  _check_against_reference(setup, params, state, learners=learners, sharded=shard)
  assert step._cache_size() == 1  # one trace for all steps
  for leaf in jax.tree.leaves(state.master):
    assert leaf.dtype == jnp.float32
  assert state.count.dtype == jnp.int32 and state.pending.dtype == jnp.int32
  assert state.tokens.dtype == jnp.int32


@pytest.mark.parametrize("fragments,overlap", [(1, 0), (3, 2)])
def test_one_learner_without_axis_matches_numpy(fragments, overlap):
  setup = harness.make_setup(
      learners=1, fragments=fragments, overlap=overlap, mixing=0.5, steps=STEPS
  )
  params, state, step = harness.run_single(setup, STEPS)
  _check_against_reference(setup, params, state, learners=1)
  assert np.isnan(state.stats.cosine)
  assert step._cache_size() == 1


# (learners, fragments, delta_precision, delta_topk, delta_chunk, shard_outer): top-k
# deltas. Leaves of 8, 12 and 40 values in chunks of 5 (the last chunk of 8 and 12
# shorter than k = 3 in the first case, of 40 whole) or 16 (12 and 8 shorter than the
# chunk, 40 leaving a chunk of 8).
SPARSE_CASES = [
    (3, 1, "F32", 3, 5, True),
    (3, 3, "F32", 3, 5, False),
    (1, 3, "I4", 4, 16, True),
    (3, 3, "I2", 4, 16, True),
    (1, 1, "F32", 6, 16, False),
    (3, 1, "I4", 5, 16, False),
]


@pytest.mark.parametrize("learners,fragments,precision,topk,chunk,shard", SPARSE_CASES)
def test_sparse_deltas_match_numpy_diloco(learners, fragments, precision, topk, chunk,
                                          shard):
  setup = harness.make_setup(
      learners=learners, fragments=fragments, mixing=0.5, overlap=1, tokens=True,
      delta_precision=precision, delta_topk=topk, delta_chunk=chunk, steps=STEPS)
  params, state, step = harness.run_vmap(setup, STEPS, shard_outer=shard)
  _check_against_reference(setup, params, state, learners=learners, sharded=shard)
  assert step._cache_size() == 1
