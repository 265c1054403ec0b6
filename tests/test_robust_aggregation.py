"""``DiLoCo(aggregation=...)``: the robust rules against numpy references of their
definitions, padding and batching, the in-mesh statistics, and the configuration's errors.

SPEC: ``"clipped_mean"`` clips each kept delta's norm to the median kept norm and caps
each kept token weight at the median kept weight, renormalized; ``"trimmed_mean"`` drops,
per coordinate, the ``trim`` largest and smallest kept values and averages the rest
(the coordinate-wise median when fewer than ``2·trim + 1`` are kept). Rejected or
padding learners take part in neither. Mail equals in-mesh: tests/test_mail_matches_inmesh.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
from gmjax.core import robust
from gmjax.core.aggregator import DiLoCoAggregator
from gmjax.core.records import Contribution


def clipped_mean_reference(deltas, weights, keep):
  """The definition, in float64 numpy, over the kept learners only."""
  d = np.asarray(deltas, np.float64)[keep]
  w = np.asarray(weights, np.float64)[keep]
  w = np.minimum(w, np.median(w))
  w = w / w.sum()
  norms = np.linalg.norm(d.reshape(len(d), -1), axis=1)
  radius = np.median(norms)
  scale = np.where(norms > radius, radius / np.where(norms > 0, norms, 1), 1.0)
  return np.tensordot(w * scale, d, axes=1)


def trimmed_mean_reference(deltas, keep, trim):
  d = np.sort(np.asarray(deltas, np.float64)[keep], axis=0)
  k = len(d)
  t = trim if k > 2 * trim else (k - 1) // 2
  return d[t:k - t].mean(axis=0)


def draw(seed, learners=6, size=(3, 4)):
  rng = np.random.default_rng(seed)
  deltas = rng.standard_normal((learners, *size)).astype(np.float32)
  deltas *= rng.uniform(0.2, 5.0, size=(learners, 1, 1)).astype(np.float32)
  weights = rng.uniform(0.1, 1.0, learners).astype(np.float32)
  return deltas, weights


@jax.jit
def _squared(deltas):
  return jnp.sum(jnp.square(deltas), axis=tuple(range(1, deltas.ndim)))


@functools.lru_cache
def _compiled(rule, axis):
  return jax.jit(lambda d, w, k: rule.combine(d, rule.apply(w, k, _squared(
      jnp.moveaxis(d, axis, 0))), k, axis))


def run_rule(rule, deltas, weights, keep, axis=0):
  """``g`` of ``rule`` under jit, the learners' dimension of the deltas moved to ``axis``."""
  stacked = jnp.moveaxis(jnp.asarray(deltas), 0, axis)
  return np.asarray(_compiled(rule, axis)(stacked, jnp.asarray(weights), jnp.asarray(keep)))


KEEPS = {
    "all": [True] * 6,
    "two-rejected": [True, False, True, True, False, True],
    "two-kept": [False, True, False, False, True, False],
    "one-kept": [False, False, True, False, False, False],
}


