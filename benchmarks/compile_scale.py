"""What compiling a training step costs: plain optax, data-parallel adamw, ``gmjax.diloco``.

A GPT-like model of ``L`` layers (12 leaves a layer: two layer norms, QKV, attention
output and a two-layer MLP, each with weights and biases; 4 more leaves: token and
position embeddings, the final norm) trains on ``M`` learners, one per fake CPU device of
an explicit ``jax.make_mesh`` mesh, as ``jit(vmap(step, axis_name="learner",
spmd_axis_name="learner"))`` with the parameters and state donated. Each step computes
the loss gradient, the optimizer update and ``apply_updates``. Compared, at each point of
the grid:

* ``plain adamw``: ``optax.adamw`` on each learner, no communication;
* ``data-parallel adamw``: the same with the gradients ``pmean``-ed every step;
* ``diloco ...``: ``gmjax.diloco(optax.adamw(...), config, axis_name="learner")``;
  ``..., between``: its program for the steps between rounds (``update(...,
  between_rounds=True)``), which a run compiles beside the step with the round.

With ``--learners 1`` the step is ``jit(step)`` with no mesh and ``axis_name=None``, and
the ratios are against plain adamw.

``--scanned`` stacks the layers instead, as flax ``nnx.scan`` and MaxText's
``scan_layers`` do: each of the 12 parameter types of all ``L`` layers is one leaf with
the layers on axis 0 (16 leaves whatever ``L``), and the forward pass is a
``lax.scan`` over them. diloco P=4 then cuts fragments by blocks of layers
(``layer_axis={"layers": 0}``), as Streaming DiLoCo and MaxText do.

Each row is compiled ``--repeats`` times (``jit(...).lower(...).compile()``, nothing is
run; compile times on a 2-core machine vary by up to 2x from one compile to the next,
so the least is reported) and reports the compile time, the compiled HLO text's size,
the collectives in it (all-reduce, all-gather, all-to-all, collective-permute,
reduce-scatter) and the step's scratch
(``memory_analysis().temp_size_in_bytes``), with ratios against data-parallel adamw,
and its kernels (the fusions in the compiled text: XLA:CPU generates one for each, and
generating them is most of the compile time), and in parentheses how many of them
differ (XLA:CPU compiles identical fusions once: these are what compiling costs).
``--perf-windows`` prints each compile's
``CLOCK_MONOTONIC`` start and end, to read the compile alone out of ``perf record -k mono
-g -- ...`` with ``perf report --time START,END``.

``--loops`` then prints each step's kernels (distinct) outside its loops and inside each
``while`` loop of its entry computation: a ``gmjax.diloco`` step's round parts (the
dropped step's zeroing, the first update, each fragment's sync, each merge).

Run: .venv/bin/python benchmarks/compile_scale.py [--learners 1 2 8 32] [--layers 2 12 24]
     [--width 64] [--scanned] [--variants NAME ...] [--repeats N] [--perf-windows]
     [--loops]
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import time

import inmesh

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter")


def init_gpt(key, layers, width, vocab=256, context=32):
  import jax
  import jax.numpy as jnp

  keys = iter(jax.random.split(key, 4 + 6 * layers))
  normal = lambda shape: jax.random.normal(next(keys), shape, jnp.float32) / shape[0] ** 0.5
  params = {
      "embed": normal((vocab, width)),
      "position": normal((context, width)),
      "final_norm": {"scale": jnp.ones(width), "bias": jnp.zeros(width)},
  }
  for i in range(layers):
    params[f"layer{i:02d}"] = {
        "norm1": {"scale": jnp.ones(width), "bias": jnp.zeros(width)},
        "qkv": {"w": normal((width, 3 * width)), "b": jnp.zeros(3 * width)},
        "out": {"w": normal((width, width)), "b": jnp.zeros(width)},
        "norm2": {"scale": jnp.ones(width), "bias": jnp.zeros(width)},
        "fc": {"w": normal((width, 4 * width)), "b": jnp.zeros(4 * width)},
        "proj": {"w": normal((4 * width, width)), "b": jnp.zeros(width)},
    }
  return params


def init_scanned(key, layers, width, vocab=256, context=32):
  """``init_gpt``'s parameters with each parameter type of all layers stacked on axis 0."""
  import jax

  params = init_gpt(key, layers, width, vocab, context)
  stacked = [params.pop(f"layer{i:02d}") for i in range(layers)]
  params["layers"] = jax.tree.map(lambda *leaves: jax.numpy.stack(leaves), *stacked)
  return params


