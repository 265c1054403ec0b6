"""``update(..., between_rounds=True)``: the program of the steps that do no round work.

A run whose host runs that program on the steps ``RoundSchedule.due`` says are not due,
and the full one on the others, must equal bit for bit the run whose every step holds the
round: one learner, learners under ``vmap`` (sharded and replicated outer steps, error
feedback, eager updates, ``optax.MultiSteps`` inside), FSDP on an explicit mesh under
``vmap`` and partially-manual ``shard_map``, with a NaN gradient among the steps. Its
compiled program holds no loop and, across learners, no collective. On a step that is
due it only drops the step.
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
from gmjax.transform import between, hlo, structure

LEARNERS = 3
SHAPES = {"w": (16, 8), "b": (40,), "c": (4, 3)}


def _due_reference(config, fragments, count):
  """Whether update ``count`` is the first, a sync or a merge, from the rounds' steps."""
  schedule = config.schedule(fragments)
  t = count + 1
  syncs = {schedule.step_of(r) for r in range(schedule.fragments * (t // config.sync_every + 2))}
  return count == 0 or t in syncs or (t - config.overlap_steps) in syncs


@pytest.mark.parametrize("sync_every,fragments,overlap", [
    (1, 1, 0), (4, 1, 0), (6, 2, 1), (7, 3, 2), (5, 5, 0), (8, 2, 7)])
def test_due_matches_the_rounds_steps_and_the_compiled_schedule(sync_every, fragments,
                                                                 overlap):
  config = gmjax.DiLoCo(sync_every=sync_every, fragments=fragments, overlap_steps=overlap)
  schedule = config.schedule(fragments)
  counts = np.arange(4 * sync_every + overlap + 3)
  host = [schedule.due(int(c)) for c in counts]
  assert host == [_due_reference(config, fragments, int(c)) for c in counts]
  table = structure.sync_table(schedule)
  compiled = jax.jit(jax.vmap(lambda c: between.schedule(table, overlap, c).due))(
      jnp.asarray(counts, jnp.int32))
  assert compiled.tolist() == host


def test_due_refuses_what_it_cannot_answer():
  with pytest.raises(ValueError, match=r"due\(count=-1\).*int >= 0"):
    gmjax.DiLoCo(sync_every=4).schedule(1).due(-1)
  with pytest.raises(ValueError, match="overlap_steps is None"):
    gmjax.DiLoCo(sync_every=4, overlap_steps=None).schedule(1).due(3)
  schedule = gmjax.DiLoCo(sync_every=4).schedule(1)
  for bad in (True, 2.0, jnp.ones(2, jnp.int32), jnp.bool_(True)):
    with pytest.raises(ValueError, match=r"pass the state's step count, an int >= 0"):
      schedule.due(bad)
  # Learners stacked on a leading axis: the message says how to read their count.
  with pytest.raises(ValueError, match=r"int\(state.count\[0\]\) for the state of learners"):
    schedule.due(jnp.zeros(2, jnp.int32))
  # An integer scalar of numpy or JAX (one learner's state.count) is a count too: it was
  # refused with a message asking for the state's step count.
  for count in range(9):
    assert schedule.due(np.int64(count)) == schedule.due(jnp.int32(count)) == schedule.due(count)


def _problem(learners, seed=0):
  rng = np.random.default_rng(seed)
  draw = lambda scale: {n: jnp.asarray(scale * rng.standard_normal((learners,) + s),
                                       jnp.float32) for n, s in SHAPES.items()}
  tokens = jnp.asarray(rng.integers(1, 9, size=(40, learners)), jnp.float32)
  return draw(1.0), draw(2.0), tokens


def _step(optimizer, nan_at):
  """One learner's step; at state count ``nan_at`` learner 1's gradient of "b" is NaN."""
  def step(params, state, target, tokens, between_rounds):
    grads = jax.tree.map(lambda p, t: 0.5 * (p - t), params, target)
    poisoned = (state.count == nan_at) & (jax.lax.axis_index("learner") == 1)
    grads["b"] = jnp.where(poisoned, jnp.nan, grads["b"])
    updates, state = optimizer.update(grads, state, params, tokens=tokens,
                                      between_rounds=between_rounds)
    return optax.apply_updates(params, updates), state
  return step


def _first_free(schedule, start):
  return next(c for c in range(start, 10**6) if not schedule.due(c))


def _assert_equal(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))


def _drive(step, params, state, target, tokens, schedule, steps, choose):
  used = 0
  for count in range(steps):
    free = choose and not schedule.due(count)
    used += free
    params, state = jax.block_until_ready(step(params, state, target, tokens[count], free))
  return params, state, used


CONFIGS = {
    "P=1 F32": ({"sync_every": 4}, {}, False),
    "P=2 I4 tau=1 mixing": ({"sync_every": 6, "fragments": 2, "overlap_steps": 1,
                             "mixing": 0.5, "delta_precision": "I4"}, {}, False),
    "replicated F8 error feedback": ({"sync_every": 5, "fragments": 2, "overlap_steps": 2,
                                      "delta_precision": "F8_E4M3", "error_feedback": 0.9},
                                     {"shard_outer": False}, False),
    "eager": ({"sync_every": 4, "fragments": 2, "outer_delay": 1, "eager": True}, {},
              False),
    "MultiSteps inside": ({"sync_every": 6, "fragments": 2, "overlap_steps": 2}, {}, True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_between_rounds_steps_equal_the_full_programs_run(name):
  settings, options, multisteps = CONFIGS[name]
  config = gmjax.DiLoCo(**settings)
  inner = optax.adamw(1e-2)
  inner = optax.MultiSteps(inner, 2) if multisteps else inner
  optimizer = gmjax.diloco(inner, config, axis_name="learner", **options)
  params, target, tokens = _problem(LEARNERS)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  schedule = config.schedule(state.pending.shape[-1])
  nan_at = _first_free(schedule, 3)
  step = jax.jit(jax.vmap(_step(optimizer, nan_at), axis_name="learner",
                          in_axes=(0, 0, 0, 0, None)), static_argnums=4)
  steps = 3 * config.sync_every + 2
  full = _drive(step, params, state, target, tokens, schedule, steps, choose=False)
  chosen = _drive(step, params, state, target, tokens, schedule, steps, choose=True)
  assert chosen[2] >= config.sync_every and step._cache_size() == 2
  _assert_equal(chosen[:2], full[:2])
  assert full[1].stats.dropped.tolist() == [0, 1, 0]  # the NaN step, on its own program
  assert int(full[1].stats.rounds[0]) >= 3


def test_one_learner_between_rounds_equals_the_full_program():
  config = gmjax.DiLoCo(sync_every=8, fragments=2, overlap_steps=1, delta_precision="I4")
  optimizer = gmjax.diloco(optax.adamw(1e-2), config)
  params, target, tokens = jax.tree.map(lambda x: x[0], _problem(1))

  def step(params, state, target, tokens, between_rounds):
    grads = jax.tree.map(lambda p, t: 0.5 * (p - t), params, target)
    updates, state = optimizer.update(grads, state, params, tokens=tokens,
                                      between_rounds=between_rounds)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, static_argnums=4, donate_argnums=(0, 1))
  state = optimizer.init(params)
  schedule = config.schedule(state.pending.shape[-1])
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  full = _drive(step, copy(params), copy(state), target, tokens, schedule, 13, False)
  chosen = _drive(step, copy(params), copy(state), target, tokens, schedule, 13, True)
  assert chosen[2] > 0
  _assert_equal(chosen[:2], full[:2])
  text = step.lower(params, state, target, tokens[0], True).compile().as_text()
  assert " while(" not in text and " conditional(" not in text


def test_the_between_rounds_program_has_no_loop_and_no_collective():
  config = gmjax.DiLoCo(sync_every=8, fragments=2, overlap_steps=1, delta_precision="I4")
  optimizer = gmjax.diloco(optax.adamw(1e-2), config, axis_name="learner")
  params, target, tokens = _problem(LEARNERS)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  step = jax.jit(jax.vmap(_step(optimizer, -1), axis_name="learner",
                          in_axes=(0, 0, 0, 0, None)), static_argnums=4)
  texts = {free: step.lower(params, state, target, tokens[0], free).compile().as_text()
           for free in (False, True)}
  assert " while(" in texts[False]
  assert " while(" not in texts[True] and " conditional(" not in texts[True]


def test_a_due_step_run_between_rounds_is_dropped_and_not_counted():
  config = gmjax.DiLoCo(sync_every=4, fragments=2, overlap_steps=1)
  optimizer = gmjax.diloco(optax.adamw(1e-2), config, axis_name="learner")
  params, target, tokens = _problem(LEARNERS)
  state = jax.vmap(optimizer.init, axis_name="learner")(params)
  schedule = config.schedule(state.pending.shape[-1])
  step = jax.jit(jax.vmap(_step(optimizer, -1), axis_name="learner",
                          in_axes=(0, 0, 0, 0, None)), static_argnums=4)
  params, state, _ = _drive(step, params, state, target, tokens, schedule, 5, True)
  assert schedule.round_at(6) is not None  # update 5 (step 6) syncs a fragment
  wrong_params, wrong = step(params, state, target, tokens[5], True)
  _assert_equal(wrong_params, params)  # no update
  assert wrong.count.tolist() == state.count.tolist() == [5] * LEARNERS
  assert wrong.stats.dropped.tolist() == [1] * LEARNERS
  assert wrong.stats.rounds.tolist() == state.stats.rounds.tolist()
  _assert_equal(wrong.tokens, state.tokens)
  _assert_equal((wrong.anchor, wrong.master, wrong.pending), (state.anchor, state.master,
                                                              state.pending))
  # The host's next call meets the same step, due, and runs its round.
  _, after = step(wrong_params, wrong, target, tokens[5], False)
  assert (after.stats.rounds - state.stats.rounds).tolist() == [1] * LEARNERS


def test_between_rounds_must_be_a_python_bool():
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2))
  params = {"w": jnp.ones(4)}
  state = optimizer.init(params)
  with pytest.raises(TypeError, match=r"between_rounds=.*Python bool.*static"):
    jax.jit(lambda s, f: optimizer.update(params, s, params, between_rounds=f))(
        state, jnp.bool_(True))


def test_a_misspelt_keyword_is_refused_where_the_inner_optimizer_takes_none():
  # token=500 (for tokens=) was dropped by optax's wrapper: one token a step counted.
  optimizer = gmjax.diloco(optax.sgd(0.1), gmjax.DiLoCo(sync_every=2))
  params = {"w": jnp.ones(4)}
  state = optimizer.init(params)
  for typo, meant in (("token", "tokens"), ("n_tokens", "tokens"), ("Tokens", "tokens"),
                      ("between_round", "between_rounds")):
    with pytest.raises(TypeError, match=rf"update got {typo}=, which is not gmjax.diloco's"
                                        rf" {meant}=.*did you mean {meant}=\?"):
      optimizer.update(params, state, params, **{typo: 500})
  # Other keywords go to the inner optimizer, as optax passes them.
  seen = []
  inner = optax.GradientTransformationExtraArgs(
      optax.sgd(0.1).init,
      lambda g, s, p=None, **extra: (seen.append(sorted(extra)) or g, s))
  taking = gmjax.diloco(inner, gmjax.DiLoCo(sync_every=2))
  taking.update(params, taking.init(params), params, value=1.0)
  assert seen == [["value"]]


FSDP_LEARNERS, FSDP = 4, 2
FSDP_SHAPES = {"w": (64, 32), "b": (40,)}


def _fsdp_build(optimizer, mesh, mode, nan_at):
  step = _step(optimizer, nan_at)
  if mode == "vmap":
    return (jax.vmap(optimizer.init, axis_name="learner", spmd_axis_name="learner"),
            jax.jit(jax.vmap(step, axis_name="learner", spmd_axis_name="learner",
                             in_axes=(0, 0, 0, 0, None)), static_argnums=4))
  first = lambda tree: jax.tree.map(lambda x: jax.lax.squeeze(x, (0,)), tree)
  stack = lambda tree: jax.tree.map(lambda x: jax.lax.expand_dims(x, (0,)), tree)
  manual = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("learner"),
                             out_specs=P("learner"), axis_names={"learner"})

  def sharded(params, state, target, tokens, between_rounds):
    return manual(lambda *args: stack(step(*first(args), between_rounds)))(
        params, state, target, tokens)

  return (jax.jit(manual(lambda p: stack(optimizer.init(first(p))))),
          jax.jit(sharded, static_argnums=4))


