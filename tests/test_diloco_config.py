"""gmjax.DiLoCo: eager validation, JSON round trip, the outer optimizer, the fragment plan."""

import copy
import dataclasses
import functools
import json
import pickle

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gmjax
from gmjax.core import outer, outer_records, robust
from gmjax.core.wire import Wire


@pytest.mark.parametrize(
    "field, value",
    [("sync_every", 0), ("sync_every", 2.5), ("fragments", 0), ("fragments", 9),
     ("outer_learning_rate", 0.0), ("outer_learning_rate", -1.0),
     ("outer_learning_rate", float("nan")), ("outer_learning_rate", float("inf")),
     # Finite in Python, Inf in F32: every outer step was skipped, without a word.
     ("outer_learning_rate", 1e39), ("outer_learning_rate", 10**400),
     ("outer_momentum", 1.0), ("outer_momentum", -0.1), ("nesterov", 1),
     ("delta_precision", "F8"), ("commit_precision", "int4"), ("mixing", 1.0),
     ("mixing", -0.5), ("overlap_steps", 8), ("overlap_steps", -1), ("in_flight", 0),
     ("quorum_size", 0), ("global_batch_size", -4), ("flush_on_close", "yes"),
     ("outer_delay", 1.0)],  # recorded as 1.0 in the manifest, where 1 is asked for
)
def test_bad_field_named(field, value):
  with pytest.raises(ValueError, match=field):
    gmjax.DiLoCo(sync_every=8, **{field: value}) if field != "sync_every" else gmjax.DiLoCo(
        sync_every=value)


def test_json_round_trip():
  config = gmjax.DiLoCo(sync_every=10, fragments=3, outer_learning_rate=0.5,
                        nesterov=False, delta_precision="F4", commit_precision="BF16",
                        mixing=0.25, overlap_steps=None, in_flight=2, quorum_size=2,
                        flush_on_close=False, global_batch_size=64)
  record = config.to_json()
  assert record["name"] == "DiLoCo"
  assert gmjax.DiLoCo.from_json(record) == config
  assert gmjax.DiLoCo.from_json(gmjax.DiLoCo(sync_every=3).to_json()) == gmjax.DiLoCo(3)
  with pytest.raises(ValueError):
    gmjax.DiLoCo.from_json({**record, "surprise": 1})
  with pytest.raises(ValueError):
    gmjax.DiLoCo.from_json({**record, "name": "SGD"})


def test_protocol_values():
  config = gmjax.DiLoCo(sync_every=6, fragments=2, quorum_size=3, global_batch_size=32)
  assert config.quorum() == 3 and config.global_batch() == 32
  assert gmjax.DiLoCo(sync_every=6).quorum() == 1
  schedule = config.schedule(2)
  assert (schedule.sync_every, schedule.fragments) == (6, 2)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    st.lists(st.tuples(st.integers(1, 500), st.sampled_from(["F32", "BF16"])),
             min_size=1, max_size=12),
    st.integers(1, 16),
)
def test_plan(leaves, fragments):
  schema = gmjax.Schema(tuple(gmjax.ParameterSpec(f"p{i:02d}", dtype, (size,))
                              for i, (size, dtype) in enumerate(leaves)))
  config = gmjax.DiLoCo(sync_every=16, fragments=fragments)
  plan = config.plan(schema)
  assert plan == config.plan(schema)  # deterministic
  assert len(plan) == min(fragments, len(leaves))
  names = [n for part in plan for n in part]
  assert sorted(names) == sorted(schema.names)  # every leaf exactly once
  assert all(part for part in plan)
  loads = [sum(schema[n].nbytes for n in part) for part in plan]
  # Greedy balance: no fragment exceeds the lightest by more than the largest leaf.
  assert max(loads) - min(loads) <= max(spec.nbytes for spec in schema)


