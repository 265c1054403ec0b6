"""Fragments by blocks of layers (``DiLoCo(layer_axis=...)``, ``gmjax.core.layers``).

A stacked leaf cut into blocks of layers must train exactly as a model whose blocks are
leaves of their own, synced on the same plan: the numpy DiLoCo loop runs on those
separate leaves and knows nothing of the cut.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax
from gmjax.transform import hlo, shards
import transform_harness as harness
import transform_reference as reference

LAYERS = 5
SHAPES = {"emb": (6, 2), "layers/b": (LAYERS, 3), "layers/w": (LAYERS, 4, 2), "out": (7,)}


def nested(flat):
  return {"emb": flat["emb"], "out": flat["out"],
          "layers": {"b": flat["layers/b"], "w": flat["layers/w"]}}


def test_the_plan_is_blocks_of_layers_in_layer_order():
  config = gmjax.DiLoCo(sync_every=6, fragments=3, layer_axis={"layers": 0})
  schema = gmjax.Schema.from_tree(nested({n: np.zeros(s, np.float32)
                                          for n, s in SHAPES.items()}))
  # Blocks of 5 layers in 3: [0, 1), [1, 3), [3, 5). Their bytes: 44, 88, 88; then emb
  # (48 bytes) joins the lightest (block 0), out (28) the next lightest (block 0, 92, is
  # heavier than block 1, 88).
  assert config.plan(schema) == (
      ("emb", "layers/b[0:1]", "layers/w[0:1]"),
      ("layers/b[1:3]", "layers/w[1:3]", "out"),
      ("layers/b[3:5]", "layers/w[3:5]"),
  )
  cut = config.cut(schema)
  assert cut["layers/w[1:3]"].shape == (2, 4, 2) and cut["emb"].shape == (6, 2)
  again = config.cut(cut)  # cut again from its source: the same blocks
  assert again == cut and again.pieces == cut.pieces and again.source is schema
  assert config.schedule(schema).fragments == 3
  # More fragments than layers: one block per layer.
  many = gmjax.DiLoCo(sync_every=8, fragments=8, layer_axis={"layers": 0})
  assert len(many.plan(schema)) == LAYERS


def test_a_schema_cut_under_another_configuration_is_cut_again_from_its_source():
  # It was taken as it was: two fragments' configuration planned four, and schedule
  # reported four fragments, which schedule(4) refuses.
  schema = gmjax.Schema.from_tree(nested({n: np.zeros(s, np.float32)
                                          for n, s in SHAPES.items()}))
  four = gmjax.DiLoCo(sync_every=8, fragments=4, layer_axis={"layers": 0}).cut(schema)
  two = gmjax.DiLoCo(sync_every=8, fragments=2, layer_axis={"layers": 0})
  assert two.plan(four) == two.plan(schema) and len(two.plan(four)) == 2
  assert two.schedule(four).fragments == 2
  whole = gmjax.DiLoCo(sync_every=8, fragments=2)
  assert whole.plan(four) == whole.plan(schema)
  assert sorted(n for f in whole.plan(four) for n in f) == sorted(SHAPES)
  whole.check_parameters(four)


def test_a_mail_runs_schema_plans_as_the_run(tmp_path):
  # The manifest keeps the blocks' specs only: cut again by name, run.schema gave
  # blocks of blocks ('layers/b[0:2][0:1]'), another plan and 2 fragments for 4.
  config = gmjax.DiLoCo(sync_every=8, fragments=4, layer_axis={"layers": 0})
  shapes = {**SHAPES, "layers/b": (8, 3), "layers/w": (8, 4, 2)}
  params = nested({n: np.zeros(s, np.float32) for n, s in shapes.items()})
  created = gmjax.mail.create(str(tmp_path / "run"), params, config)
  for run in (created, gmjax.mail.open(str(tmp_path / "run"))):
    assert run.config.plan(run.schema) == run.plan and len(run.plan) == 4
    assert run.config.schedule(run.schema).fragments == 4
    assert run.schema.source == gmjax.Schema.from_tree(params)
  shapes["layers/w"] = (8, 4, 3)
  # A leaf of its own named like a block stays a leaf (it took the schema's source away).
  named = {"layers": {"w": np.zeros((5, 3), np.float32)}, "z[0:3]": np.zeros(3, np.float32)}
  other = gmjax.mail.open(str(gmjax.mail.create(str(tmp_path / "named"), named,
                                                config).url))
  assert other.config.plan(other.schema) == other.plan and other.schema.source is not None
  learner = created.join("a")
  with pytest.raises(ValueError, match=r"run\.schema\.source holds the stacked leaves"):
    learner.pull(nested({n: np.zeros(s, np.float32) for n, s in shapes.items()}))
  learner.close(learner.pull(params))


def test_maxtext_layout_stacks_layers_on_axis_one():
  # MaxText's scan_layers keeps the layers on axis 1 (param_scan_axis) under
  # decoder/layers; everything else is whole.
  tree = {"decoder": {"layers": {"mlp": {"wi": np.zeros((8, 4, 16), np.float32),
                                         "wo": np.zeros((16, 4, 8), np.float32)},
                                 "pre_norm": {"scale": np.ones((8, 4), np.float32)}},
                      "decoder_norm": {"scale": np.ones((8,), np.float32)}},
          "token_embedder": {"embedding": np.zeros((32, 8), np.float32)}}
  config = gmjax.DiLoCo(sync_every=4, fragments=2, layer_axis={"decoder/layers": 1})
  plan = config.plan(gmjax.Schema.from_tree(tree))
  assert plan == (
      ("decoder/layers/mlp/wi[0:2]", "decoder/layers/mlp/wo[0:2]",
       "decoder/layers/pre_norm/scale[0:2]", "token_embedder/embedding"),
      ("decoder/decoder_norm/scale", "decoder/layers/mlp/wi[2:4]",
       "decoder/layers/mlp/wo[2:4]", "decoder/layers/pre_norm/scale[2:4]"),
  )
  cut = config.cut(gmjax.Schema.from_tree(tree))
  assert cut["decoder/layers/mlp/wo[2:4]"].shape == (16, 2, 8)
  flat = cut.flatten(tree)
  flat["decoder/layers/mlp/wo[2:4]"] = np.ones((16, 2, 8), np.float32)
  back = cut.unflatten(flat)
  np.testing.assert_array_equal(back["decoder"]["layers"]["mlp"]["wo"][:, 2:],
                                np.ones((16, 2, 8)))
  np.testing.assert_array_equal(back["decoder"]["layers"]["mlp"]["wo"][:, :2], 0)
  assert back["decoder"]["layers"]["mlp"]["wi"] is tree["decoder"]["layers"]["mlp"]["wi"]


@pytest.mark.parametrize("layer_axis,match", [
    ({"blocks": 0}, "'blocks', which is no leaf"),
    # A typo was answered with the first 8 leaf names and '...', not the path meant.
    ({"layer": 0}, r"did you mean \['layers'.*top-level paths are \['emb', 'layers'"),
    ({"layers": 3}, "has no axis 3"),
    ({"layers": 0, "emb": 0}, "different numbers of layers"),
    ({"layers": -1}, "non-negative axis"),
    ({}, "non-empty dict"),
    ("layers", "non-empty dict"),
])
def test_bad_layer_axis_is_refused_with_its_value(layer_axis, match):
  params = nested({n: np.zeros(s, np.float32) for n, s in SHAPES.items()})
  with pytest.raises(ValueError, match=match):
    config = gmjax.DiLoCo(sync_every=4, fragments=2, layer_axis=layer_axis)
    gmjax.diloco(optax.sgd(0.1), config).init(params)


@pytest.mark.parametrize("tree,match", [
    # Zero layers: a ZeroDivisionError in cutting the blocks.
    ({"emb": (4, 3), "layers": {"w": (0, 2, 3), "b": (0, 2)}}, r"no layers.*'layers/b'"),
    # A leaf named like a block: blamed on '/' in keys, without naming layer_axis.
    ({"layers[0:1]": (2,), "layers": (2, 3)}, r"cuts leaf 'layers' into blocks named like"
                                              r" 'layers\[0:1\]', which is also a leaf"),
], ids=["zero-layers", "block-name-taken"])
def test_a_tree_layer_axis_cannot_cut_is_refused_naming_it(tree, match):
  params = jax.tree.map(lambda s: np.zeros(s, np.float32), tree,
                        is_leaf=lambda x: isinstance(x, tuple))
  config = gmjax.DiLoCo(sync_every=4, fragments=2, layer_axis={"layers": 0})
  with pytest.raises(ValueError, match=match):
    gmjax.diloco(optax.sgd(0.1), config).init(params)


def test_layer_axis_survives_json():
  config = gmjax.DiLoCo(sync_every=4, fragments=2, layer_axis={"decoder/layers": 1})
  again = gmjax.DiLoCo.from_json(config.to_json())
  assert again == config and hash(again) == hash(config)
  assert "layer_axis" not in gmjax.DiLoCo(sync_every=4).to_json()


def _setups(learners, fragments, **settings):
  """The setup of the stacked model and that of its blocks as separate leaves."""
  rng = np.random.default_rng(1)
  draw = lambda scale: {n: (scale * rng.standard_normal(s)).astype(np.float32)
                        for n, s in SHAPES.items()}
  theta0 = [draw(1.0) for _ in range(learners)]
  targets = [draw(2.0) for _ in range(learners)]
  config = gmjax.DiLoCo(sync_every=6, fragments=fragments, layer_axis={"layers": 0})
  schema = gmjax.Schema.from_tree(nested(theta0[0]))
  cut = config.cut(schema)
  pieces = lambda tree: dict(cut.flatten(nested(tree)))
  setup = reference.Setup(
      theta0=[pieces(t) for t in theta0], targets=[pieces(t) for t in targets],
      curvature=[0.5 + 0.25 * m for m in range(learners)],
      plan=[tuple(f) for f in config.plan(schema)], sync_every=6, **settings)
  return setup, theta0, targets, cut


@pytest.mark.parametrize("learners,fragments,settings,shard", [
    (3, 3, dict(mixing=0.5, overlap=1), True),
    (3, 2, dict(delta_precision="I4", commit_precision="BF16", error_feedback=1.0), True),
    (3, 3, dict(delta_precision="F8_E4M3", overlap=2), False),
    (2, 2, dict(outer_delay=1, eager=True), True),
    (1, 3, dict(mixing=0.5), None),
])
def test_layer_blocks_match_numpy_diloco_on_separate_leaves(learners, fragments, settings,
                                                            shard):
  steps = 14
  setup, theta0, targets, cut = _setups(learners, fragments, **settings)
  config = dataclasses.replace(harness.config_of(setup), layer_axis={"layers": 0})
  expected = reference.run(setup, steps)
  stack = lambda trees: jax.tree.map(lambda *v: jnp.stack(v), *map(nested, trees))
  if shard is None:  # one learner, no mapped axis
    optimizer = gmjax.diloco(optax.sgd(setup.lr), config)
    step = jax.jit(harness.learner_step(optimizer, with_tokens=False))
    params = jax.tree.map(jnp.asarray, nested(theta0[0]))
    state = optimizer.init(params)
    for _ in range(steps):
      params, state = step(params, state, nested(targets[0]), setup.curvature[0], None)
    params = jax.tree.map(lambda v: v[None], params)
  else:
    optimizer = gmjax.diloco(optax.sgd(setup.lr), config, axis_name="learner",
                             shard_outer=shard)
    params = stack(theta0)  # the first update moves every learner onto learner 0's
    state = jax.vmap(optimizer.init, axis_name="learner")(params)
    step = jax.jit(jax.vmap(harness.learner_step(optimizer, with_tokens=False),
                            axis_name="learner"))
    for _ in range(steps):
      params, state = jax.block_until_ready(step(
          params, state, stack(targets), jnp.asarray(setup.curvature, jnp.float32), None))
  assert step._cache_size() == 1
  for m in range(learners):
    got = cut.flatten(jax.tree.map(lambda v, m=m: np.asarray(v[m]), params))
    for name in cut.names:
      np.testing.assert_allclose(got[name], expected["theta"][m][name], rtol=2e-5,
                                 atol=2e-6, err_msg=f"learner {m}, piece {name}")
  anchor = cut.flatten(jax.tree.map(lambda v: np.asarray(v)[0] if shard is not None
                                    else np.asarray(v), state.anchor))
  for name in cut.names:
    np.testing.assert_allclose(anchor[name], expected["anchor"][name], rtol=2e-5,
                               atol=2e-6, err_msg=f"anchor {name}")
  # The state keeps whole leaves where the parameters have them; the masters in each
  # fragment's buckets, which hold its pieces' rows (a block of layers among them).
  assert state.anchor["layers"]["w"].shape[-3:] == (LAYERS, 4, 2)
  if "commit_precision" in settings:
    assert len(state.master) == len(setup.plan) == fragments
    for names, kept in zip(setup.plan, state.master):
      rows = sum(shards.row_count(int(np.prod(np.shape(setup.theta0[0][n]))),
                                  learners if shard else 1) for n in names)
      assert sum(x.shape[-2] for x in jax.tree.leaves(kept)) == rows, names


@pytest.mark.parametrize("split", ["rows", "layers"])
def test_explicit_fsdp_mesh_keeps_blocks_local_and_matches_vmap(split):
  # Layers on axis 0, the rows of each layer split over fsdp (axis 1): each device cuts
  # its block from its own rows, so the step gathers nothing over fsdp. With the layers
  # themselves split over fsdp (a rule that splits every leaf's leading axis), writing
  # a block back into its leaf failed to trace on an explicit mesh.
  learners, fsdp = 2, 4
  rng = np.random.default_rng(3)
  one = {"layers": {"w": rng.standard_normal((4, 8, 64)).astype(np.float32)},
         "out": rng.standard_normal((64,)).astype(np.float32)}
  params = jax.tree.map(lambda v: np.stack([v] * learners), one)
  targets = jax.tree.map(lambda v: rng.standard_normal(v.shape).astype(np.float32), params)
  config = gmjax.DiLoCo(sync_every=4, fragments=2, layer_axis={"layers": 0},
                        delta_precision="I4")
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")
  step = harness.learner_step(optimizer, with_tokens=False)
  curvature = jnp.ones([learners], jnp.float32)

  def train(params, targets, jitted, steps=8):
    state = jax.vmap(optimizer.init, axis_name="learner")(params)
    for _ in range(steps):
      params, state = jax.block_until_ready(jitted(params, state, targets, curvature, None))
    return params, state

  plain, _ = train(jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, targets),
                   jax.jit(jax.vmap(step, axis_name="learner")))
  mesh = jax.make_mesh((learners, fsdp), ("learner", "fsdp"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  layers = ("learner", None, "fsdp") if split == "rows" else ("learner", "fsdp", None)
  specs = {"layers": {"w": jax.P(*layers)}, "out": jax.P("learner")}
  with jax.set_mesh(mesh):
    put = lambda tree: jax.tree.map(
        lambda v, s: jax.device_put(v, jax.NamedSharding(mesh, s)), tree, specs)
    curvature = jax.device_put(curvature, jax.NamedSharding(mesh, jax.P("learner")))
    jitted = jax.jit(jax.vmap(step, axis_name="learner", spmd_axis_name="learner"))
    sharded, state = train(put(params), put(targets), jitted)
    text = jitted.lower(sharded, state, put(targets), curvature, None).compile().as_text()
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  for leaf in (sharded["layers"]["w"], state.anchor["layers"]["w"]):
    assert tuple(leaf.sharding.spec)[:3] == layers
    assert set(tuple(leaf.sharding.spec)[3:]) <= {None}
  if split == "layers":
    return  # a block is not one device's own: it crosses fsdp
  gathers = [c for c in hlo.collective_bytes(text)
             if c.op == "all-gather" and c.group_size != learners]
  assert gathers == []


@pytest.mark.parametrize("layer_axis", [{"layers": 0}, None])
def test_a_state_built_under_another_plan_is_refused(layer_axis):
  # A state saved without layer_axis, resumed with it (or the other way round), had
  # buckets of the same shapes: update took it and read every master in the other
  # plan's layout, and Θ took other leaves' values (w's rows became f's).
  bf16 = jnp.bfloat16  # bf16 parameters keep F32 masters
  params = {"layers": {"w": jnp.full((2, 32), 1.0, bf16).at[1].set(2.0)},
            "e": jnp.full((32,), 3.0, bf16), "f": jnp.full((32,), 4.0, bf16)}
  settings = dict(sync_every=4, fragments=2, outer_momentum=0.0)
  other = {"layers": 0} if layer_axis is None else None
  built = gmjax.diloco(optax.sgd(0.0), gmjax.DiLoCo(layer_axis=other, **settings))
  resumed = gmjax.diloco(optax.sgd(0.0), gmjax.DiLoCo(layer_axis=layer_axis, **settings))
  state = built.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(ValueError, match=r"state\.master.*pieces.*another configuration"):
    resumed.update(grads, state, params)
  resumed.update(grads, resumed.init(params), params)  # its own state steps


def test_overlapping_prefixes_take_the_longest_whatever_their_order():
  # The later prefix won: {"layers": 0, "layers/w": 1} and its reverse cut layers/w on
  # different axes, yet the two configs compared and hashed equal (a jit keyed on one
  # reused its program for the other).
  schema = gmjax.Schema.from_tree({"layers": {"w": np.zeros((4, 4, 8), np.float32),
                                              "b": np.zeros((4, 8), np.float32)}})
  first, second = (gmjax.DiLoCo(sync_every=4, fragments=2, layer_axis=dict(order))
                   for order in ([("layers", 0), ("layers/w", 1)],
                                 [("layers/w", 1), ("layers", 0)]))
  assert first == second and hash(first) == hash(second)
  for config in (first, second):
    assert {p.name: p.shape for p in config.cut(schema).parameters} == {
        "layers/b[0:2]": (2, 8), "layers/b[2:4]": (2, 8),
        "layers/w[0:2]": (4, 2, 8), "layers/w[2:4]": (4, 2, 8)}


def test_layer_axis_takes_numpy_integers_as_the_other_fields_do():
  config = gmjax.DiLoCo(sync_every=np.int64(4), fragments=2,
                        layer_axis={"layers": np.int64(0)})
  assert config.layer_axis == {"layers": 0} and type(config.layer_axis["layers"]) is int
  assert gmjax.DiLoCo.from_json(config.to_json()) == config
