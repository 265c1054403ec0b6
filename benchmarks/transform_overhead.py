"""Step-time overhead of ``gmjax.diloco`` against its plain inner optimizer, in one run.

A small MLP (about 2.1M F32 parameters) trains with ``jit(optax.adamw)`` and with
``jit(gmjax.diloco(optax.adamw, config))`` (one learner, ``axis_name=None``), each step
computing the loss gradient, the optimizer update and ``apply_updates``. Every variant
runs twice: with the parameters and optimizer state donated to the step (as training
loops do), and without donation; each ratio is against ``optax.adamw`` run the same way.
Each figure is the mean step time of a window of ``sync_every`` steps (so the window
holds every fragment's sync once), after a warm-up window (compilation), over
``--repeats`` windows that interleave the variants; ``--sync-every`` far above the
window count measures steps without any sync. Each ``gmjax.diloco`` variant also runs
as ``..., between``: the host counts the updates and passes ``between_rounds=True`` on
those that do no round work (``RoundSchedule.due``), so that they run the program
without the round; its scratch is that program's. ``..., unchecked`` is the same with
``drop_non_finite=False`` (no finiteness check, as plain optax); with one learner,
``optax.apply_if_finite(adamw)`` is plain optax's own guard against non-finite steps
(it keeps the state of a step it drops), for the cost of a check. Two clocks: the wall clock, and the
process's CPU time (all its threads), to which other jobs on the machine add little;
for each, "ratio" is the median of the windows' ratios to the reference and "least"
the ratio of the least windows (other work only ever adds time). ``temp`` is the compiled step's scratch memory, which XLA on CPU
allocates on every call: a rarely taken branch that needs more of it slows every step.

With ``--learners M`` (M > 1) the same runs on ``M`` fake CPU devices, one learner each:
``jit(shard_map(step))`` over a ``"learner"`` axis, every learner on its own parameters
(seeded apart) and batch, with donation only. Then ``gmjax.diloco`` syncs across the axis
(each of its outer-step layouts) and the reference is ``optax.adamw`` in the same
shard_map with no communication; "data-parallel adamw" also ``pmean``-s the gradients
every step, the synchronous baseline DiLoCo replaces.

With ``--multisteps K`` (one learner) every step is a micro-step of gradient
accumulation over ``K`` micro-batches: ``optax.MultiSteps(optax.adamw, K)`` is the
reference, against ``optax.MultiSteps(gmjax.diloco(adamw), K)`` (``sync_every`` counted
in macro steps) and ``gmjax.diloco(optax.MultiSteps(adamw, K))`` (``sync_every·K`` micro-
steps, the same schedule); a window is then ``sync_every·K`` micro-steps. ``--window N``
sets a window's length instead: with ``--sync-every`` far above the steps run, every
window holds micro-steps alone (no round), which is what a micro-step costs.

``--dtype bfloat16`` holds the parameters (and so the gradients, updates and anchor) in
bf16.

Run: .venv/bin/python benchmarks/transform_overhead.py [--repeats N] [--sync-every H]
     [--learners M] [--multisteps K] [--window N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
import inmesh

WIDTHS = (512, 1024, 1024, 512)
BATCH = 64


def init_mlp(key, dtype=jnp.float32):
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
    key, sub = jax.random.split(key)
    params[f"layer{i}"] = {
        "w": (jax.random.normal(sub, (fan_in, fan_out), jnp.float32) / fan_in**0.5
              ).astype(dtype),
        "b": jnp.zeros((fan_out,), dtype),
    }
  return params


def loss_fn(params, x, y):
  h = x
  for i in range(len(WIDTHS) - 1):
    layer = params[f"layer{i}"]
    h = h @ layer["w"] + layer["b"]
    if i < len(WIDTHS) - 2:
      h = jax.nn.gelu(h)
  return jnp.mean(jnp.square(h - y))


def make_step(optimizer, donate=True, mesh=None, data_parallel=False, rounds=None):
  """The jitted step; with ``mesh``, one learner per device of its ``"learner"`` axis.

  With ``rounds`` (a ``gmjax.DiLoCo``) the step takes a fifth, static, argument:
  ``between_rounds``, which it passes to ``gmjax.diloco``'s update.
  """
  def step(params, state, x, y, between=False):
    grads = jax.grad(loss_fn)(params, x, y)
    if data_parallel:
      grads = jax.lax.pmean(grads, "learner")
    extra = {"between_rounds": between} if rounds is not None else {}
    updates, state = optimizer.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  donated = (0, 1) if donate else ()
  static = (4,) if rounds is not None else ()
  if mesh is None:
    return jax.jit(step, donate_argnums=donated, static_argnums=static)
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)

  def sharded(params, state, x, y, between=False):
    body = lambda *args: jax.tree.map(lambda a: a[None],
                                      step(*map(first, args), between=between))
    return jax.shard_map(body, mesh=mesh, in_specs=P("learner"),
                         out_specs=P("learner"))(params, state, x, y)

  return jax.jit(sharded, donate_argnums=donated, static_argnums=static)


class Trainer:
  """A jitted training step of ``optimizer`` on the MLP, with its own params and state.

  With ``mesh``, every argument is stacked over the mesh's learners, seeded apart.
  """

  def __init__(self, optimizer, donate=True, mesh=None, data_parallel=False, rounds=None,
               dtype=jnp.float32):
    learners = 1 if mesh is None else mesh.shape["learner"]
    # Seeds 0, 1, 2 for one learner's params, x and y (as before); 3m + those for m.
    keys = [jnp.stack([jax.random.PRNGKey(3 * m + i) for m in range(learners)])
            for i in range(3)]
    self.params = jax.vmap(lambda k: init_mlp(k, dtype))(keys[0])
    self.x = jax.vmap(lambda k: jax.random.normal(k, (BATCH, WIDTHS[0])))(keys[1])
    self.y = jax.vmap(lambda k: jax.random.normal(k, (BATCH, WIDTHS[-1])))(keys[2])
    if mesh is None:
      self.params, self.x, self.y = jax.tree.map(lambda a: a[0],
                                                 (self.params, self.x, self.y))
      self.state = optimizer.init(self.params)
    else:
      sharding = NamedSharding(mesh, P("learner"))
      self.params, self.x, self.y = jax.device_put((self.params, self.x, self.y), sharding)
      self.state = inmesh.learner_init(optimizer, mesh)(self.params)
    self.step = make_step(optimizer, donate, mesh, data_parallel, rounds)
    # With ``rounds``, the host counts the updates and runs the round-free program on
    # the steps its schedule says do no round work (``RoundSchedule.due``).
    self.schedule = None
    if rounds is not None:
      fragments = jax.tree.leaves(self.state.pending)[0].shape[-1]
      self.schedule, self.count = rounds.schedule(fragments), 0
    # Fake CPU devices run each learner's collectives on XLA's rendezvous threads; many
    # queued steps starve them on a small machine (a 40 s abort), so with a mesh each
    # step is awaited (every variant alike).
    self.await_each = mesh is not None

  def temp_bytes(self):
    """Scratch bytes of the compiled step."""
    args = (self.params, self.state, self.x, self.y) + (() if self.schedule is None
                                                          else (True,))
    return self.step.lower(*args).compile().memory_analysis().temp_size_in_bytes

  def window(self, steps):
    """Mean seconds per step over ``steps`` steps: ``(wall, cpu)``, ``cpu`` the
    process's CPU time (every thread's), which other jobs on the machine do not add to."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
      args = (self.params, self.state, self.x, self.y)
      if self.schedule is not None:
        args += (not self.schedule.due(self.count),)
        self.count += 1
      self.params, self.state = self.step(*args)
      if self.await_each:
        jax.block_until_ready((self.params, self.state))
    jax.block_until_ready((self.params, self.state))
    return ((time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps)


def variants(sync_every, learners, multisteps=1):
  """``{label: (make optimizer, Trainer keyword arguments)}`` of the compared steps.

  The first is the reference of the ratios.
  """
  inner = lambda: optax.adamw(1e-3)
  if multisteps > 1:
    accumulate = lambda tx: optax.MultiSteps(tx, multisteps)
    config = lambda h: gmjax.DiLoCo(sync_every=h, fragments=4, delta_precision="I4",
                                    overlap_steps=0)
    outside = config(sync_every * multisteps)
    return {
        f"MultiSteps(adamw, {multisteps})": (lambda: accumulate(inner()), {}),
        "MultiSteps(diloco P=4 I4)": (
            lambda: accumulate(gmjax.diloco(inner(), config(sync_every))), {}),
        "diloco(MultiSteps) P=4 I4": (
            lambda: gmjax.diloco(accumulate(inner()), outside), {}),
        "diloco(MultiSteps) P=4 I4, between": (
            lambda: gmjax.diloco(accumulate(inner()), outside), {"rounds": outside}),
    }
  found = {"optax.adamw": (inner, {})}
  if learners == 1:
    layouts, axis = [("", {})], {}
    # Plain optax's own guard against a non-finite step, beside gmjax's check.
    found["optax.apply_if_finite(adamw)"] = (
        lambda: optax.apply_if_finite(inner(), max_consecutive_errors=10**9), {})
  else:
    found["data-parallel adamw"] = (inner, {"data_parallel": True})
    layouts, axis = [(f" {k}", v) for k, v in inmesh.layouts()], {"axis_name": "learner"}
  one = gmjax.DiLoCo(sync_every=sync_every)
  streaming = gmjax.DiLoCo(sync_every=sync_every, fragments=4, delta_precision="I4",
                           overlap_steps=2, mixing=0.5)
  for suffix, kwargs in layouts:
    for name, config in (("P=1 F32", one), ("P=4 I4 tau=2 mix=.5", streaming)):
      make = lambda kw=kwargs, c=config: gmjax.diloco(inner(), c, **axis, **kw)
      found[f"diloco {name}{suffix}"] = (make, {})
      found[f"diloco {name}{suffix}, between"] = (make, {"rounds": config})
      unchecked = lambda kw=kwargs, c=config: gmjax.diloco(inner(), c, **axis, **kw,
                                                           drop_non_finite=False)
      found[f"diloco {name}{suffix}, between, unchecked"] = (unchecked, {"rounds": config})
  return found


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--sync-every", type=int, default=50)
  parser.add_argument("--learners", type=int, default=1)
  parser.add_argument("--multisteps", type=int, default=1)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="the parameters' dtype (the data and the loss stay F32)")
  parser.add_argument("--window", type=int, default=None,
                      help="steps a window (default sync_every x multisteps, so that a"
                      " window holds every fragment's sync once); with a --sync-every far"
                      " above it, windows hold no sync at all")
  args = parser.parse_args()
  if args.multisteps > 1 and args.learners > 1:
    parser.error("--multisteps runs one learner; leave --learners at 1")
  if args.learners > 1:
    inmesh.fake_cpu_devices(args.learners)  # before JAX's first use of a device
  mesh = None if args.learners == 1 else jax.make_mesh((args.learners,), ("learner",))
  n = sum(p.size for p in jax.tree.leaves(init_mlp(jax.random.PRNGKey(0))))
  window = args.window or args.sync_every * args.multisteps
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({platform.machine()}),"
        f" MLP {WIDTHS}, {n / 1e6:.2f}M {args.dtype} params, batch {BATCH},"
        f" {args.learners} learner(s),"
        f" window {window} steps, median of {args.repeats}")
  donations = (True, False) if mesh is None else (True,)
  trainers = {
      (label, donate): Trainer(make(), donate, mesh, dtype=jnp.dtype(args.dtype), **options)
      for donate in donations
      for label, (make, options) in variants(args.sync_every, args.learners,
                                             args.multisteps).items()
  }
  reference = next(iter(trainers))[0]
  for trainer in trainers.values():
    trainer.window(window)  # compiles
  # Windows interleave, so a change in machine load moves every variant alike.
  seconds = {key: [] for key in trainers}
  for _ in range(args.repeats):
    for key, trainer in trainers.items():
      seconds[key].append(trainer.window(window))
  for (label, _), trainer in trainers.items():
    programs = 1 if trainer.schedule is None else 2  # with and without the round
    if trainer.step._cache_size() > programs * (1 if mesh is None else 2):
      raise RuntimeError(f"{label}: the step compiled {trainer.step._cache_size()} times")
  width = max(len(label) for label, _ in trainers)
  print(f"  {'':{width}s} {'':8s} {'wall ms/step':>13s}  {'ratio':>5s}  {'least':>5s}"
        f"  {'cpu ms/step':>11s}  {'ratio':>5s}  {'least':>5s}  scratch")
  for (label, donate), times in seconds.items():
    base = seconds[reference, donate]
    columns = []
    for clock in (0, 1):  # wall, cpu: the median of the windows' ratios, then of minima
      ratio = statistics.median(t[clock] / b[clock] for t, b in zip(times, base))
      least = min(t[clock] for t in times) / min(b[clock] for b in base)
      columns.append(f"{statistics.median(t[clock] for t in times) * 1e3:{11 + 2 * (1 - clock)}.3f}"
                     f"  {ratio:.2f}x  {least:.2f}x")
    temp = trainers[label, donate].temp_bytes() / 2**20
    print(f"  {label:{width}s} {'donated' if donate else 'copied ':8s} {columns[0]}  {columns[1]}"
          f"  {temp:6.1f} MiB")


if __name__ == "__main__":
  main()