@pytest.mark.parametrize(
    "outer, options, match",
    [("nonsense", None, "outer must name an optax optimizer"),
     ("_src", None, "outer must name"),
     (3, None, "outer must name"),
     ("tree_utils", None, "outer must name"),
     ("adam", {"bogus": 1.0}, "outer_options do not fit optax.adam"),
     ("adam", [("b1", 0.9)], "outer_options must be None or a dict"),
     ("adam", {1: 0.9}, "outer_options must be None or a dict"),
     ("adam", {"b1": object()}, "outer_options must be JSON"),
     ("adam", {"b1": float("nan")}, "outer_options must be JSON"),
     ("sgd", {"learning_rate": {"schedule": "nope"}}, "schedule='nope' is not an optax"),
     ("sgd", {"learning_rate": {"schedule": "cosine_decay_schedule", "bad": 1}},
      "outer_options.learning_rate"),
     # Values optax takes when built, and steps wrongly on (or fails on at the first
     # round, for a string):
     ("sgd", {"learning_rate": "0.7"}, "outer_options.learning_rate must be a positive"),
     ("sgd", {"learning_rate": -1.0}, "outer_options.learning_rate must be a positive"),
     ("sgd", {"learning_rate": 0}, "outer_options.learning_rate must be a positive"),
     ("sgd", {"learning_rate": True}, "outer_options.learning_rate must be a positive"),
     ("sgd", {"momentum": 1.5}, r"outer_options.momentum must be a number in \[0, 1\)"),
     ("sgd", {"learning_rate": 1e39}, "outer_options.learning_rate must be a positive"),
     ("sgd", {"momentum": 0.9, "nesterov": "false"}, "outer_options.nesterov must be true"),
     ("adam", {"b2": -0.5}, r"outer_options.b2 must be a number in \[0, 1\)"),
     ("adam", {"eps": "small"}, "outer_options do not fit optax.adam: a step on a probe"),
     # A schedule was not held to a number's range: Θ moved away from the optimum
     # (-1), never moved (0), or every round was skipped (past F32's range).
     ("sgd", {"learning_rate": {"schedule": "constant_schedule", "value": -1.0}},
      r"schedule .* gives \{0: -1.0"),
     ("sgd", {"learning_rate": {"schedule": "constant_schedule", "value": 0.0}},
      "positive at some"),
     ("sgd", {"learning_rate": {"schedule": "constant_schedule", "value": 1e39}},
      r"must be in \[0, 3.403e\+38\]"),
     ("sgd", {"learning_rate": {"schedule": "linear_schedule", "init_value": 0.7,
                                "end_value": -0.7, "transition_steps": 1000}},
      r"at outer steps \[1000, 10000"),
     # Transformations that are no optimizer: they stepped with the gradient, or not.
     ("identity", None, "outer='identity' .*is not an optimizer"),
     ("scale_by_adam", None, "is not an optimizer"),
     ("clip", {"max_delta": 1.0}, "is not an optimizer"),
     ("set_to_zero", None, "is not an optimizer"),
     ("add_decayed_weights", None, "is not an optimizer"),
     ("chain", None, "outer_options do not fit optax.chain"),  # optax's own ValueError
    ],
)
def test_bad_outer_named(outer, options, match):
  with pytest.raises(ValueError, match=match):
    gmjax.DiLoCo(sync_every=4, outer=outer, outer_options=options)


def test_outer_options_take_numpy_scalars_and_a_warmup_from_zero():
  config = gmjax.DiLoCo(sync_every=4, outer_options={"momentum": np.float32(0.5),
                                                     "nesterov": np.bool_(False)})
  assert config.outer_arguments()["momentum"] == 0.5
  assert config.outer_arguments()["nesterov"] is False
  gmjax.DiLoCo(sync_every=4, outer="adam", outer_options={"learning_rate": {
      "schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.5,
      "warmup_steps": 10000, "decay_steps": 10**6}})
  # A warmup that begins later holds the probe's steps still: not "no optimizer".
  for outer in ("sgd", "adam"):
    gmjax.DiLoCo(sync_every=4, outer=outer, outer_options={"learning_rate": {
        "schedule": "linear_schedule", "init_value": 0.0, "end_value": 0.7,
        "transition_steps": 100, "transition_begin": 10}})
  # A rate near F32's largest overflows a step: a direction all the same (the skip
  # tests' setting).
  gmjax.DiLoCo(sync_every=4, outer_learning_rate=3e38)
  # noisy_sgd's noise does not decide.
  for seed in range(4):
    gmjax.DiLoCo(sync_every=4, outer="noisy_sgd", outer_options={"eta": 5.0, "seed": seed})
  with pytest.raises(ValueError, match=r"outer_options.learning_rate: the schedule .* fails"
                                       r" on an outer step count"):
    gmjax.DiLoCo(sync_every=4, outer_options={"learning_rate": {
        "schedule": "piecewise_constant_schedule", "init_value": 0.7,
        "boundaries_and_scales": {"100": 0.1}}})


SCHEDULED_ADAM = dict(
    outer="adam",
    outer_options={"b1": 0.8, "learning_rate": {
        "schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.5,
        "warmup_steps": 2, "decay_steps": 10}},
)