# Partially-manual shard_map on an Auto mesh: on an explicit one JAX gathers the operands'
# non-manual axes at the boundary (tests/test_transform_fsdp.py).
@pytest.mark.parametrize("mode,axis_type", [("vmap", AxisType.Explicit),
                                            ("shard_map", AxisType.Auto)],
                         ids=["vmap-explicit", "shard_map-auto"])
def test_fsdp_between_rounds_equals_the_full_program(mode, axis_type):
  mesh = jax.make_mesh((FSDP_LEARNERS, FSDP), ("learner", "fsdp"),
                       axis_types=(axis_type,) * 2)
  config = gmjax.DiLoCo(sync_every=8, fragments=2, overlap_steps=1, mixing=0.5,
                        delta_precision="I4")
  optimizer = gmjax.diloco(optax.adamw(1e-2), config, axis_name="learner")
  rng = np.random.default_rng(3)
  draw = lambda: {n: rng.standard_normal((FSDP_LEARNERS,) + s).astype(np.float32)
                  for n, s in FSDP_SHAPES.items()}
  place = lambda tree: {n: jax.device_put(v, NamedSharding(mesh, P(
      "learner", "fsdp" if n == "w" else None, *[None] * (v.ndim - 2))))
                        for n, v in tree.items()}
  with jax.set_mesh(mesh):
    params, target = place(draw()), place(draw())
    tokens = jax.device_put(jnp.ones((12, FSDP_LEARNERS), jnp.float32),
                            NamedSharding(mesh, P(None, "learner")))
    init, step = _fsdp_build(optimizer, mesh, mode, nan_at=5)
    state = init(params)
    schedule = config.schedule(jax.device_get(state.pending).shape[-1])
    assert not schedule.due(5)
    full = _drive(step, params, state, target, tokens, schedule, 10, False)
    chosen = _drive(step, params, state, target, tokens, schedule, 10, True)
    text = step.lower(params, state, target, tokens[0], True).compile().as_text()
  assert chosen[2] > 0
  _assert_equal(jax.device_get(chosen[:2]), jax.device_get(full[:2]))
  assert jax.device_get(full[1].stats.dropped).tolist() == [0, 1, 0, 0]
  # Between rounds nothing crosses the learners and nothing is gathered: the finiteness
  # check's count of non-finite values is summed over fsdp (one scalar).
  assert " while(" not in text
  collectives = hlo.collective_bytes(text)
  assert all(c.op == "all-reduce" and np.prod(c.shape) == 1 for c in collectives), collectives
  assert all(hlo.spanned_axes(mesh, group) == {"fsdp"}
             for c in collectives for group in c.groups), collectives
  if axis_type == AxisType.Explicit:
    assert tuple(jax.typeof(chosen[0]["w"]).sharding.spec)[:2] == ("learner", "fsdp")