@pytest.mark.parametrize("keep", list(KEEPS), ids=list(KEEPS))
@pytest.mark.parametrize("seed", [0, 1])
def test_clipped_mean_matches_numpy(keep, seed):
  deltas, weights = draw(seed)
  keep = np.asarray(KEEPS[keep])
  deltas[~keep] = np.nan  # a rejected delta's values are never read
  got = run_rule(robust.Rule("clipped_mean"), deltas, weights, keep)
  np.testing.assert_allclose(got, clipped_mean_reference(deltas, weights, keep),
                             rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("keep", list(KEEPS), ids=list(KEEPS))
@pytest.mark.parametrize("trim", [1, 2, 3])
def test_trimmed_mean_matches_numpy(keep, trim):
  deltas, weights = draw(trim)
  keep = np.asarray(KEEPS[keep])
  deltas[~keep] = np.inf
  # The learners' dimension anywhere: the sharded exchange holds it third.
  got = run_rule(robust.Rule("trimmed_mean", trim), deltas, weights, keep, axis=2)
  np.testing.assert_allclose(got, trimmed_mean_reference(deltas, keep, trim),
                             rtol=2e-6, atol=1e-6)


def test_too_few_to_trim_takes_the_coordinate_wise_median():
  deltas = np.array([[1.0, 8.0], [2.0, -9.0], [40.0, 0.5], [3.0, 2.0]], np.float32)
  keep = np.ones(4, bool)
  rule = robust.Rule("trimmed_mean", trim=3)
  applied = rule.apply(jnp.full(4, 0.25), jnp.asarray(keep), _squared(deltas))
  assert int(applied.trimmed) == 1
  np.testing.assert_array_equal(run_rule(rule, deltas, np.full(4, 0.25), keep),
                                np.median(deltas, axis=0))


@pytest.mark.parametrize("trim", [3, 2**31 - 1, 2**31, 2**40])
def test_any_trim_beyond_the_learners_takes_the_median(trim):
  # trim=2**31 was accepted, then every round raised OverflowError in effective_trim.
  deltas = np.array([[1.0, 8.0], [2.0, -9.0], [40.0, 0.5], [3.0, 2.0]], np.float32)
  rule = gmjax.DiLoCo(sync_every=4, aggregation="trimmed_mean", trim=trim).rule
  np.testing.assert_array_equal(run_rule(rule, deltas, np.full(4, 0.25), np.ones(4, bool)),
                                np.median(deltas, axis=0))


@pytest.mark.parametrize("aggregation", ["mean", "clipped_mean"])
def test_a_trim_no_rule_uses_is_refused(aggregation):
  # It was accepted, never used, and written into the config's record.
  with pytest.raises(ValueError, match=r"trim=3 is used only by aggregation='trimmed_mean'"
                                       rf".*aggregation='{aggregation}'.*Leave trim at 1"):
    gmjax.DiLoCo(sync_every=4, aggregation=aggregation, trim=3)
  gmjax.DiLoCo(sync_every=4, aggregation=aggregation, trim=1)


@pytest.mark.parametrize("name", ["clipped_mean", "trimmed_mean"])
def test_padding_and_batching_leave_the_bits_alone(name):
  # The mail closer pads its slots to a power of two with left-out zeros, and vmap batches
  # rounds: neither changes a bit of g.
  rule = robust.Rule(name)
  deltas, weights = draw(7, learners=5)
  keep = np.array([True, True, False, True, True])
  plain = run_rule(rule, deltas, weights, keep)
  padded = run_rule(rule, np.concatenate([deltas, np.full((3, 3, 4), 7.0, np.float32)]),
                    np.concatenate([weights, np.zeros(3, np.float32)]),
                    np.concatenate([keep, np.zeros(3, bool)]))
  np.testing.assert_array_equal(plain, padded)
  batched = jax.jit(jax.vmap(lambda d, w, k: rule.combine(d, rule.apply(w, k, _squared(d)),
                                                          k)))
  rounds = np.stack([deltas, deltas[::-1]]), np.stack([weights, weights[::-1]])
  out = batched(*map(jnp.asarray, rounds), jnp.asarray(np.stack([keep, keep[::-1]])))
  np.testing.assert_array_equal(np.asarray(out[0]), plain)
  np.testing.assert_array_equal(np.asarray(out[1]), run_rule(
      rule, deltas[::-1], weights[::-1], keep[::-1]))


def test_clipped_mean_counts_what_it_clipped_and_capped():
  deltas = np.zeros((4, 1, 2), np.float32)
  deltas[:, 0, 0] = [1.0, 2.0, 3.0, -50.0]
  weights = np.array([0.1, 0.1, 0.1, 0.7], np.float32)
  applied = robust.Rule("clipped_mean").apply(jnp.asarray(weights), jnp.ones(4, bool),
                                              _squared(deltas))
  assert (int(applied.clipped), int(applied.capped), int(applied.trimmed)) == (2, 1, 0)
  np.testing.assert_allclose(np.asarray(applied.shares), 0.25, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(applied.scales), [1, 1, 2.5 / 3, 2.5 / 50],
                             rtol=1e-6)


def test_the_mail_closer_records_what_the_rule_did():
  params = {"w": np.zeros((2, 3), np.float32)}
  config = gmjax.DiLoCo(sync_every=4, aggregation="clipped_mean")
  aggregator = DiLoCoAggregator(config, gmjax.Schema.from_tree(params))
  state = aggregator.initial_state(params)
  scales = {"a": 1.0, "b": 2.0, "c": 3.0, "d": -50.0}
  result = aggregator.close_round(state, [
      Contribution(name, 4, 4, 90 if name == "d" else 10, 0.0, False,
                   {"w": np.full((2, 3), s, np.float32)})
      for name, s in scales.items()])
  aggregation = result.aggregation.to_json()
  assert aggregation["rule"] == "clipped_mean" and aggregation["capped"] == 1
  assert [c["learner"] for c in aggregation["clipped"]] == ["c", "d"]
  assert [p.weight for p in result.participants] == pytest.approx([0.25] * 4)
  # g = 0.25 · (1 + 2 + 2.5 − 2.5) on every coordinate; plain SGD steps Θ by −η·g...
  # with Nesterov momentum 0.9: −η·(1 + μ)·g.
  np.testing.assert_allclose(result.state.theta["w"], -0.7 * 1.9 * 0.75, rtol=1e-5)


LEARNERS = 4


def _in_mesh_stats(config, shard_outer, mesh=None):
  """Four steps (one round) of 4 learners, learner 3 pulling 5x the other way, under
  ``vmap`` or, given a mesh, ``shard_map``; learner 0's parameters and statistics."""
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner",
                           shard_outer=shard_outer)
  goals = jnp.asarray(np.random.default_rng(3).standard_normal((LEARNERS, 40)),
                      jnp.float32)
  goals = goals.at[3].multiply(-5.0)

  def step(params, state, goal):
    updates, state = optimizer.update({"w": params["w"] - goal}, state, params,
                                      tokens=jnp.float32(10))
    return optax.apply_updates(params, updates), state

  params = {"w": jnp.zeros((LEARNERS, 40), jnp.float32)}
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  if mesh is None:
    steps = jax.jit(jax.vmap(step, axis_name="learner"))
  else:
    local = lambda *args: jax.tree.map(lambda x: x[None], step(
        *jax.tree.map(lambda x: x[0], args)))
    steps = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("learner"),
                                  out_specs=P("learner")))
    params, state, goals = jax.device_put((params, state, goals),
                                          NamedSharding(mesh, P("learner")))
  for _ in range(4):
    params, state = steps(params, state, goals)
  return np.asarray(params["w"])[0], jax.tree.map(lambda x: int(np.asarray(x)[0]),
                                                   state.stats._asdict())


