"""``gmjax.finish``: the global model Θ of an in-mesh run, with FSDP on an explicit mesh.

Θ equals the numpy reference's anchor, with a fragment's round done and its merge still
pending; it comes back at the parameters' dtype and sharding, inside the learners' axis
(every learner the same Θ) and outside it (one Θ without the learners' dimension).
"""

import contextlib
import functools
import logging

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
from gmjax.transform.state import MERGE
from test_transform_fsdp import (LEARNERS, SHARDED, STEPS, _build, _mesh, _place, _setup,
                                 _stacked)


@functools.cache
def _train(dtype=jnp.float32):
  """``STEPS`` steps on the explicit (learner, fsdp) mesh; ``(setup, mesh, params, state)``."""
  setup, config = _setup("F8_E4M3")
  optimizer = gmjax.diloco(optax.sgd(setup.lr), config, axis_name="learner")
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = _place(mesh, {n: v.astype(dtype) for n, v in _stacked(setup.theta0).items()})
    targets = _place(mesh, _stacked(setup.targets))
    curvature, tokens = jax.device_put(
        (jnp.asarray(setup.curvature, jnp.float32), jnp.ones(LEARNERS, jnp.float32)),
        NamedSharding(mesh, P("learner")))
    init, step = _build(optimizer, mesh, "vmap")
    state = init(params)
    for _ in range(STEPS):
      params, state = jax.block_until_ready(step(params, state, targets, curvature, tokens))
  return setup, mesh, params, state


def test_finish_is_the_reference_anchor_laid_out_as_the_parameters():
  setup, mesh, params, state = _train()
  # The run stops between a round and its merge: Θ already holds that round.
  assert int(np.max(np.asarray(state.pending))) == MERGE
  expected = reference.run(setup, STEPS)["anchor"]
  with jax.set_mesh(mesh):
    outside = gmjax.finish(state, params, learner_axis=0)
    jitted = jax.jit(gmjax.finish, static_argnames="learner_axis")(state, params,
                                                                  learner_axis=0)
    inside = jax.jit(jax.vmap(gmjax.finish, spmd_axis_name="learner"))(state, params)
  for theta in (outside, jitted):
    harness.assert_tree_close(jax.device_get(theta), expected, what="Θ")
    for name, leaf in theta.items():
      assert leaf.shape == setup.theta0[0][name].shape and leaf.dtype == jnp.float32
      want = ("fsdp" if SHARDED[name] else None, None)
      assert tuple(jax.typeof(leaf).sharding.spec)[:leaf.ndim] == want[:leaf.ndim], name
  for name, leaf in inside.items():
    assert jax.typeof(leaf).sharding.spec == jax.typeof(params[name]).sharding.spec
    for m in range(LEARNERS):
      np.testing.assert_array_equal(np.asarray(leaf)[m], outside[name],
                                    err_msg=f"{name} learner {m}")
  # Θ is not any learner's parameters: they trained on past the round.
  assert not np.allclose(np.asarray(params["w"])[0], outside["w"])


def test_finish_outside_the_mesh_context_lays_theta_out_alike():
  # The arrays carry their explicit mesh: finish needs no `jax.set_mesh` around it.
  setup, mesh, params, state = _train()
  theta = gmjax.finish(state, params, learner_axis=0)
  harness.assert_tree_close(jax.device_get(theta), reference.run(setup, STEPS)["anchor"],
                            what="Θ")
  for name, leaf in theta.items():
    assert leaf.sharding.mesh == mesh, name
    assert tuple(leaf.sharding.spec)[:1] == (("fsdp",) if SHARDED[name] else (None,)), name
  # One learner's state and parameters (learner_axis=None), laid out without the
  # learners' axis.
  one = jax.tree.map(
      lambda x: jax.device_put(np.asarray(x)[0], NamedSharding(
          mesh, P(*tuple(jax.typeof(x).sharding.spec)[1:]))), (state, params))
  theta = gmjax.finish(*one)
  for name, leaf in theta.items():
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(state.anchor[name])[0])


def test_finish_compiles_once_and_takes_host_params_or_another_mesh_set():
  # On an explicit mesh each call compiled one program per leaf (a new jit each time);
  # host params (jax.device_get) beside a state on the mesh failed in an indexing
  # (ShardingTypeError), and a serving mesh set around the call in a KeyError.
  setup, mesh, params, state = _train()
  expected = reference.run(setup, STEPS)["anchor"]
  gmjax.finish(state, params, learner_axis=0)
  compiled = []
  with jax.log_compiles(), _logged(lambda message: compiled.append(message)
                                   if message.startswith("Finished XLA compilation") else None):
    again = gmjax.finish(state, params, learner_axis=0)
  assert compiled == []
  host = gmjax.finish(state, jax.device_get(params), learner_axis=0)
  with jax.set_mesh(jax.make_mesh((8,), ("serving",), axis_types=(AxisType.Explicit,))):
    served = gmjax.finish(state, params, learner_axis=0)
  for theta in (again, host, served):
    harness.assert_tree_close(jax.device_get(theta), expected, what="Θ")
    for name, leaf in theta.items():  # the run's mesh, split as the state is
      assert leaf.sharding.mesh == mesh, name
      assert tuple(leaf.sharding.spec)[:1] == (("fsdp",) if SHARDED[name] else (None,)), name