def loss_fn(params, tokens):
  import jax
  import jax.numpy as jnp

  def norm(x, p):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.var(x, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  length = inputs.shape[1]
  h = params["embed"][inputs] + params["position"][:length]
  mask = jnp.tril(jnp.ones((length, length), bool))

  def block(h, layer):
    x = norm(h, layer["norm1"])
    q, k, v = jnp.split(x @ layer["qkv"]["w"] + layer["qkv"]["b"], 3, axis=-1)
    scores = jnp.where(mask, q @ jnp.swapaxes(k, -1, -2) / q.shape[-1] ** 0.5, -1e9)
    h = h + jax.nn.softmax(scores, -1) @ v @ layer["out"]["w"] + layer["out"]["b"]
    x = norm(h, layer["norm2"])
    x = jax.nn.gelu(x @ layer["fc"]["w"] + layer["fc"]["b"])
    return h + x @ layer["proj"]["w"] + layer["proj"]["b"], None

  if "layers" in params:  # stacked (``init_scanned``)
    h, _ = jax.lax.scan(block, h, params["layers"])
  for name in sorted(k for k in params if k.startswith("layer") and k != "layers"):
    h, _ = block(h, params[name])
  logits = norm(h, params["final_norm"]) @ params["embed"].T
  return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))


def variants(scanned=False):
  import optax

  import gmjax

  inner = lambda axis="learner": optax.adamw(1e-3)
  one = lambda axis="learner": gmjax.diloco(inner(), gmjax.DiLoCo(sync_every=50),
                                            axis_name=axis)
  blocks = {"layer_axis": {"layers": 0}} if scanned else {}
  four = lambda axis="learner": gmjax.diloco(
      inner(), gmjax.DiLoCo(sync_every=50, fragments=4, delta_precision="I4", **blocks),
      axis_name=axis)
  between = {"between_rounds": True}
  return {
      "plain adamw": (inner, False, {}),
      "data-parallel adamw": (inner, True, {}),
      "diloco P=1 F32": (one, False, {}),
      "diloco P=4 I4": (four, False, {}),
      "diloco P=1 F32, between": (one, False, between),
      "diloco P=4 I4, between": (four, False, between),
  }


REPEATS = 1
PERF_WINDOWS = False
SCANNED = False


def init_params(key, layers, width):
  """The model's parameters: ``init_scanned``'s with ``--scanned``, else ``init_gpt``'s."""
  return (init_scanned if SCANNED else init_gpt)(key, layers, width)


def compile_timed(lower):
  """The compiled step and the least of ``REPEATS`` compile times.

  ``lower()`` lowers the step anew each time, after JAX's caches are cleared: a
  ``Lowered`` keeps its executable, and JAX keeps compiled modules.
  """
  import jax

  times = []
  for _ in range(REPEATS):
    jax.clear_caches()  # JAX would return the executable it compiled before
    lowered = lower()
    start = time.monotonic()
    compiled = lowered.compile()
    times.append(time.monotonic() - start)
    if PERF_WINDOWS:  # for `perf record -k mono`, then `perf report --time START,END`
      print(f"compile window {start:.6f},{time.monotonic():.6f}", file=sys.stderr,
            flush=True)
  return compiled, min(times)


def kernels(text):
  """The fusions of a compiled module's text: XLA:CPU generates a kernel for each."""
  return len(re.findall(r" fusion\(", text))