@pytest.mark.parametrize("name,expected", [
    # 4 learners: the median norm is the mean of the middle two, so two are above it.
    ("clipped_mean", {"clipped": 2, "capped": 0, "trimmed": 0}),
    ("trimmed_mean", {"clipped": 0, "capped": 0, "trimmed": 1}),
])
def test_in_mesh_statistics_vmap_shard_map_and_both_outer_layouts_agree(name, expected):
  # F32 deltas: the replicated clipped_mean sums by psum, the trimmed_mean gathers.
  config = gmjax.DiLoCo(sync_every=4, aggregation=name)
  sharded, stats = _in_mesh_stats(config, shard_outer=True)
  replicated, _ = _in_mesh_stats(config, shard_outer=False)
  mesh = jax.make_mesh((LEARNERS,), ("learner",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  mapped, mapped_stats = _in_mesh_stats(config, shard_outer=True, mesh=mesh)
  assert {k: stats[k] for k in expected} == expected
  assert stats["rejected"] == 0 and stats["skipped"] == 0
  # shard_map runs the program vmap runs: the same bits.
  np.testing.assert_array_equal(mapped, sharded)
  assert mapped_stats == stats
  # The same decoded deltas, sorted or clipped alike; only the norms' summation order
  # (and the replicated F32 psum's) differs between the layouts.
  np.testing.assert_allclose(sharded, replicated, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("settings,match", [
    ({"aggregation": "median"}, r"aggregation must be one of .* got 'median'"),
    ({"aggregation": None}, r"aggregation must be one of .* got None"),
    ({"aggregation": "trimmed_mean", "trim": 0}, r"trim must be a positive int.* got 0"),
    ({"trim": True}, r"trim must be a positive int.* got True"),
    ({"trim": 1.5}, r"trim must be a positive int.* got 1.5"),
    ({"aggregation": "clipped_mean", "outer_delay": 1, "eager": True},
     r"eager=True needs aggregation='mean', got aggregation='clipped_mean'"),
])
def test_a_bad_aggregation_is_refused_naming_the_argument(settings, match):
  with pytest.raises(ValueError, match=match):
    gmjax.DiLoCo(sync_every=4, **settings)


def test_the_rule_travels_in_the_configuration_record():
  mean = gmjax.DiLoCo(sync_every=4)
  assert "aggregation" not in mean.to_json() and "trim" not in mean.to_json()
  trimmed = dataclasses.replace(mean, aggregation="trimmed_mean", trim=2)
  assert trimmed.to_json()["aggregation"] == "trimmed_mean"
  assert gmjax.DiLoCo.from_json(trimmed.to_json()) == trimmed
  assert trimmed.rule == robust.Rule("trimmed_mean", 2)
