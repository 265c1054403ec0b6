"""Gradient accumulation with ``optax.MultiSteps``, in both orderings.

``gmjax.diloco(optax.MultiSteps(inner, K), config(sync_every=K·H, overlap_steps=K·τ))``
counts micro-steps;
``optax.MultiSteps(gmjax.diloco(inner, config(sync_every=H)), K)`` counts macro steps.
Both must train as ``gmjax.diloco(inner, config(sync_every=H))`` does on the mean of
the ``K`` micro-batches' gradients (the gradients here are linear in the targets, so
the mean gradient is the gradient of the mean target).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax

LEARNERS, K, H, MACRO = 2, 3, 2, 8
SHAPES = {"w": (8, 4), "b": (40,)}


def _problem():
  rng = np.random.default_rng(0)
  start = {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in SHAPES.items()}
  # Every learner starts from the same point (the first update adopts learner 0's).
  params = jax.tree.map(lambda x: jnp.stack([x] * LEARNERS), start)
  # targets[t][m]: the micro-batch target of micro-step t for learner m.
  targets = [jax.tree.map(lambda x: jnp.asarray(
      rng.standard_normal((LEARNERS,) + x.shape[1:]), jnp.float32), params)
             for _ in range(K * MACRO)]
  return params, targets


def _grads(params, target):
  return jax.tree.map(lambda p, t: 0.5 * (p - t), params, target)


def _train(optimizer, params, targets):
  def step(params, state, target):
    updates, state = optimizer.update(_grads(params, target), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(step, axis_name="learner"))
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  for target in targets:
    params, state = step(params, state, target)
  assert step._cache_size() == 1
  return params, state


def _config(steps):
  """Syncs every ``H`` steps of ``steps`` (micro-)steps each, overlapping one of them."""
  return gmjax.DiLoCo(sync_every=H * steps, fragments=2, delta_precision="F8_E4M3",
                      overlap_steps=steps, mixing=0.5)


@pytest.fixture(scope="module")
def reference():
  params, targets = _problem()
  macro = [jax.tree.map(lambda *ts: sum(ts) / K, *targets[i * K:(i + 1) * K])
           for i in range(MACRO)]
  optimizer = gmjax.diloco(optax.adam(0.05), _config(1), axis_name="learner")
  return _train(optimizer, params, macro)


def _close(actual, expected):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)


def test_diloco_around_multisteps_counts_micro_steps(reference):
  params, targets = _problem()
  optimizer = gmjax.diloco(optax.MultiSteps(optax.adam(0.05), K), _config(K),
                           axis_name="learner")
  params, state = _train(optimizer, params, targets)
  want_params, want_state = reference
  _close(params, want_params)
  _close(state.anchor, want_state.anchor)
  rounds = int(np.asarray(state.stats.rounds)[0])
  assert rounds == int(np.asarray(want_state.stats.rounds)[0]) > 0
  assert int(np.asarray(state.count)[0]) == K * MACRO


def test_multisteps_around_diloco_counts_macro_steps(reference):
  params, targets = _problem()
  optimizer = optax.MultiSteps(
      gmjax.diloco(optax.adam(0.05), _config(1), axis_name="learner"), K)
  params, state = _train(optimizer, params, targets)
  want_params, want_state = reference
  _close(params, want_params)
  inner = state.inner_opt_state
  _close(inner.anchor, want_state.anchor)
  assert int(np.asarray(inner.stats.rounds)[0]) == int(np.asarray(want_state.stats.rounds)[0])
  assert int(np.asarray(inner.count)[0]) == MACRO


def test_multisteps_around_diloco_between_rounds_on_the_macro_count():
  # MultiSteps runs gmjax.diloco on every micro-step and keeps its state on the last one
  # of each K, so the host asks the schedule about the macro count there, and runs
  # every other micro-step between rounds.
  config = gmjax.DiLoCo(sync_every=4, delta_precision="F8_E4M3", overlap_steps=1,
                        mixing=0.5)
  optimizer = optax.MultiSteps(gmjax.diloco(optax.adam(0.05), config, axis_name="learner"),
                               K)

  def step(params, state, target, between_rounds):
    updates, state = optimizer.update(_grads(params, target), state, params,
                                      between_rounds=between_rounds)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(step, axis_name="learner", in_axes=(0, 0, 0, None)),
                 static_argnums=3)
  params, targets = _problem()
  start = jax.vmap(optimizer.init, axis_name="learner")(params)
  schedule = config.schedule(start.inner_opt_state.pending.shape[-1])
  runs = []
  for choose in (False, True):
    p, state, between = params, start, 0
    for micro, target in enumerate(targets):
      free = choose and not (micro % K == K - 1 and schedule.due(micro // K))
      between += free
      p, state = jax.block_until_ready(step(p, state, target, free))
    runs.append((p, state, between))
  (full, full_state, _), (chosen, chosen_state, between) = runs
  assert between == (K - 1) * MACRO + 4 and step._cache_size() == 2
  for a, b in zip(jax.tree.leaves((chosen, chosen_state.inner_opt_state)),
                  jax.tree.leaves((full, full_state.inner_opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(np.asarray(chosen_state.inner_opt_state.stats.dropped)[0]) == 0
  assert int(np.asarray(chosen_state.inner_opt_state.stats.rounds)[0]) > 0
