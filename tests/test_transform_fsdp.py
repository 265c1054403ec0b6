"""``gmjax.diloco`` with 4 learners × 2 FSDP: parameters sharded over ``fsdp`` on explicit
and Auto meshes, under ``vmap(spmd_axis_name=...)`` and under ``shard_map`` with only the
learner axis manual (XLA partitions ``fsdp``).

Every run must equal the numpy reference loop, and the same steps run unsharded on one
device; the compiled step must never gather a sharded parameter over ``fsdp``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
import transform_harness as harness
import transform_reference as reference
from gmjax.transform import hlo, shards

LEARNERS, FSDP, STEPS = 4, 2, 6
# "w" holds whole rows of 32·M values on each fsdp device (2048 = 2 × 8 rows of 128);
# "u" (384 values, 3 rows) does not, so its rows are replicated over fsdp for a round;
# "b" is not sharded at all.
SHAPES = {"w": (64, 32), "u": (16, 24), "b": (40,)}
SHARDED = {"w": True, "u": True, "b": False}


def _setup(delta_precision, commit_precision=None, outer="sgd", error_feedback=None,
           eager=False, delta_topk=None, delta_chunk=4096):
  # eager: delayed outer gradients with eager updates (no overlap steps, no mixing).
  # delta_topk: sparse deltas, top-k of each chunk of delta_chunk values.
  mixing, overlap = (0.0, 0) if eager else (0.5, 1)
  rng = np.random.default_rng(1)
  draw = lambda scale: {n: (scale * rng.standard_normal(s)).astype(np.float32)
                        for n, s in SHAPES.items()}
  config = gmjax.DiLoCo(sync_every=3, fragments=2, overlap_steps=overlap, mixing=mixing,
                        delta_precision=delta_precision, commit_precision=commit_precision,
                        error_feedback=error_feedback, outer_delay=int(eager), eager=eager,
                        delta_topk=delta_topk, delta_chunk=delta_chunk,
                        **({"outer": "adam", "outer_learning_rate": 0.05} if outer == "adam"
                           else {}))
  theta0 = [draw(1.0) for _ in range(LEARNERS)]
  plan = [tuple(f) for f in config.plan(gmjax.Schema.from_tree(theta0[0]))]
  setup = reference.Setup(
      theta0=theta0, targets=[draw(2.0) for _ in range(LEARNERS)],
      curvature=[0.5 + 0.25 * m for m in range(LEARNERS)], plan=plan, sync_every=3,
      delta_precision=delta_precision, commit_precision=commit_precision, mixing=mixing,
      overlap=overlap, outer=outer, outer_lr=0.05 if outer == "adam" else 0.7,
      error_feedback=error_feedback, outer_delay=int(eager), eager=eager,
      delta_topk=delta_topk, delta_chunk=delta_chunk,
  )
  return setup, config


def _stacked(trees):
  return {n: jnp.stack([jnp.asarray(t[n]) for t in trees]) for n in SHAPES}


def _mesh(axis_type):
  return jax.make_mesh((LEARNERS, FSDP), ("learner", "fsdp"), axis_types=(axis_type,) * 2)


def _place(mesh, tree):
  """Stacked leaves on the mesh: learners over ``learner``, sharded leaves' rows over
  ``fsdp``."""
  # Full-length specs, as the step's outputs carry them: no second trace for P("learner")
  # against the equivalent P("learner", None).
  return {n: jax.device_put(v, NamedSharding(mesh, P(
      "learner", "fsdp" if SHARDED[n] else None, *[None] * (v.ndim - 2))))
          for n, v in tree.items()}


def _first(tree):
  return jax.tree.map(lambda x: jax.lax.squeeze(x, (0,)), tree)


def _stack(tree):
  return jax.tree.map(lambda x: jax.lax.expand_dims(x, (0,)), tree)


def _build(optimizer, mesh, mode):
  """``(init, step)`` for ``mode``: "vmap", "shard_map", or "plain" (no mesh)."""
  step = harness.learner_step(optimizer, with_tokens=False)
  if mode == "plain":
    return (jax.vmap(optimizer.init, axis_name="learner"),
            jax.jit(jax.vmap(step, axis_name="learner")))
  if mode == "vmap":
    return (jax.vmap(optimizer.init, axis_name="learner", spmd_axis_name="learner"),
            jax.jit(jax.vmap(step, axis_name="learner", spmd_axis_name="learner")))
  manual = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("learner"),
                             out_specs=P("learner"), axis_names={"learner"})
  return (jax.jit(manual(lambda p: _stack(optimizer.init(_first(p))))),
          jax.jit(manual(lambda p, s, t, c, k: _stack(step(*_first((p, s, t, c, k)))))))


def _run(setup, config, mode, axis_type=None, shard_outer=True):
  """``STEPS`` steps; returns ``(params, state, step)`` on the host (and the step)."""
  optimizer = gmjax.diloco(optax.sgd(setup.lr), config, axis_name="learner",
                           shard_outer=shard_outer)
  params, targets = _stacked(setup.theta0), _stacked(setup.targets)
  curvature = jnp.asarray(setup.curvature, jnp.float32)
  tokens = jnp.ones(LEARNERS, jnp.float32)
  if mode == "plain":
    init, step = _build(optimizer, None, mode)
    state = init(params)
    for _ in range(STEPS):
      params, state = jax.block_until_ready(step(params, state, targets, curvature, tokens))
    assert step._cache_size() == 1
    return jax.device_get((params, state)), step
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    params, targets = _place(mesh, params), _place(mesh, targets)
    curvature, tokens = jax.device_put((curvature, tokens), NamedSharding(mesh, P("learner")))
    init, step = _build(optimizer, mesh, mode)
    state = init(params)
    for t in range(STEPS):
      params, state = jax.block_until_ready(step(params, state, targets, curvature, tokens))
      if t == 1:
        compiled = step._cache_size()
    # On an explicit mesh the state's layout is in its type from init on: one trace.
    # On an Auto mesh XLA picks the step's output layouts, which the eager init cannot
    # know: the second call compiles once more, and then no more.
    assert step._cache_size() == compiled == (1 if axis_type == AxisType.Explicit else 2)
    if axis_type == AxisType.Explicit:
      for name, leaf in params.items():  # the parameters stay as they were laid out
        want = ("learner", "fsdp" if SHARDED[name] else None)
        assert tuple(jax.typeof(leaf).sharding.spec)[:2] == want, name
        if config.error_feedback is not None:  # and so do their residuals
          residual = jax.typeof(state.residual[name]).sharding.spec
          assert tuple(residual)[:2] == want, name
    return jax.device_get((params, state)), step


def _assert_matches_numpy(setup, params, state):
  """Every learner's parameters, the anchor and the rounds run equal the numpy loop's."""
  expected = reference.run(setup, STEPS)
  for m in range(LEARNERS):
    harness.assert_tree_close({n: v[m] for n, v in params.items()}, expected["theta"][m],
                              what=f"learner {m}")
  harness.assert_tree_close({n: v[0] for n, v in state.anchor.items()}, expected["anchor"],
                            what="anchor")
  assert int(state.stats.rounds[0]) == len(expected["log"]) and int(state.stats.skipped[0]) == 0


@functools.cache
def _plain(delta_precision, shard_outer):
  setup, config = _setup(delta_precision)
  return _run(setup, config, "plain", shard_outer=shard_outer)[0]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
@pytest.mark.parametrize("mode,delta_precision,shard_outer", [
    ("vmap", "F8_E4M3", True), ("shard_map", "F8_E4M3", True),
    ("vmap", "I4", False), ("shard_map", "I4", False),
])
def test_fsdp_learners_match_numpy_and_the_unsharded_run(axis_type, mode, delta_precision,
                                                          shard_outer):
  setup, config = _setup(delta_precision)
  (params, state), step = _run(setup, config, mode, axis_type, shard_outer)
  _assert_matches_numpy(setup, params, state)
  # Elementwise arithmetic in the same order: the sharded layout changes no bit of the
  # parameters, anchors, masters or outer state (only reductions, e.g. the cosine, may
  # round differently).
  plain_params, plain_state = _plain(delta_precision, shard_outer)
  for a, b in zip(jax.tree.leaves((params, state.anchor)),
                  jax.tree.leaves((plain_params, plain_state.anchor))):
    np.testing.assert_array_equal(a, b)
  # Masters and outer states are held in buckets, which the FSDP layout groups and cuts
  # differently: compared leaf by leaf.
  layout = "explicit" if axis_type == AxisType.Explicit else "auto"
  for field in ("master", "outer_state"):
    got = _by_leaf(setup.plan, getattr(state, field), shard_outer, layout)
    want = _by_leaf(setup.plan, getattr(plain_state, field), shard_outer, "plain")
    assert sorted(got) == sorted(want) and (got or field == "master"), field
    for name in want:
      np.testing.assert_array_equal(got[name], want[name], err_msg=f"{field} {name}")


def _by_leaf(plan, per_fragment, sharded, layout):
  """Each leaf's rows ``(LEARNERS, R, …)`` of bucketed state (the masters, or every array
  of the outer states), by leaf name and array index.

  A bucket holds the rows of its leaves end to end in the fragment's name order, cut
  into ``F`` pieces (``gmjax.transform.buckets``). ``layout``: "explicit", where a leaf's
  rows stay split over fsdp when each device holds whole rows (F = 2) and the other
  leaves share a replicated bucket; "auto", where each leaf is a bucket of its own
  (XLA places them); "plain" (one device), one bucket a fragment.
  """
  learners = LEARNERS if sharded else 1

  def rows(name):
    return shards.row_count(int(np.prod(SHAPES[name])), learners)

  def split(name):
    size = int(np.prod(SHAPES[name]))
    return SHARDED[name] and rows(name) * learners * 32 == size and rows(name) % FSDP == 0

  out = {}
  for f, names in enumerate(plan):
    if layout == "auto":
      groups = [[n] for n in names]
    elif layout == "explicit":  # in the order of their first leaves
      keyed = {}
      for n in names:
        keyed.setdefault(split(n), []).append(n)
      groups = list(keyed.values())
    else:
      groups = [list(names)]
    arrays = [x for x in jax.tree.leaves(per_fragment[f]) if np.ndim(x) == 4]
    assert len(arrays) % len(groups) == 0, (f, len(arrays), groups)
    for index, bucket in enumerate(arrays):
      group, offset = groups[index % len(groups)], 0
      for name in group:
        part = rows(name) // bucket.shape[1]
        out[f"{name}/{index // len(groups)}"] = bucket[:, :, offset:offset + part].reshape(
            LEARNERS, rows(name), -1)
        offset += part
      assert offset == bucket.shape[2], (f, group, bucket.shape)
  return out


def _fsdp_gathers(axis_type, mode, shard_outer, error_feedback=None, eager=False,
                  delta_precision="F8_E4M3", delta_topk=None, delta_chunk=4096):
  """All-gathers of the compiled step over groups other than the learners' (fsdp)."""
  shapes = {"w": (64, 32), "b": (40,)}  # "w" holds whole rows on each fsdp device
  setup, config = _setup(delta_precision, error_feedback=error_feedback, eager=eager,
                         delta_topk=delta_topk, delta_chunk=delta_chunk)
  setup.theta0 = [{n: t[n] for n in shapes} for t in setup.theta0]
  setup.targets = [{n: t[n] for n in shapes} for t in setup.targets]
  optimizer = gmjax.diloco(optax.sgd(setup.lr), config, axis_name="learner",
                           shard_outer=shard_outer)
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    place = lambda trees: _place(mesh, {n: jnp.stack([jnp.asarray(t[n]) for t in trees])
                                        for n in shapes})
    params, targets = place(setup.theta0), place(setup.targets)
    curvature, tokens = jax.device_put((jnp.asarray(setup.curvature, jnp.float32),
                                        jnp.ones(LEARNERS, jnp.float32)),
                                       NamedSharding(mesh, P("learner")))
    init, step = _build(optimizer, mesh, mode)
    state = init(params)
    text = step.lower(params, state, targets, curvature, tokens).compile().as_text()
  return [c for c in hlo.collective_bytes(text)
          if c.op == "all-gather" and _spans_other_axes(mesh, c)]