def test_outer_json_round_trip_hash_and_eq():
  options = {"b1": 0.8, "learning_rate": dict(SCHEDULED_ADAM["outer_options"]["learning_rate"])}
  config = gmjax.DiLoCo(sync_every=4, outer="adam", outer_options=options)
  options["b1"] = 0.1  # the config holds its own frozen copy
  record = config.to_json()
  assert record["outer"] == "adam" and record["outer_options"]["b1"] == 0.8
  assert json.loads(json.dumps(record)) == record
  again = gmjax.DiLoCo.from_json(json.loads(json.dumps(record)))
  assert again == config and hash(again) == hash(config)
  assert {config: 1}[again] == 1
  other = gmjax.DiLoCo(sync_every=4, outer="adam", outer_options={"b1": 0.7})
  assert other != config
  assert gmjax.DiLoCo(sync_every=4) != gmjax.DiLoCo(sync_every=4, outer="adam")
  with pytest.raises(TypeError):
    config.outer_options["b1"] = 0.5
  # An old record, from before the outer optimizer was configurable, is the default SGD.
  old = {k: v for k, v in gmjax.DiLoCo(sync_every=4).to_json().items()
         if k not in ("outer", "outer_options")}
  assert gmjax.DiLoCo.from_json(old) == gmjax.DiLoCo(sync_every=4)


def test_a_configuration_copies_pickles_and_converts_to_a_dict():
  # Its mappings were read-only proxies, which copy.deepcopy, pickle and
  # dataclasses.asdict could not handle.
  config = gmjax.DiLoCo(sync_every=8, fragments=2, layer_axis={"layers": 0},
                        outer_options={"learning_rate": 0.5})
  assert copy.deepcopy(config) == config
  assert pickle.loads(pickle.dumps(config)) == config
  record = dataclasses.asdict(config)
  assert record["outer_options"] == {"learning_rate": 0.5}
  assert record["layer_axis"] == {"layers": 0}
  assert json.loads(json.dumps(record)) == record
  for mapping in (config.outer_options, config.layer_axis):
    with pytest.raises(TypeError, match="read-only"):
      mapping["x"] = 1


@pytest.mark.parametrize("a,b", [
    ({"outer_learning_rate": 1}, {"outer_learning_rate": 1.0}),
    ({"mixing": 0}, {"mixing": 0.0}),
    ({"outer_momentum": 0}, {"outer_momentum": 0.0}),
    ({"outer": "adam", "outer_options": {"b1": 0}}, {"outer": "adam", "outer_options": {"b1": 0.0}}),
])
def test_equal_configurations_hash_alike(a, b):
  first, second = gmjax.DiLoCo(sync_every=8, **a), gmjax.DiLoCo(sync_every=8, **b)
  assert first == second and hash(first) == hash(second) and len({first, second}) == 1


def test_numpy_scalars_are_taken_as_the_numbers_they_hold():
  # np.int64(8) was refused as "not a positive int", np.float32(0.7) as "not a number".
  config = gmjax.DiLoCo(sync_every=np.int64(8), fragments=np.int32(2),
                        outer_learning_rate=np.float32(0.5), mixing=np.float64(0.25),
                        overlap_steps=np.int64(1), nesterov=np.bool_(False))
  assert config == gmjax.DiLoCo(sync_every=8, fragments=2, outer_learning_rate=0.5,
                                mixing=0.25, overlap_steps=1, nesterov=False)
  assert type(config.sync_every) is int and type(config.outer_learning_rate) is float
  assert type(config.nesterov) is bool
  json.dumps(config.to_json())