def _between_text(leaves):
  optimizer = gmjax.diloco(optax.adamw(1e-2), gmjax.DiLoCo(sync_every=50))
  params = {f"p{i:03d}": jnp.full((64,), float(i)) for i in range(leaves)}

  def step(params, state):
    updates, state = optimizer.update(params, state, params, between_rounds=True)
    return optax.apply_updates(params, updates), state

  return jax.jit(step).lower(params, optimizer.init(params)).compile().as_text()


def test_the_between_rounds_program_grows_linearly_with_the_leaves():
  # Every leaf's update reads whether the step is dropped, a sum over every leaf: fused
  # into each reader, that made a program quadratic in the leaf count.
  small, large = (len(_between_text(n)) for n in (40, 80))
  assert large / small < 2.4, (small, large)


def test_nnx_optimizer_passes_between_rounds_on():
  nnx = pytest.importorskip("flax.nnx")
  config = gmjax.DiLoCo(sync_every=4)
  tx = gmjax.diloco(optax.adamw(1e-2), config)
  schedule = config.schedule(1)
  x = jnp.arange(12.0).reshape(4, 3) / 10

  @nnx.jit(static_argnums=2)
  def step(model, opt, between_rounds):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
    opt.update(model, grads, between_rounds=between_rounds)

  def run(choose):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for count in range(10):
      step(model, opt, choose and not schedule.due(count))
    return nnx.state(model, nnx.Param), nnx.state(opt)

  chosen, full = run(True), run(False)
  _assert_equal(chosen, full)
  assert int(full[1]["opt_state"]["stats"]["rounds"][...]) == 2