def _computations(text):
  """Each computation of a compiled module's text: its name -> its instruction lines."""
  bodies, name = {}, None
  for line in text.splitlines():
    start = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if start:
      name = start.group(1)
      bodies[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      bodies[name].append(line)
  return bodies


def _same(lines):
  """A fusion's body with names and metadata left out: equal for identical kernels."""
  return "\n".join(re.sub(r"%[\w.\-]+", "%", re.sub(r"metadata=\{[^}]*\}", "", line))
                   for line in lines)


def distinct_kernels(text):
  """The fusions of a compiled module's text whose computations differ once names and
  metadata are left out: XLA:CPU compiles identical ones once, so these are what
  compiling costs."""
  bodies = _computations(text)
  called = re.findall(r" fusion\([^\n]*calls=%([\w.\-]+)", text)
  return len({_same(bodies[c]) for c in called if c in bodies})


def loop_kernels(text):
  """``[(kernels, distinct), ...]``: outside every loop of the entry computation first,
  then inside each of its ``while`` loops (with what they call), in program order. A
  ``gmjax.diloco`` step's loops are its round's parts that run once or not at all
  (``gmjax.transform.control``)."""
  bodies = _computations(text)

  def fusions(name, found):
    for line in bodies.get(name, []):
      fused = re.search(r" fusion\(.*calls=%([\w.\-]+)", line)
      if fused:
        found.append(fused.group(1))
      for called in re.findall(r"(?:condition|body|to_apply|true_computation|"
                               r"false_computation)=%([\w.\-]+)", line):
        fusions(called, found)
      for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        for called in re.findall(r"%([\w.\-]+)", group):
          fusions(called, found)
    return found

  entry = re.search(r"^ENTRY %(\S+)", text, re.M).group(1)
  loops = [fusions(body, []) for body in
           re.findall(r" while\(.*body=%([\w.\-]+)", "\n".join(bodies[entry]))]
  inside = {f for loop in loops for f in loop}
  parts = [[f for f in fusions(entry, []) if f not in inside]] + loops
  return [(len(part), len({_same(bodies[f]) for f in part if f in bodies})) for part in parts]


def measure(make, data_parallel, mesh, layers, width, extra):
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  if mesh is None:
    return measure_one(make, layers, width, extra)
  learners = mesh.shape["learner"]
  optimizer = make()
  keys = jnp.stack([jax.random.PRNGKey(m) for m in range(learners)])
  params = jax.vmap(lambda k: init_params(k, layers, width))(keys)
  tokens = jnp.zeros((learners, 4, 33), jnp.int32)
  sharding = NamedSharding(mesh, P("learner"))
  params, tokens = jax.device_put((params, tokens), sharding)

  def step(params, state, tokens):
    grads = jax.grad(loss_fn)(params, tokens)
    if data_parallel:
      grads = jax.lax.pmean(grads, "learner")
    updates, state = optimizer.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    init = jax.jit(jax.vmap(optimizer.init, axis_name="learner", spmd_axis_name="learner"))
    # Every leaf split over the learners (optax's step counts come out replicated).
    state = jax.device_put(init(params), sharding)
    jitted = jax.jit(jax.vmap(step, axis_name="learner", spmd_axis_name="learner"),
                     donate_argnums=(0, 1))
    compiled, seconds = compile_timed(lambda: jitted.lower(params, state, tokens))
  text = compiled.as_text()
  collectives = len(re.findall(rf"\b({'|'.join(COLLECTIVES)})(-start)?\(", text))
  leaves = len(jax.tree.leaves(params))
  size = sum(p.size for p in jax.tree.leaves(params)) // learners
  return dict(seconds=seconds, chars=len(text), collectives=collectives,
              kernels=kernels(text), distinct=distinct_kernels(text), loops=loop_kernels(text),
              temp=compiled.memory_analysis().temp_size_in_bytes, leaves=leaves, size=size)


def measure_one(make, layers, width, extra):
  """One learner, no mesh: ``jit(step)`` with ``axis_name=None``."""
  import jax
  import jax.numpy as jnp
  import optax

  optimizer = make(None)
  params = init_params(jax.random.PRNGKey(0), layers, width)
  tokens = jnp.zeros((4, 33), jnp.int32)

  def step(params, state, tokens):
    grads = jax.grad(loss_fn)(params, tokens)
    updates, state = optimizer.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  state = optimizer.init(params)
  jitted = jax.jit(step, donate_argnums=(0, 1))
  compiled, seconds = compile_timed(lambda: jitted.lower(params, state, tokens))
  text = compiled.as_text()
  return dict(seconds=seconds, chars=len(text), collectives=0, kernels=kernels(text),
              distinct=distinct_kernels(text), loops=loop_kernels(text),
              temp=compiled.memory_analysis().temp_size_in_bytes,
              leaves=len(jax.tree.leaves(params)),
              size=sum(p.size for p in jax.tree.leaves(params)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--learners", type=int, nargs="+", default=[2, 8, 32])
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 12, 24])
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--scanned", action="store_true",
                      help="stack the layers in one leaf a parameter type (lax.scan), and"
                      " cut diloco P=4's fragments by blocks of layers")
  parser.add_argument("--variants", nargs="+", default=None)
  parser.add_argument("--repeats", type=int, default=1,
                      help="compile each step this many times and report the least time")
  parser.add_argument("--perf-windows", action="store_true",
                      help="print each compile's CLOCK_MONOTONIC start and end to stderr")
  parser.add_argument("--loops", action="store_true",
                      help="after the table, each step's kernels (distinct) outside its loops"
                      " and in each loop (the round's parts)")
  args = parser.parse_args()
  global REPEATS, PERF_WINDOWS, SCANNED
  REPEATS, PERF_WINDOWS, SCANNED = args.repeats, args.perf_windows, args.scanned
  inmesh.fake_cpu_devices(max(max(args.learners), 2))
  import jax

  chosen = variants(args.scanned)
  if args.variants:
    unknown = [v for v in args.variants if v not in chosen]
    if unknown:
      parser.error(f"unknown --variants {unknown}; choose from {list(chosen)}")
    chosen = {k: v for k, v in chosen.items() if k in args.variants}
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({platform.machine()}),"
        f" GPT width {args.width}{', layers scanned' if args.scanned else ''}")
  print("| M | L | leaves | params | step | compile s | / base | HLO chars | / base"
        " | kernels (distinct) | collectives | scratch MiB | / base |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  loops = []
  for learners in args.learners:
    mesh = None if learners == 1 else jax.make_mesh((learners,), ("learner",),
                                                    devices=jax.devices()[:learners])
    for layers in args.layers:
      rows = {label: measure(make, dp, mesh, layers, args.width, extra)
              for label, (make, dp, extra) in chosen.items()
              if mesh is not None or label != "data-parallel adamw"}
      base = rows.get("data-parallel adamw" if mesh is not None else "plain adamw")
      for label, row in rows.items():
        ratio = lambda key: "-" if base is None else f"{row[key] / max(base[key], 1e-9):.2f}"
        print(f"| {learners} | {layers} | {row['leaves']} | {row['size'] / 1e6:.2f}M"
              f" | {label} | {row['seconds']:.1f} | {ratio('seconds')}"
              f" | {row['chars'] / 1e6:.2f}M | {ratio('chars')}"
              f" | {row['kernels']} ({row['distinct']})"
              f" | {row['collectives']}"
              f" | {row['temp'] / 2**20:.1f} | {ratio('temp')} |", flush=True)
      loops.extend((learners, layers, label, row["loops"]) for label, row in rows.items())
  for learners, layers, label, parts in loops if args.loops else ():
    (outside, distinct), *inside = parts
    print(f"M={learners} L={layers} {label}: outside the loops {outside} ({distinct});"
          f" {len(inside)} loops: {', '.join(f'{k} ({d})' for k, d in inside) or '-'}")


if __name__ == "__main__":
  main()