def test_outer_arguments_defaults():
  config = gmjax.DiLoCo(sync_every=4, outer_learning_rate=0.5, outer_momentum=0.8,
                        nesterov=False)
  assert config.outer_arguments() == {"learning_rate": 0.5, "momentum": 0.8,
                                      "nesterov": False}
  adam = gmjax.DiLoCo(sync_every=4, outer_learning_rate=0.5, outer="adam",
                      outer_options={"b2": 0.95})
  assert adam.outer_arguments() == {"learning_rate": 0.5, "b2": 0.95}
  override = gmjax.DiLoCo(sync_every=4, outer_options={"momentum": None})
  assert override.outer_arguments()["momentum"] is None
  state = override.outer_transform().init({"w": jnp.zeros(3)})
  assert jax.tree.leaves(state) == []  # plain SGD keeps no state
  # An optimizer without a learning_rate is not given one: the error named arguments
  # the user never set ("got {'learning_rate': 0.7}" with outer_options={}).
  with pytest.raises(ValueError, match=r"optax.polyak_sgd.*got \{\}"):
    gmjax.DiLoCo(sync_every=4, outer="polyak_sgd", outer_options={})


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("lr, mu", [(0.7, 0.9), (0.3, 0.0), (1.3, 0.55)])
def test_default_outer_is_bit_identical_to_the_formula(nesterov, lr, mu):
  config = gmjax.DiLoCo(sync_every=4, outer_learning_rate=lr, outer_momentum=mu,
                        nesterov=nesterov)
  transform = config.outer_transform()
  rng = np.random.default_rng(0)
  master = {"w": rng.standard_normal((33, 7)).astype(np.float32),
            "b": (rng.standard_normal(5) * 1e3).astype(np.float32)}
  state = transform.init(master)
  momentum = {k: jnp.zeros_like(v) for k, v in master.items()}
  mine, formula = dict(master), dict(master)
  via_optax = jax.jit(lambda g, s, m: outer.apply_outer(transform, g, s, m))
  via_formula = jax.jit(functools.partial(outer.outer_step, learning_rate=lr,
                                          momentum_coef=mu, nesterov=nesterov))
  for _ in range(4):
    gradient = {k: (rng.standard_normal(v.shape) * 10.0 ** rng.integers(-6, 3)).astype(
        np.float32) for k, v in master.items()}
    mine, state = via_optax(gradient, state, mine)
    formula, momentum = via_formula(gradient, momentum, formula)
    trace = outer_records.flatten(state, outer_records.seed_aliases("sgd"))
    for k in master:
      assert np.asarray(mine[k]).tobytes() == np.asarray(formula[k]).tobytes()
      assert np.asarray(trace[f"momentum.{k}"]).tobytes() == np.asarray(momentum[k]).tobytes()


def test_schedule_counts():
  config = gmjax.DiLoCo(sync_every=12, fragments=4)
  two_leaves = gmjax.Schema.from_tree({"a": jnp.zeros(3), "b": jnp.zeros(4)})
  assert config.schedule(two_leaves).fragments == 2  # the plan has only two fragments
  assert config.schedule(two_leaves).step_of(0) == config.schedule(2).step_of(0) == 6
  assert config.schedule().fragments == 4  # the configured count, for >= 4 leaves
  many = gmjax.Schema.from_tree({f"p{i}": jnp.zeros(3) for i in range(9)})
  assert config.schedule(many) == config.schedule()
  for bad in (0, 5, 2.0, True, "2"):
    with pytest.raises(ValueError, match="DiLoCo.schedule"):
      config.schedule(bad)
  assert config.schedule(np.int64(2)) == config.schedule(2)  # len() of a numpy plan
  assert type(config.schedule(np.int64(2)).fragments) is int


@pytest.mark.parametrize("beta", [0, 0.0, -0.5, 1.5, float("nan"), float("inf"), "0.5", True,
                                  1e-300])  # 0 in F32
def test_bad_error_feedback_named(beta):
  with pytest.raises(ValueError, match=r"error_feedback must be None \(off\) or a number in"
                     r" \(0, 1\], got"):
    gmjax.DiLoCo(sync_every=8, delta_precision="I4", error_feedback=beta)


def test_error_feedback_needs_lossy_deltas():
  with pytest.raises(ValueError, match="error_feedback=0.5 with delta_precision='F32'.*pick"
                     " a lossy delta_precision"):
    gmjax.DiLoCo(sync_every=8, delta_precision="F32", error_feedback=0.5)
  # With None the deltas travel at each leaf's dtype: the schema decides.
  config = gmjax.DiLoCo(sync_every=8, error_feedback=1)
  f32 = gmjax.Schema.from_tree({"w": np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match="delta_precision=None and F32 parameters.*pick a"
                     " lossy delta_precision"):
    config.check_parameters(f32)
  config.check_parameters(gmjax.Schema.from_tree({"w": jnp.zeros(3, jnp.bfloat16)}))
  for precision in ("I4", "F4", "F8_E4M3", "BF16", "F16"):
    gmjax.DiLoCo(sync_every=8, delta_precision=precision,
                 error_feedback=0.5).check_parameters(f32)
  gmjax.DiLoCo(sync_every=8).check_parameters(f32)  # off: nothing to check


def test_mail_create_refuses_lossless_error_feedback(tmp_path):
  from gmjax import mail  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match="error_feedback=1.0 with delta_precision=None"):
    mail.create(str(tmp_path / "run"), {"w": np.zeros(3, np.float32)},
                gmjax.DiLoCo(sync_every=4, error_feedback=1.0))
  assert not (tmp_path / "run" / "manifest.json").exists()