def _spans_other_axes(mesh, collective):
  """Whether a replica group of ``collective`` holds devices that differ in a mesh axis
  other than ``learner`` (read from the groups' device ids, not their size)."""
  if not collective.groups:
    return collective.group_size != LEARNERS
  return any(hlo.spanned_axes(mesh, group) - {"learner"} for group in collective.groups)


@pytest.mark.parametrize("shard_outer", [True, False], ids=["sharded", "replicated"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_vmap_step_gathers_nothing_over_fsdp(axis_type, shard_outer):
  assert _fsdp_gathers(axis_type, "vmap", shard_outer) == []


@pytest.mark.parametrize("shard_outer", [True, False], ids=["sharded", "replicated"])
def test_error_feedback_residuals_keep_the_fsdp_split(shard_outer):
  setup, config = _setup("I4", error_feedback=0.5)
  (params, state), _ = _run(setup, config, "vmap", AxisType.Explicit, shard_outer)
  expected = reference.run(setup, STEPS)
  for m in range(LEARNERS):
    harness.assert_tree_close({n: v[m] for n, v in params.items()}, expected["theta"][m],
                              what=f"learner {m}")
    harness.assert_tree_close({n: v[m] for n, v in state.residual.items()},
                              expected["residual"][m], what=f"learner {m} residual")
  assert _fsdp_gathers(AxisType.Explicit, "vmap", shard_outer, error_feedback=0.5) == []


@pytest.mark.parametrize("shard_outer", [True, False], ids=["sharded", "replicated"])
def test_eager_state_keeps_the_fsdp_split(shard_outer):
  setup, config = _setup("I4", eager=True)
  (params, state), _ = _run(setup, config, "vmap", AxisType.Explicit, shard_outer)
  expected = reference.run(setup, STEPS)
  for m in range(LEARNERS):
    harness.assert_tree_close({n: v[m] for n, v in params.items()}, expected["theta"][m],
                              what=f"learner {m}")
    harness.assert_tree_close({n: v[m] for n, v in state.delay.start.items()},
                              expected["begin"][m], what=f"learner {m} start")
  assert _fsdp_gathers(AxisType.Explicit, "vmap", shard_outer, eager=True) == []



# Sparse I4 deltas, top-3 of each chunk of 16: each fsdp device holds 1024 values of "w",
# whole chunks whose kept values fill whole codec blocks (512 values: 32 chunks keep 96),
# so "w" is selected, encoded and decoded where it lies and the compiled step gathers
# nothing over fsdp (but for JAX's gathers at a partially manual shard_map's boundary on
# an explicit mesh, below); "u" (192 values a device) is not, and is replicated over
# fsdp for the round, as the dense path does with it.
@pytest.mark.parametrize("axis_type,mode,shard_outer", [
    (AxisType.Explicit, "vmap", True), (AxisType.Explicit, "vmap", False),
    (AxisType.Explicit, "shard_map", True), (AxisType.Explicit, "shard_map", False),
    (AxisType.Auto, "vmap", True), (AxisType.Auto, "shard_map", False),
], ids=["explicit-vmap-sharded", "explicit-vmap-replicated", "explicit-shard_map-sharded",
        "explicit-shard_map-replicated", "auto-vmap-sharded", "auto-shard_map-replicated"])
def test_sparse_deltas_match_numpy_and_keep_the_fsdp_split(axis_type, mode, shard_outer):
  sparse = dict(delta_topk=3, delta_chunk=16)
  setup, config = _setup("I4", **sparse)
  (params, state), _ = _run(setup, config, mode, axis_type, shard_outer)
  _assert_matches_numpy(setup, params, state)
  gathers = _fsdp_gathers(axis_type, mode, shard_outer, delta_precision="I4", **sparse)
  if mode == "shard_map" and axis_type == AxisType.Explicit:  # JAX's, at the boundary
    gathers = [c for c in gathers if c.op_name != _BOUNDARY]
  assert gathers == []


def test_sparse_deltas_gather_a_leaf_whose_pieces_are_not_whole_chunks():
  # Top-3 of 64 at I4: a device's 1024 values of "w" are 16 chunks keeping 48 values,
  # not whole blocks of 32 (that takes 2048), so the round replicates "w"'s F32 delta
  # over fsdp: one all-gather, each device sending the 1024 values it holds.
  gathers = _fsdp_gathers(AxisType.Explicit, "vmap", True, delta_precision="I4",
                          delta_topk=3, delta_chunk=64)
  assert [(c.dtype, c.shape, c.bytes_sent) for c in gathers] == [("f32", (1, 64, 32), 4096)]

# The boundary of a shard_map with only the learner axis manual, on an explicit mesh:
# JAX (0.10.2) replicates the non-manual axes of every operand there, even for
# `lambda x: 2 * x` (test below). Inside, on both kinds of mesh, XLA gathers an
# fsdp-sharded operand before an all_to_all / all_gather over the manual axis, so the
# exchange runs on each device's own rows there (a nested shard_map, or a ring of
# ppermutes: gmjax.transform.collectives); this checks that the step itself gathers
# nothing over fsdp.
_BOUNDARY = "jit(<lambda>)/shard_map"


@pytest.mark.parametrize("shard_outer", [True, False], ids=["sharded", "replicated"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_partially_manual_shard_map_step_gathers_nothing_over_fsdp(axis_type, shard_outer):
  gathers = _fsdp_gathers(axis_type, "shard_map", shard_outer)
  assert [c for c in gathers if c.op_name != _BOUNDARY] == []
  if axis_type == AxisType.Auto:
    assert gathers == []


@pytest.mark.xfail(strict=True, reason="JAX replicates the non-manual axes of an explicit "
                   "mesh's operands at a partially manual shard_map's boundary")
def test_explicit_partially_manual_shard_map_boundary_gathers_nothing():
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((LEARNERS, 64, 32)), NamedSharding(mesh, P("learner", "fsdp")))
    double = jax.jit(jax.shard_map(lambda x: 2 * x, mesh=mesh, in_specs=P("learner"),
                                   out_specs=P("learner"), axis_names={"learner"}))
    text = double.lower(x).compile().as_text()
  assert [c for c in hlo.collective_bytes(text) if c.op == "all-gather"] == []


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_an_empty_leaf_on_an_fsdp_mesh_runs_as_unsharded(axis_type):
  # An empty leaf split over the learners (JAX cannot flatten one on an explicit mesh).
  optimizer = gmjax.diloco(optax.adam(1e-2), gmjax.DiLoCo(sync_every=2, fragments=2),
                           axis_name="learner")
  spmd = {"axis_name": "learner", "spmd_axis_name": "learner"}

  def step(params, state):
    updates, state = optimizer.update(jax.tree.map(jnp.sin, params), state, params)
    return optax.apply_updates(params, updates), state

  w = jnp.arange(LEARNERS * 64 * 32, dtype=jnp.float32).reshape(LEARNERS, 64, 32) / 1e4
  # Split over the learners only, and over fsdp too along a dimension past the first.
  z, y = jnp.ones((LEARNERS, 0, 8)), jnp.ones((LEARNERS, 0, 64))

  def run(mesh):
    params, mapped = {"w": w, "y": y, "z": z}, {"axis_name": "learner"}
    if mesh is not None:
      params = {"w": jax.device_put(w, NamedSharding(mesh, P("learner", "fsdp"))),
                "y": jax.device_put(y, NamedSharding(mesh, P("learner", None, "fsdp"))),
                "z": jax.device_put(z, NamedSharding(mesh, P("learner")))}
      mapped = spmd
    state = jax.vmap(optimizer.init, **mapped)(params)
    jitted = jax.jit(jax.vmap(step, **mapped))
    for _ in range(4):
      params, state = jax.block_until_ready(jitted(params, state))
    return jax.device_get((params, state.stats.rounds))

  (expected, rounds), mesh = run(None), jax.make_mesh((LEARNERS, FSDP), ("learner", "fsdp"),
                                                      axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    got, got_rounds = run(mesh)
  np.testing.assert_array_equal(got["w"], expected["w"])
  assert got["z"].shape == (LEARNERS, 0, 8) and got["y"].shape == (LEARNERS, 0, 64)
  np.testing.assert_array_equal(got_rounds, rounds)
  assert rounds.min() == 4  # two fragments, each syncing every 2 steps


@pytest.mark.parametrize("shard_outer", [True, False])
def test_one_learner_on_an_explicit_mesh_trains_as_without_a_mesh(shard_outer):
  # One learner's dimension of size 1: the sync's Gram matrix and finiteness counts came
  # out laid out differently, and their concatenation refused to trace (ShardingTypeError
  # at the first sync with the default sharded outer step).
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2, overlap_steps=0),
                           axis_name="learner", shard_outer=shard_outer)

  def step(params, state):
    grads = jax.grad(lambda p: jnp.sum((p["w"] - 1.0) ** 2))(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  spmd = dict(axis_name="learner", spmd_axis_name="learner")
  w = jax.random.normal(jax.random.key(0), (1, 64, 32))
  plain = {"w": w}, jax.vmap(optimizer.init, axis_name="learner")({"w": w})
  mesh = jax.make_mesh((1, FSDP), ("learner", "fsdp"), axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:FSDP])
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(w, NamedSharding(mesh, P("learner", "fsdp", None)))}
    placed = params, jax.vmap(optimizer.init, **spmd)(params)
    mapped = jax.jit(jax.vmap(step, **spmd))
    for _ in range(4):
      placed = jax.block_until_ready(mapped(*placed))
  unmapped = jax.jit(jax.vmap(step, axis_name="learner"))
  for _ in range(4):
    plain = jax.block_until_ready(unmapped(*plain))
  assert int(placed[1].stats.rounds[0]) == 2
  assert tuple(jax.typeof(placed[0]["w"]).sharding.spec)[:2] == ("learner", "fsdp")
  np.testing.assert_allclose(placed[0]["w"], plain[0]["w"], rtol=1e-6, atol=1e-6)