@contextlib.contextmanager
def _logged(record):
  """Calls ``record(message)`` for each message JAX logs while in the block."""
  handler = logging.Handler()
  handler.emit = lambda entry: record(entry.getMessage())
  logger = logging.getLogger("jax")
  level, logger.level = logger.level, logging.WARNING
  logger.addHandler(handler)
  try:
    yield
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_finish_takes_the_parameters_dtype():
  _, mesh, params, state = _train(jnp.bfloat16)
  with jax.set_mesh(mesh):
    theta = gmjax.finish(state, params, learner_axis=0)
  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(theta))
  np.testing.assert_array_equal(np.asarray(theta["w"], np.float32),
                                np.asarray(state.anchor["w"], np.float32)[0])


def test_finish_names_what_is_wrong():
  config = gmjax.DiLoCo(sync_every=2, overlap_steps=0)
  optimizer = gmjax.diloco(optax.sgd(0.1), config)
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  with pytest.raises(TypeError, match=r"gmjax.DiLoCoState.*got tuple.*at state\[1\]"):
    gmjax.finish((optax.EmptyState(), state), params)
  # Wrapped, e.g. gradient accumulation around gmjax.diloco: the message says where.
  accumulated = optax.MultiSteps(optimizer, 2).init(params)
  with pytest.raises(TypeError, match=r"got MultiStepsState.*gmjax.finish\(state"
                                      r"\.inner_opt_state, params"):
    gmjax.finish(accumulated, params)
  # The schedule of such a state said only "pass the gmjax.diloco state".
  with pytest.raises(ValueError, match=r"this one holds it at state\.inner_opt_state"):
    config.schedule(accumulated)
  with pytest.raises(ValueError, match=r"this one holds it at state\[1\]"):
    config.schedule((optax.EmptyState(), state))
  with pytest.raises(TypeError, match=r"got dict.*no gmjax.DiLoCoState in it"):
    gmjax.finish({"count": 1}, params)
  with pytest.raises(ValueError, match=r"params\['w'\] has shape \(4,\)"):
    gmjax.finish(state, {"w": jnp.ones(4)})
  with pytest.raises(ValueError, match="structured"):
    gmjax.finish(state, {"v": jnp.ones(3)})
  with pytest.raises(ValueError, match="learner_axis=1"):
    gmjax.finish(state, params, learner_axis=1)
  # A bool is an int to Python, but not a dimension: True would take axis 1 of (L, n).
  with pytest.raises(ValueError, match="learner_axis must be None or an int.*got True"):
    gmjax.finish(state, params, learner_axis=True)
  theta = gmjax.finish(state, params)
  np.testing.assert_array_equal(theta["w"], params["w"])


def test_a_stacked_state_needs_its_learner_axis_and_update_needs_a_state():
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2, overlap_steps=0),
                           axis_name="learner")
  params = {"w": jnp.ones((4, 8, 1))}  # 4 learners, stacked by vmap
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  # Without learner_axis it returned the stacked anchor as if it were one model.
  with pytest.raises(ValueError, match=r"state.count has shape \(4,\).*learner_axis=0"):
    gmjax.finish(state, params)
  assert gmjax.finish(state, params, learner_axis=0)["w"].shape == (8, 1)
  # An Orbax restore without a target gives dicts: update named nothing but .anchor.
  step = jax.vmap(optimizer.update, axis_name="learner")
  with pytest.raises(TypeError, match=r"gmjax.diloco: update: state must be .*got dict"):
    step(params, {"anchor": params}, params)
  wrapped = (optax.EmptyState(), state)
  with pytest.raises(TypeError, match=r"got tuple.*at state\[1\].*pass state\[1\]"):
    step(params, wrapped, params)


def test_finish_takes_a_numpy_integer_axis():
  # An axis read from an array's shape or a config (np.int64) is a dimension too.
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2, overlap_steps=0))
  stacked = {"w": jnp.arange(6.0).reshape(2, 3)}
  state = jax.vmap(optimizer.init)(stacked)
  for axis in (np.int64(0), np.int32(-2)):
    theta = gmjax.finish(state, stacked, learner_axis=axis)
    np.testing.assert_array_equal(theta["w"], stacked["w"][0])