def test_error_feedback_json_round_trip():
  config = gmjax.DiLoCo(sync_every=8, delta_precision="I4", error_feedback=1)
  assert config.error_feedback == 1.0 and isinstance(config.error_feedback, float)
  record = json.loads(json.dumps(config.to_json()))
  assert record["error_feedback"] == 1.0
  assert gmjax.DiLoCo.from_json(record) == config
  assert hash(config) == hash(gmjax.DiLoCo(sync_every=8, delta_precision="I4",
                                           error_feedback=1.0))
  assert gmjax.DiLoCo.from_json({**record, "error_feedback": 0.25}).error_feedback == 0.25
  # Off, the record is what it was before the option existed, and such records load.
  off = gmjax.DiLoCo(sync_every=8, delta_precision="I4")
  assert "error_feedback" not in off.to_json()
  assert gmjax.DiLoCo.from_json(off.to_json()).error_feedback is None
  with pytest.raises(ValueError, match="error_feedback"):
    gmjax.DiLoCo.from_json({**record, "error_feedback": 2.0})


@pytest.mark.parametrize("options, match", [
    ({"delta_topk": 0}, r"delta_topk must be None \(dense deltas\) or a positive int, got 0"),
    ({"delta_topk": 2.0}, r"delta_topk .* got 2.0"),
    ({"delta_topk": True}, r"delta_topk .* got True"),
    ({"delta_topk": 4, "delta_chunk": 0}, r"delta_chunk must be a positive int .* got 0"),
    ({"delta_chunk": "4096"}, r"delta_chunk .* got '4096'"),
    ({"delta_topk": 64, "delta_chunk": 32},
     r"delta_chunk >= delta_topk, got delta_chunk=32, delta_topk=64: .* raise delta_chunk"),
])
def test_bad_sparse_settings_named(options, match):
  with pytest.raises(ValueError, match=match):
    gmjax.DiLoCo(sync_every=4, **options)


def test_sparse_json_round_trip_and_old_records_dense():
  config = gmjax.DiLoCo(sync_every=4, delta_precision="I4", delta_topk=64, delta_chunk=1024)
  record = json.loads(json.dumps(config.to_json()))
  assert record["delta_topk"] == 64 and record["delta_chunk"] == 1024
  again = gmjax.DiLoCo.from_json(record)
  assert again == config and hash(again) == hash(config)
  assert gmjax.DiLoCo(sync_every=4, delta_topk=64) != gmjax.DiLoCo(sync_every=4)
  old = {k: v for k, v in gmjax.DiLoCo(sync_every=4).to_json().items()
         if k not in ("delta_topk", "delta_chunk")}
  dense = gmjax.DiLoCo.from_json(old)
  assert dense.delta_topk is None and dense == gmjax.DiLoCo(sync_every=4)
  schema = gmjax.Schema((gmjax.ParameterSpec("w", "F32", (3000,)),))
  assert dense.delta_layout(schema) == gmjax.layout(schema, None)
  sparse_layout = config.delta_layout(schema)
  assert {s.name: (s.dtype, s.shape) for s in sparse_layout.parameters} == {
      # 2 full chunks of 1024 keep 64 each, the last (952 values) 64: 192 kept values.
      "w": ("U8", (96,)), "w.scale": ("F32", (6,)), "w.index": ("U16", (192,))}


def test_custom_outer_round_trips_and_builds_nothing():
  config = gmjax.DiLoCo(sync_every=4, fragments=2, outer="custom", delta_precision="I4")
  record = json.loads(json.dumps(config.to_json()))
  assert record["outer"] == "custom"
  again = gmjax.DiLoCo.from_json(record)
  assert again == config and hash(again) == hash(config)
  for method in ("outer_transform", "outer_arguments"):
    with pytest.raises(ValueError, match=rf"DiLoCo.{method}: outer='custom' means the outer"
                                         r" optimizer is given in code.*outer=tx"):
      getattr(config, method)()
  assert config.outer_description() == "config.outer='custom' (given in code)"


