"""``gmjax.diloco`` refuses what it cannot run, with messages that say how to fix it."""

import dataclasses

import jax

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gmjax


def test_public_names():
  assert gmjax.diloco is not None
  assert {"diloco", "DiLoCoState", "DiLoCoStatistics"} <= set(gmjax.__all__)


def test_overlap_none_is_refused():
  config = gmjax.DiLoCo(sync_every=4, overlap_steps=None)
  with pytest.raises(ValueError, match="overlap_steps=None"):
    gmjax.diloco(optax.sgd(0.1), config)


def test_config_and_inner_types_are_checked():
  with pytest.raises(TypeError, match="gmjax.DiLoCo"):
    gmjax.diloco(optax.sgd(0.1), {"sync_every": 4})
  with pytest.raises(TypeError, match="GradientTransformation"):
    gmjax.diloco("adam", gmjax.DiLoCo(sync_every=4))
  for value in (1, 0, "yes"):  # 1 and 0 compare equal to True and False
    with pytest.raises(ValueError, match=f"shard_outer must be None or a bool, got {value!r}"):
      gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4), axis_name="l",
                   shard_outer=value)


def test_update_needs_params_and_scalar_tokens():
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4))
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  with pytest.raises(ValueError, match="needs params"):
    optimizer.update(params, state)
  with pytest.raises(ValueError, match="tokens must be one number"):
    optimizer.update(params, state, params, tokens=jnp.ones(2))


def test_initial_state():
  config = dataclasses.replace(gmjax.DiLoCo(sync_every=6, fragments=2), mixing=0.5)
  params = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros(4)}
  state = gmjax.diloco(optax.adam(1e-3), config).init(params)
  assert isinstance(state, gmjax.DiLoCoState)
  assert state.count.dtype == jnp.int32 and int(state.count) == 0
  assert state.anchor["w"].dtype == jnp.bfloat16
  # Per fragment, a master for each bucket (here one leaf each): w's rows (F=1, R=1, 32)
  # in F32; b is F32, so Θ is its own master.
  plan = config.plan(gmjax.Schema.from_tree(params))
  (w,), (b,) = (state.master[plan.index((name,))] for name in ("w", "b"))
  assert w.dtype == jnp.float32 and w.shape == (1, 1, 32)
  assert isinstance(b, optax.MaskedNode)
  assert state.pending.shape == (2,) and state.tokens.shape == (2, 2)
  assert int(state.stats.rounds) == 0 and int(state.stats.fragment) == -1
  assert np.isnan(state.stats.cosine)


def test_state_shares_no_buffer_with_params():
  config = gmjax.DiLoCo(sync_every=4, commit_precision="I4")
  params = {"w": jnp.ones((3, 2)), "h": jnp.ones(4, jnp.bfloat16)}
  state = gmjax.diloco(optax.sgd(0.1), config).init(params)
  pointers = lambda tree: {x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}
  assert not pointers(params) & pointers((state.anchor, state.master))
  assert not pointers(state.anchor) & pointers(state.master)


def test_sharded_outer_refuses_a_non_elementwise_optimizer():
  config = gmjax.DiLoCo(sync_every=4, outer="custom")
  # Muon, SM3 and Adafactor pass a probe on a vector (whole against its halves): their
  # coupling is across a matrix's rows and columns.
  for outer in (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.7)),
                optax.lamb(0.1), optax.contrib.muon(0.05), optax.sm3(0.1),
                optax.adafactor(0.1)):
    with pytest.raises(ValueError, match="not elementwise.*shard_outer=False"):
      gmjax.diloco(optax.sgd(0.1), config, outer=outer, axis_name="learner")
    gmjax.diloco(optax.sgd(0.1), config, outer=outer, axis_name="learner",
                 shard_outer=False)
  with pytest.raises(ValueError, match="shard_outer=False"):
    gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4, outer="lamb"),
                 axis_name="learner")
  # Elementwise ones pass: by alias, and by the probe.
  gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4, outer="adam"), axis_name="l")
  gmjax.diloco(optax.sgd(0.1), config, outer=optax.chain(optax.scale_by_adam(),
                                                         optax.scale(-0.1)), axis_name="l")
  with pytest.raises(ValueError, match="axis_name is None"):
    gmjax.diloco(optax.sgd(0.1), config, outer=optax.sgd(0.7), shard_outer=True)