def test_the_between_rounds_programs_scratch_is_plain_optaxs():
  # The full program writes the updates out for the round's loops (a parameter-sized
  # buffer); between rounds XLA computes them inside apply_updates, as for plain optax.
  shapes = {"a": (256, 256), "b": (256, 512), "c": (512,)}
  params = {n: jnp.full(s, 0.01) for n, s in shapes.items()}
  x = jnp.ones((8, 256))

  def scratch(tx, **options):
    def step(params, state):
      grads = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p["a"]) @ p["b"] + p["c"]) ** 2))(
          params)
      updates, state = tx.update(grads, state, params, **options)
      return optax.apply_updates(params, updates), state

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  plain = scratch(optax.adamw(1e-3))
  optimizer = gmjax.diloco(optax.adamw(1e-3), gmjax.DiLoCo(sync_every=8))
  largest = 4 * 256 * 512
  assert scratch(optimizer, between_rounds=True) <= plain + largest // 8


def test_a_schedule_read_from_the_state_is_the_plans_and_keeps_training_going():
  # Fewer layer blocks (2) than fragments (3): config.schedule() counts 3 fragments, whose
  # due steps are not the plan's; a host that followed it between rounds called a due
  # step "not due" and stalled (every later step dropped, the count still). The state
  # holds the plan's count (a counter a fragment), stacked on learners or not.
  config = gmjax.DiLoCo(sync_every=6, fragments=3, overlap_steps=0,
                        layer_axis={"layers": 0})
  params = {"layers": jnp.ones((2, 3, 3)) / 3}
  optimizer = gmjax.diloco(optax.sgd(0.1), config)
  state = optimizer.init(params)
  stacked = jax.vmap(gmjax.diloco(optax.sgd(0.1), config, axis_name="learner").init,
                     axis_name="learner")(jax.tree.map(lambda x: jnp.stack([x] * 2), params))
  assert config.schedule(state) == config.schedule(stacked) == config.schedule(2)
  assert config.schedule() != config.schedule(state)

  @functools.partial(jax.jit, static_argnums=2)
  def step(params, state, between_rounds):
    updates, state = optimizer.update(jax.tree.map(jnp.ones_like, params), state, params,
                                      between_rounds=between_rounds)
    return optax.apply_updates(params, updates), state

  schedule = config.schedule(state)
  for _ in range(16):
    params, state = step(params, state, not schedule.due(int(state.count)))
  assert int(state.count) == 16 and int(state.stats.dropped) == 0
  assert int(state.stats.rounds) == 5  # a fragment every 3 steps