def test_finish_refuses_an_axis_the_state_is_not_stacked_on():
  # A slice of Θ came back: row 0 of one learner's w, or axis 1 of a stacked state.
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2, overlap_steps=0))
  params = {"w": jnp.ones((3, 4))}
  with pytest.raises(ValueError, match=r"learner_axis=0, but state.count has shape \(\),"
                                       r".*pass learner_axis=None"):
    gmjax.finish(optimizer.init(params), params, learner_axis=0)
  stacked = {"w": jnp.ones((2, 4))}
  state = jax.vmap(optimizer.init)(stacked)
  with pytest.raises(ValueError, match=r"learner_axis=1, but state.anchor\['w'\] has shape"
                                       r" \(2, 4\) while the state holds 2 learners"):
    gmjax.finish(state, stacked, learner_axis=1)
  assert gmjax.finish(state, stacked, learner_axis=0)["w"].shape == (4,)
  # A layer of 16 -> 4 on 4 learners, stacked on axis 0: its last axis is as long as the
  # learners' count, and learner_axis=-1 or 2 gave w[..., 0], a (4, 16) slice of Θ.
  # state.pending, (learners, fragments), shows the stacking axis.
  four = {"w": jnp.ones((4, 16, 4))}
  state = jax.vmap(optimizer.init)(four)
  for axis in (-1, 2):
    with pytest.raises(ValueError, match=rf"learner_axis={axis}, but .*state.pending"
                                         r" \(4, 1\)\); pass the dimension"):
      gmjax.finish(state, four, learner_axis=axis)
  assert gmjax.finish(state, four, learner_axis=-3)["w"].shape == (16, 4)
  # Stacked last (vmap's out_axes=-1): pending is (fragments, learners). A leaf of one
  # dimension is stacked on its first axis and its last alike.
  last = {"w": jnp.ones((16, 4, 4)), "s": jnp.ones(4)}
  state = jax.vmap(optimizer.init, in_axes=-1, out_axes=-1)(last)
  assert state.pending.shape == (1, 4)
  finished = gmjax.finish(state, last, learner_axis=-1)
  assert finished["w"].shape == (16, 4) and finished["s"].shape == ()
  with pytest.raises(ValueError, match=r"learner_axis=0, but .*state.pending \(1, 4\)"):
    gmjax.finish(state, last, learner_axis=0)


def test_finish_says_how_to_pass_params_in_other_containers():
  # An nnx.Optimizer's state and nnx.State params: the message only said to pass the
  # parameters the optimizer was updating, which they were.
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2, overlap_steps=0))
  params = {"w": jnp.ones(3)}
  state = optimizer.init(params)
  with pytest.raises(ValueError, match=r"in the containers the optimizer saw.*nnx.as_pure"):
    gmjax.finish(state, [jnp.ones(3)])
  with pytest.raises(ValueError, match=r"the optimizer was updating\.$"):
    gmjax.finish(state, {"w": jnp.ones(3), "b": jnp.ones(2)})


def test_finish_takes_an_nnx_optimizers_state_made_pure():
  # The README's recipe for an nnx.Optimizer: its Θ is the pure-pytree step's, bit for bit.
  nnx = pytest.importorskip("flax.nnx")
  as_pure = getattr(nnx, "as_pure", None) or nnx.pure
  tx = gmjax.diloco(optax.adamw(1e-2), gmjax.DiLoCo(sync_every=2, overlap_steps=0))
  x = jnp.arange(12.0).reshape(4, 3) / 10
  loss = lambda p: jnp.mean((x @ p["kernel"] + p["bias"] - 1.0) ** 2)
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  params = jax.tree.map(jnp.asarray, as_pure(nnx.state(model, nnx.Param)))
  state = tx.init(params)
  for _ in range(5):
    optimizer.update(model, nnx.grad(lambda m: loss({"kernel": m.kernel[...],
                                                      "bias": m.bias[...]}))(model))
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
  theta = gmjax.finish(as_pure(optimizer.opt_state), as_pure(nnx.state(model, nnx.Param)))
  expected = gmjax.finish(state, params)
  # Not made pure: the message printed both structures whole (1,152 characters for
  # this one layer); it names the nodes that differ.
  with pytest.raises(ValueError, match=r"the same leaves, in Param nodes in params and"
                                       r" OptVariable nodes in the state's anchor\);"
                                       r".*nnx.as_pure") as raised:
    gmjax.finish(optimizer.opt_state, nnx.state(model, nnx.Param))
  assert len(str(raised.value)) < 400
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(np.asarray(theta[name]), np.asarray(expected[name]))