def test_sharded_init_outside_the_axis_says_how():
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4), axis_name="learner")
  params = {"w": jnp.ones((2, 3))}
  with pytest.raises(ValueError, match="init must run inside"):
    jax.vmap(optimizer.init)(params)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  assert state.anchor["w"].shape == (2, 3)


def test_axis_misuse_names_the_bound_axes_and_the_fix():
  params = {"w": jnp.ones((2, 3))}
  wrong = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4), axis_name="learners")
  with pytest.raises(ValueError, match=r"init must run inside the learners' mapped axis"
                                       r" 'learners'.*bound here are \['learner'\].*"
                                       r"axis_name='learner'"):
    jax.vmap(wrong.init, axis_name="learner")(params)
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4), axis_name="learner")
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  one = jax.tree.map(lambda x: x[0], state)
  with pytest.raises(ValueError, match=r"update must run inside.*no mapped axis is bound"
                                       r".*jax.vmap\(optimizer.update"):
    optimizer.update({"w": jnp.ones(3)}, one, {"w": jnp.ones(3)})
  # Replicated, init runs anywhere; update still needs the axis (not JAX's NameError).
  replicated = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4), axis_name="learner",
                            shard_outer=False)
  state = replicated.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"update must run inside.*'learner'"):
    replicated.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3)})


def test_params_reshaped_after_init_are_named():
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4))
  state = optimizer.init({"w": jnp.ones((2, 3)), "b": jnp.ones(3)})
  params = {"w": jnp.ones((3, 2)), "b": jnp.ones(3)}
  with pytest.raises(ValueError, match=r"params\['w'\] of shape \(3, 2\).*shape \(2, 3\)"
                                       r".*optimizer.init"):
    optimizer.update(params, state, params)
  with pytest.raises(ValueError, match=r"params structured otherwise than the state's anchor"
                                       r" \(a leaf at \['b'\] in the state's anchor, not in"
                                       r" params\)"):
    optimizer.update({"w": jnp.ones((2, 3))}, state, {"w": jnp.ones((2, 3))})


def test_params_cast_after_init_are_named():
  # The message spoke of a state built for another configuration (a master it lacks).
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4))
  state = optimizer.init({"w": jnp.ones((2, 3))})
  params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"params\['w'\] of dtype bfloat16, but the state"
                                       r" was built for float32.*optimizer.init"):
    optimizer.update(params, state, params)


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(0.1)], ids=["sgd", "adam"])
def test_updates_unlike_the_params_are_named(inner):
  optimizer = gmjax.diloco(inner, gmjax.DiLoCo(sync_every=4))
  params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
  state = optimizer.init(params)
  with pytest.raises(ValueError, match=r"updates\['w'\] of shape \(3,\), but params\['w'\]"
                                       r" has shape \(2, 3\).*gradients of these params"):
    optimizer.update({"w": jnp.ones(3), "b": jnp.ones(3)}, state, params)
  # The structures were printed whole (a model's: thousands of characters); the first
  # leaf that differs says it.
  with pytest.raises(ValueError, match=r"updates structured otherwise than params"
                                       r" \(a leaf at \['v'\] in updates, not in params\)"
                                       r".*gradients of these params"):
    optimizer.update({"v": jnp.ones((2, 3)), "b": jnp.ones(3)}, state, params)
  with pytest.raises(ValueError, match=r"a leaf at the root in updates, not in params"):
    optimizer.update(jnp.ones(3), state, params)


