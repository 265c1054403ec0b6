"""Shared set-up of the ``gmjax.diloco`` tests: a few learners on quadratic losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gmjax
import transform_reference as reference
from gmjax.transform import shards

SHAPES = {"a": (8,), "b": (4, 3), "c": (40,)}
# The plan of SHAPES by bytes, written out: fragments sorted by their first name.
PLANS = {1: [("a", "b", "c")], 2: [("a", "b"), ("c",)], 3: [("a",), ("b",), ("c",)]}


def make_setup(learners=3, fragments=3, steps=13, tokens=False, seed=0, **settings):
  rng = np.random.default_rng(seed)
  draw = lambda scale: {n: (scale * rng.standard_normal(s)).astype(np.float32)
                        for n, s in SHAPES.items()}
  setup = reference.Setup(
      theta0=[draw(1.0) for _ in range(learners)],
      targets=[draw(2.0) for _ in range(learners)],
      curvature=[0.5 + 0.25 * m for m in range(learners)],
      plan=PLANS[fragments],
      tokens=(rng.integers(1, 9, size=(steps, learners)).astype(np.float32)
              if tokens else None),
      **settings,
  )
  return setup


def config_of(setup) -> gmjax.DiLoCo:
  outer = {}
  if setup.outer == "adam":
    b1, b2, eps = setup.adam
    outer = dict(outer="adam", outer_options={"b1": b1, "b2": b2, "eps": eps})
  return gmjax.DiLoCo(
      **outer,
      sync_every=setup.sync_every,
      fragments=len(setup.plan),
      outer_learning_rate=setup.outer_lr,
      outer_momentum=setup.outer_momentum,
      nesterov=setup.nesterov,
      delta_precision=setup.delta_precision,
      delta_topk=setup.delta_topk,
      delta_chunk=setup.delta_chunk,
      commit_precision=setup.commit_precision,
      mixing=setup.mixing,
      overlap_steps=setup.overlap,
      error_feedback=setup.error_feedback,
      outer_delay=setup.outer_delay,
      eager=setup.eager,
      outlier_factor=setup.outlier_factor,
  )


def stacked(setup, what="theta0", dtype=jnp.float32):
  trees = getattr(setup, what)
  return {n: jnp.stack([jnp.asarray(t[n], dtype) for t in trees]) for n in SHAPES}


def grads_of(params, targets, curvature):
  """The reference's gradient ``c·(θ − target)`` in the parameters' dtype."""
  return jax.tree.map(
      lambda p, t: (jnp.asarray(curvature, jnp.float32) * (p - t)).astype(p.dtype),
      params, targets,
  )


def learner_step(optimizer, with_tokens=True):
  """One learner's step: gradient, ``optimizer.update`` (tokens or none), apply."""

  def step(params, state, targets, curvature, tokens):
    grads = grads_of(params, targets, curvature)
    extra = {"tokens": tokens} if with_tokens else {}
    updates, state = optimizer.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  return step


def tokens_at(setup, t):
  learners = len(setup.curvature)
  if setup.tokens is None:
    return jnp.ones(learners, jnp.float32)
  return jnp.asarray(setup.tokens[t], jnp.float32)


def run_single(setup, steps):
  """Runs ``setup``'s one learner without a mapped axis; returns params, state, step."""
  optimizer = gmjax.diloco(optax.sgd(setup.lr), config_of(setup))
  params = {n: jnp.asarray(v) for n, v in setup.theta0[0].items()}
  targets = {n: jnp.asarray(v) for n, v in setup.targets[0].items()}
  state = optimizer.init(params)
  step = jax.jit(learner_step(optimizer, with_tokens=False))
  for _ in range(steps):
    params, state = jax.block_until_ready(
        step(params, state, targets, setup.curvature[0], None))
  return params, state, step


def run_vmap(setup, steps, dtype=jnp.float32, **options):
  """Runs ``setup`` with ``M`` learners under ``jax.vmap``; returns params, state, step."""
  optimizer = gmjax.diloco(optax.sgd(setup.lr), config_of(setup), axis_name="learner",
                           **options)
  params = stacked(setup, dtype=dtype)
  targets = stacked(setup, "targets", dtype)
  curvature = jnp.asarray(setup.curvature, jnp.float32)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(learner_step(optimizer, setup.tokens is not None),
                          axis_name="learner"))
  for t in range(steps):
    params, state = jax.block_until_ready(
        step(params, state, targets, curvature, tokens_at(setup, t)))
  return params, state, step


def unshard(stacked_shards, shape):
  """The whole F32 leaf from every learner's shard ``(M, R, 32)`` (see transform.shards)."""
  rows = np.swapaxes(np.asarray(stacked_shards), 0, 1)  # (R, M, 32)
  return rows.reshape(-1)[:int(np.prod(shape))].reshape(shape)


def _pieces(setup, fragment, bucket, sharded):
  """Each leaf of a fragment, whole, from its one bucket stacked over learners.

  The harness's leaves share a dtype, so a fragment's master and outer state are one
  bucket: its leaves' rows end to end in the fragment's name order, ``(M, 1, S, 32)``
  (each learner's part when sharded, the whole bucket on every learner otherwise).
  """
  bucket = np.asarray(bucket)
  if bucket.ndim == 3:  # one learner, not stacked
    bucket = bucket[None]
  learners = bucket.shape[0] if sharded else 1
  values, offset = {}, 0
  for name in setup.plan[fragment]:
    shape = SHAPES[name]
    rows = shards.row_count(int(np.prod(shape)), learners)
    part = bucket[:, 0, offset:offset + rows]
    offset += rows
    values[name] = (unshard(part, shape) if sharded
                    else part[0].reshape(-1)[:int(np.prod(shape))].reshape(shape))
  return values


def outer_field(setup, state, field, sharded):
  """An outer-state field (``trace``, ``mu``, ``nu``) by leaf name, whole, of learner 0.

  Replicated states are stacked over learners (take learner 0's); sharded ones are put
  back together from every learner's shard.
  """
  values = {}
  for f in range(len(setup.plan)):
    (bucket,) = optax.tree_utils.tree_get(state.outer_state[f], field)
    values.update(_pieces(setup, f, bucket, sharded))
  return values


def masters(setup, state, sharded):
  """The kept F32 masters by name, whole, of learner 0."""
  values = {}
  for f, kept in enumerate(state.master):
    for bucket in kept:
      if not isinstance(bucket, optax.MaskedNode):
        values.update(_pieces(setup, f, bucket, sharded))
  return values


def assert_tree_close(actual, expected, rtol=1e-5, atol=1e-6, what=""):
  for name in expected:
    np.testing.assert_allclose(
        np.asarray(actual[name], np.float32), np.asarray(expected[name], np.float32),
        rtol=rtol, atol=atol, err_msg=f"{what} leaf {name}",
    )