def test_the_step_count_keeps_its_layout_across_the_two_programs_on_an_auto_mesh():
  # On an Auto mesh the step with the round returned the count replicated (the maximum
  # over the learners that keeps its loops unbatched) and the step between rounds
  # returned it split over the learners: every switch between the two programs met a new
  # input layout and compiled again (5 programs in 12 steps).
  config = gmjax.DiLoCo(sync_every=3)
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")

  def step(params, state, x, between_rounds):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"] - 1.0) ** 2))(params)
    updates, state = optimizer.update(grads, state, params, between_rounds=between_rounds)
    return optax.apply_updates(params, updates), state

  mesh = jax.make_mesh((2, 2), ("learner", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(jnp.ones((2, 128, 4)) / 8,
                                  NamedSharding(mesh, P("learner", "fsdp")))}
    x = jax.device_put(jnp.ones((2, 8, 128)), NamedSharding(mesh, P("learner")))
    spmd = dict(axis_name="learner", spmd_axis_name="learner")
    state = jax.vmap(optimizer.init, **spmd)(params)
    jitted = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None), **spmd), static_argnums=3)
    schedule, layouts = config.schedule(state), {}
    for count in range(3 * config.sync_every):
      free = not schedule.due(count)
      params, state = jax.block_until_ready(jitted(params, state, x, free))
      layouts.setdefault(free, set()).add(state.count.sharding.spec)
  # After the first step (whose state comes from init, laid out otherwise), the same.
  assert layouts[True] == {P("learner")} and P("learner") in layouts[False]
  # The statistics the first round writes still leave init's layout once (one program
  # more than on an explicit mesh).
  assert jitted._cache_size() <= 4