def test_gradients_of_another_dtype_than_the_params_are_named():
  # The first update took them and returned adam's moments in F32; the second refused
  # that state as "built for another configuration".
  optimizer = gmjax.diloco(optax.adam(0.1), gmjax.DiLoCo(sync_every=4))
  params = {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.ones(3, jnp.bfloat16)}
  state = optimizer.init(params)
  grads = {"w": jnp.ones((2, 3)), "b": jnp.ones(3, jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"update returns state\.inner_state\[0\]\.mu\['w'\]"
                     r" as dtype float32, where the state holds dtype bfloat16 .* updates"
                     r"\['w'\] are float32 where params\['w'\] are bfloat16.*g\.astype"):
    optimizer.update(grads, state, params)
  # A stateless inner optimizer takes them, as optax does.
  plain = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4))
  plain_state = plain.init(params)
  for _ in range(2):
    updates, plain_state = plain.update(grads, plain_state, params)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  updates, state = optimizer.update(grads, state, params)
  optimizer.update(grads, state, optax.apply_updates(params, updates))


def test_an_inner_state_holding_a_prng_key_trains():
  # optax.add_noise keeps a typed key: the state check called canonicalize_dtype on it,
  # which refuses extended dtypes ("Internal: canonicalize_dtype called on ...").
  inner = optax.chain(optax.add_noise(0.01, 0.55, 0), optax.adam(1e-2))
  optimizer = gmjax.diloco(inner, gmjax.DiLoCo(sync_every=2, overlap_steps=0),
                           axis_name="learner")
  x = jnp.arange(24.0).reshape(2, 3, 4) / 10

  def step(params, state, x, scale):
    grads = jax.grad(lambda q: jnp.mean((x @ q["w"] - 1) ** 2))(params)
    updates, state = optimizer.update(jax.tree.map(lambda g: g * scale, grads), state,
                                      params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(step, axis_name="learner", in_axes=(0, 0, 0, None)))
  params = {"w": jnp.ones((2, 4, 2))}
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  for t in range(6):  # a step with an infinite gradient is dropped (t = 2), and counts
    params, state = step(params, state, x, jnp.inf if t == 2 else 1.0)
    assert np.isfinite(np.asarray(params["w"])).all()
  assert step._cache_size() == 1  # pylint: disable=protected-access
  # Step 5 synced with overlap_steps=0: both learners stand on Θ.
  np.testing.assert_array_equal(params["w"][0], params["w"][1])


@pytest.mark.parametrize("built,used,where", [
    ({"fragments": 2}, {"fragments": 3}, r"state\.(anchor|master|outer_state)"),
    ({"delta_precision": "I4"}, {"delta_precision": "I4", "error_feedback": 1.0},
     r"state\.residual"),
    ({"delta_precision": "I4", "error_feedback": 1.0}, {"delta_precision": "I4"},
     r"state\.residual"),
    ({}, {"outer": "adam", "outer_learning_rate": 0.1}, r"state\.outer_state"),
    ({}, {"commit_precision": "F8_E4M3"}, r"state\.master"),
    ({"overlap_steps": 0}, {"overlap_steps": 0, "outer_delay": 1}, r"state\.delay"),
    ({}, {"layer_axis": {"w": 0}}, r"state\.(anchor|master|outer_state)"),
    # Shapes alike, dtypes not: the round's loops failed inside JAX on the carry's type.
    ({}, {"outer_options": {"accumulator_dtype": "bfloat16"}},
     r"state\.outer_state.* is dtype float32, where .* builds dtype bfloat16"),
    ({"outer_options": {"accumulator_dtype": "bfloat16"}}, {},
     r"state\.outer_state.* is dtype bfloat16, where .* builds dtype float32"),
], ids=["fragments", "feedback_on", "feedback_off", "outer", "commit", "delay", "layers",
        "outer_dtype", "outer_dtype_back"])
