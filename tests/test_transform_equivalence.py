"""``gmjax.diloco`` computes what a plain numpy DiLoCo loop computes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax
import transform_harness as harness
import transform_reference as reference

STEPS = 13

# (fragments, mixing, overlap, nesterov, delta_precision, commit_precision, tokens): every
# value of each setting appears, with the quantized formats spread over the others.
CASES = [
    (1, 0.0, 0, True, None, None, False),
    (3, 0.0, 0, True, None, None, True),
    (3, 0.5, 1, False, None, None, False),
    (3, 0.5, 2, True, "I4", None, True),
    (1, 0.5, 2, False, "F8_E4M3", None, False),
    (3, 0.0, 2, True, "BF16", "F8_E4M3", True),
    (1, 0.0, 1, True, "F4", None, True),
    (3, 0.5, 0, True, "F8_E4M3", "I4", False),
    (1, 0.5, 1, False, "F16", None, True),
]


def _check_against_reference(setup, params, state, learners):
  expected = reference.run(setup, STEPS)
  for m in range(learners):
    harness.assert_tree_close(
        {n: v[m] for n, v in params.items()} if learners > 1 else params,
        expected["theta"][m], what=f"learner {m} θ",
    )
  anchor = state.anchor if learners == 1 else {n: v[0] for n, v in state.anchor.items()}
  momentum = (state.momentum if learners == 1
              else {n: v[0] for n, v in state.momentum.items()})
  harness.assert_tree_close(anchor, expected["anchor"], what="anchor")
  harness.assert_tree_close(momentum, expected["momentum"], what="momentum")
  stats = jax.tree.map(lambda x: np.asarray(x).reshape(-1)[0], state.stats)
  log = expected["log"]
  assert int(stats.rounds) == len(log)
  assert int(stats.skipped) == 0
  assert int(stats.fragment) == log[-1]["fragment"]
  np.testing.assert_allclose(stats.delta_norm, log[-1]["delta_norm"], rtol=1e-5)
  np.testing.assert_allclose(stats.cosine, log[-1]["cosine"], atol=1e-5)


@pytest.mark.parametrize(
    "fragments,mixing,overlap,nesterov,delta_precision,commit_precision,tokens", CASES
)
def test_learners_match_numpy_diloco(
    fragments, mixing, overlap, nesterov, delta_precision, commit_precision, tokens
):
  setup = harness.make_setup(
      fragments=fragments, mixing=mixing, overlap=overlap, nesterov=nesterov,
      delta_precision=delta_precision, commit_precision=commit_precision,
      tokens=tokens, steps=STEPS,
  )
  params, state, step = harness.run_vmap(setup, STEPS)
  _check_against_reference(setup, params, state, learners=3)
  assert step._cache_size() == 1  # one trace for all steps
  for leaf in jax.tree.leaves(state.master):
    assert leaf.dtype == jnp.float32
  assert state.count.dtype == jnp.int32 and state.pending.dtype == jnp.int32


@pytest.mark.parametrize("fragments,overlap", [(1, 0), (3, 2)])
def test_one_learner_without_axis_matches_numpy(fragments, overlap):
  setup = harness.make_setup(
      learners=1, fragments=fragments, overlap=overlap, mixing=0.5, steps=STEPS
  )
  optimizer = gmjax.diloco(optax.sgd(setup.lr), harness.config_of(setup))
  params = {n: jnp.asarray(v) for n, v in setup.theta0[0].items()}
  targets = {n: jnp.asarray(v) for n, v in setup.targets[0].items()}
  state = optimizer.init(params)
  step = jax.jit(harness.learner_step(optimizer, with_tokens=False))
  for _ in range(STEPS):
    params, state = step(params, state, targets, setup.curvature[0], None)
  _check_against_reference(setup, params, state, learners=1)
  assert np.isnan(state.stats.cosine)
  assert step._cache_size() == 1