@pytest.mark.parametrize("settings, named", [
    (dict(outer_learning_rate=0.5), "outer_learning_rate=0.5"),
    (dict(outer_momentum=0.0), "outer_momentum=0.0"),
    (dict(nesterov=False), "nesterov=False"),
    (dict(outer_options={"b1": 0.8}), "outer_options="),
])
def test_custom_outer_refuses_settings_it_would_ignore(settings, named):
  with pytest.raises(ValueError, match=rf"outer='custom' takes the outer optimizer given in"
                                       rf" code.*{named}.*would not be used"):
    gmjax.DiLoCo(sync_every=4, outer="custom", **settings)


def test_custom_outer_refused_by_eager_and_by_mail(tmp_path):
  from gmjax import mail  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match="outer='sgd' at a constant learning rate, got"
                                       " outer='custom'"):
    gmjax.DiLoCo(sync_every=4, outer="custom", outer_delay=1, eager=True)
  with pytest.raises(ValueError, match=r"gmjax.mail.create: config.outer='custom'.*manifest"):
    mail.create(str(tmp_path / "run"), {"w": np.zeros(3, np.float32)},
                gmjax.DiLoCo(sync_every=4, outer="custom"))
  assert not (tmp_path / "run").exists()


def test_methods_that_take_a_schema_name_it_when_given_params():
  # A raw AttributeError ('dict' object has no attribute 'pieces'), or, from
  # check_parameters, nothing checked at all.
  config = gmjax.DiLoCo(sync_every=4)
  params = {"w": np.zeros(3, np.float32)}
  for method in (config.plan, config.check_parameters, config.delta_layout):
    with pytest.raises(TypeError, match=r"takes a gmjax.Schema, got dict: pass"
                                        r" gmjax.Schema.from_tree\(params\)"):
      method(params)
  # gmjax.layout and gmjax.decode named DiLoCo.delta_layout, which the user did not call.
  entries = gmjax.encode(params, "I4")
  for name, call in (("gmjax.layout", lambda: gmjax.layout(params, "I4")),
                     ("gmjax.decode", lambda: gmjax.decode(entries, params, "I4"))):
    with pytest.raises(TypeError, match=rf"^{name} takes a gmjax.Schema, got dict"):
      call()
  assert config.plan(gmjax.Schema.from_tree(params)) == (("w",),)


def test_nested_outer_options_are_read_only_as_checked():
  # Only the top level was frozen: a nested schedule could be set to NaN after the
  # checks, changing the config's hash (a jit-static key) and its JSON.
  config = gmjax.DiLoCo(sync_every=4, outer="adam", outer_options={
      "learning_rate": {"schedule": "constant_schedule", "value": 0.1}, "b1": 0.9})
  before = hash(config)
  with pytest.raises(TypeError, match="read-only"):
    config.outer_options["learning_rate"]["value"] = float("nan")
  assert hash(config) == before
  assert gmjax.DiLoCo.from_json(json.loads(json.dumps(config.to_json()))) == config
  config.outer_transform()


@pytest.mark.parametrize("field, value, match", [
    ("sync_every", 0, r"sync_every must be a positive int, got 0; e.g. sync_every=500"),
    ("in_flight", 0, r"in_flight must be a positive int, got 0; e.g. in_flight=1"),
    ("nesterov", 1, r"nesterov must be a bool, got 1; e.g. nesterov=True"),
    ("outer_learning_rate", 1e-46, r"outer_learning_rate .* F32 holds .* got 1e-46"),
])
def test_bad_values_are_named_with_a_fix(field, value, match):
  settings = {"sync_every": 4, field: value}
  with pytest.raises(ValueError, match=match):
    gmjax.DiLoCo(**settings)


def test_from_json_names_a_misspelled_field_and_refuses_text():
  with pytest.raises(ValueError, match=r"unknown fields \['agregation'\] \('agregation':"
                                       r" did you mean 'aggregation'\?\); the fields are"):
    gmjax.DiLoCo.from_json({"sync_every": 4, "agregation": "trimmed_mean"})
  # The text itself raised 'dictionary update sequence element #0 has length 1'.
  with pytest.raises(TypeError, match=r"takes the dict to_json gives \(json.loads"):
    gmjax.DiLoCo.from_json('{"sync_every": 4}')


def test_wire_and_rule_take_numpy_integers_as_diloco_does():
  assert Wire("I4", np.int64(8), np.int64(256)) == Wire("I4", 8, 256)
  assert type(Wire("I4", np.int64(8)).topk) is int
  assert robust.Rule("trimmed_mean", trim=np.int64(2)).trim == 2