def test_a_state_built_for_another_configuration_is_named(built, used, where):
  # A checkpoint restored under a changed config: the state's layout is not the one
  # this optimizer's init builds, which update says instead of failing inside JAX.
  base = {"sync_every": 4, "fragments": 2, "overlap_steps": 1}
  make = lambda changes: gmjax.diloco(optax.adam(0.1), gmjax.DiLoCo(**{**base, **changes}),
                                      axis_name="learner")
  params = {"w": jnp.ones((2, 64, 32)), "b": jnp.ones((2, 40)), "c": jnp.ones((2, 16))}
  state = jax.vmap(make(built).init, axis_name="learner")(params)
  update = jax.vmap(make(used).update, axis_name="learner")
  with pytest.raises(ValueError, match=where + r".*built for another configuration.*"
                                       r"restore it with the config it was saved with"):
    update(params, state, params)


def test_a_state_cut_to_fewer_learners_is_refused_where_its_shards_agree():
  # 160 values are 5 codec blocks: 2 a learner both at 4 learners (padded to 8) and at
  # 3 (to 6). A 4-learner state cut to 3 learners' rows had the shapes a 3-learner init
  # builds: update took it, and learner 0, which owned blocks 0 and 4, now stepped
  # blocks 0 and 3 with their momentum (Θ off by 0.11 on values 96-159).
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2), axis_name="learner")
  init = jax.vmap(optimizer.init, axis_name="learner")
  update = jax.vmap(optimizer.update, axis_name="learner")
  params = {"w": jnp.zeros((4, 160))}
  cut = jax.tree.map(lambda x: x[:3], init(params))
  three = jax.tree.map(lambda x: x[:3], params)
  assert [x.shape for x in jax.tree.leaves(cut.outer_state)] == [
      x.shape for x in jax.tree.leaves(jax.eval_shape(init, three).outer_state)]
  with pytest.raises(ValueError, match=r"state\.master is \(Kept\(learners=4, .* builds"
                                       r" \(Kept\(learners=3, .*another configuration"):
    update(three, cut, three)
  update(three, init(three), three)  # its own state steps


@pytest.mark.parametrize("built,used,where", [
    (optax.sgd(0.1), optax.adam(0.1),
     r"state\.inner_state is \(EmptyState\(\), EmptyState\(\)\), where .* builds"
     r" \(ScaleByAdamState"),
    (optax.adam(0.1), optax.sgd(0.1, momentum=0.9),
     r"state\.inner_state\[0\] is ScaleByAdamState\(.*builds TraceState"),
    (optax.adam(0.1), optax.adamw(0.1), r"state\.inner_state is \(ScaleByAdamState"),
], ids=["sgd_adam", "adam_momentum", "adam_adamw"])
def test_a_state_of_another_inner_optimizer_names_the_inner_state(built, used, where):
  # It named state.count twice, "() where init builds ()", or a NamedTuple's count method.
  config = gmjax.DiLoCo(sync_every=4, overlap_steps=0)
  params = {"w": jnp.zeros(3)}
  state = gmjax.diloco(built, config).init(params)
  with pytest.raises(ValueError, match=where) as caught:
    gmjax.diloco(used, config).update(params, state, params)
  assert "builtin" not in str(caught.value) and "PyTreeDef" not in str(caught.value)


def test_a_masked_part_shows_as_masked_not_as_a_shape():
  config = gmjax.DiLoCo(sync_every=4, overlap_steps=0)
  params = {"w": jnp.zeros(3), "v": jnp.zeros(3)}
  state = gmjax.diloco(optax.adam(0.1), config).init(params)
  two = gmjax.diloco(optax.adam(0.1), dataclasses.replace(config, fragments=2))
  with pytest.raises(ValueError, match=r"state\.outer_state") as caught:
    two.update(params, state, params)
  assert "(((0,),),)" not in str(caught.value)


def test_a_state_built_for_another_outer_layout_is_named():
  config = gmjax.DiLoCo(sync_every=4, fragments=2, overlap_steps=1)
  params = {"w": jnp.ones((2, 64, 32)), "b": jnp.ones((2, 40))}
  replicated = gmjax.diloco(optax.adam(0.1), config, axis_name="learner", shard_outer=False)
  sharded = gmjax.diloco(optax.adam(0.1), config, axis_name="learner")
  state = jax.vmap(replicated.init, axis_name="learner")(params)
  with pytest.raises(ValueError, match=r"state\.(master|outer_state).*shape"):
    jax.vmap(sharded.update, axis_name="learner")(params, state, params)


def test_token_counts_stay_exact_past_2_to_the_24():
  # 2^24 + 1 tokens a step: an F32 count would lose the odd token at once.
  config = gmjax.DiLoCo(sync_every=8)
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")
  params = {"w": jnp.ones((2, 3))}
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(lambda p, s, k: optimizer.update(p, s, p, tokens=k),
                          axis_name="learner"))
  per_step = jnp.asarray([2**24 + 1, 2**30 + 3], jnp.int32)
  for _ in range(5):
    _, state = step(params, state, per_step)
  tokens = np.asarray(state.tokens, np.int64)
  counted = tokens[..., 0] * 2**24 + tokens[..., 1]
  np.testing.assert_array_equal(counted[:, 0], [5 * (2**24 + 1), 5 * (2**30 + 3)])


def test_an_outer_given_in_code_needs_a_custom_config():
  with pytest.raises(ValueError, match=(
      r"outer= was given, but config.outer='sgd' \(learning_rate 0.7, momentum 0.9,"
      r" nesterov\) is what the config says would run.*dataclasses.replace\(config,"
      r" outer='custom'\).*drop outer=")):
    gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4), outer=optax.adam(0.1))
  adam = gmjax.DiLoCo(sync_every=4, outer="adam", outer_options={"b1": 0.8})
  with pytest.raises(ValueError, match=r"config.outer='adam' \(learning_rate 0.7, b1 0.8\)"):
    gmjax.diloco(optax.sgd(0.1), adam, outer=optax.adam(0.1))
  with pytest.raises(ValueError, match=r"config.outer='custom' means the outer optimizer is"
                                       r" given in code, but outer= is None.*outer=tx"):
    gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=4, outer="custom"))


@pytest.mark.parametrize("shard_outer", [True, False])
def test_a_custom_outer_runs_as_the_config_would(shard_outer):
  # The config's Nesterov SGD and the same optimizer given in code take the same steps.
  params = {"w": jnp.arange(12.0).reshape(2, 6) / 10}
  grads = {"w": jnp.stack([jnp.linspace(-1.0, 1.0, 6), jnp.linspace(2.0, 0.0, 6)])}

  def train(optimizer):
    state = jax.vmap(optimizer.init, axis_name="learner")(params)
    step = jax.jit(jax.vmap(lambda g, s, p: optimizer.update(g, s, p), axis_name="learner"))
    p = params
    for _ in range(6):
      updates, state = step(grads, state, p)
      p = optax.apply_updates(p, updates)
    return p, state

  config = gmjax.DiLoCo(sync_every=2)
  custom = dataclasses.replace(config, outer="custom")
  expected, _ = train(gmjax.diloco(optax.sgd(0.1), config, axis_name="learner",
                                   shard_outer=shard_outer))
  got, state = train(gmjax.diloco(
      optax.sgd(0.1), custom, outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
      axis_name="learner", shard_outer=shard_outer))
  np.testing.assert_array_equal(got["w"], expected["w"])
  assert state.stats.rounds.tolist() == [3, 3]
  assert gmjax.DiLoCo.from_json(custom.to_json()) == custom


def test_a_state_built_for_another_inner_optimizer_names_the_inner_state():
  # sgd's state has no leaves where adam's has three: the message named state.count,
  # "shape (), where this optimizer's init builds shape ()".
  params = {"w": jnp.ones((4, 3))}
  config = gmjax.DiLoCo(sync_every=4)
  state = gmjax.diloco(optax.sgd(0.1), config).init(params)
  with pytest.raises(ValueError, match=r"state\.inner_state is \(EmptyState\(\), EmptyState"
                                       r"\(\)\), where this optimizer's init builds"
                                       r" \(ScaleByAdamState\(count=\(\), mu=\{'w': \(4, 3\)\}"):
    gmjax.diloco(optax.adam(0.1), config).update(params, state, params)
