"""Convergence study: DiLoCo variants against synchronous data-parallel training, in-mesh.

The same tokens, model and inner optimizer for every row: a byte-level transformer LM
(``gmjax.app.model``, d_model 128, 2 layers, 0.47M parameters) on the Python standard
library's sources, ``M = 4`` learners under ``jax.vmap`` (each on its own share of the
training bytes, ``--split``; the same batches in every row), AdamW inner steps. "data-parallel"
``pmean``s the gradients every step (one model, the same global batch); the DiLoCo rows
run ``gmjax.diloco`` with the row's settings. Every row reports the held-out loss of its
final global model (the anchor Θ, or data-parallel's parameters) over the same held-out
batches, and the bytes each learner sent: data-parallel a ring all-reduce of F32
gradients per step, ``2(M−1)/M · 4n``; DiLoCo its delta payloads (``config.delta_layout``:
codes, scales and sparse indices), once per round of each fragment.

Run: .venv/bin/python benchmarks/convergence.py [--steps 1200] [--only LABEL ...]
     [--variant 'LABEL={"sync_every": 30, ...}'] [--batch 8] [--lr 3e-3]
     [--split contiguous|iid] [--seed 0] [--json out.json] [--plot convergence.png]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import gmjax
from gmjax.app import data, model

LEARNERS = 4
BATCH = 8          # per learner and step
MODEL = model.ModelConfig(d_model=128, layers=2, heads=4, mlp=512, seq_len=64)
EVAL_BATCHES = 16  # of 32 windows each
IID_BLOCK = 4096   # bytes dealt to the learners in turn by --split iid

# label -> gmjax.DiLoCo settings (None: data-parallel).
VARIANTS = {
    "data-parallel": None,
    "DiLoCo H=30": dict(sync_every=30),
    "DiLoCo H=100": dict(sync_every=100),
    "Streaming P=4 H=30 F8": dict(sync_every=30, fragments=4, delta_precision="F8_E4M3"),
    "Streaming P=4 H=30 I4": dict(sync_every=30, fragments=4, delta_precision="I4"),
    "Streaming P=4 H=30 I4+EF": dict(sync_every=30, fragments=4, delta_precision="I4",
                                     error_feedback=1.0),
    "Streaming P=4 H=30 top-3% I2+EF": dict(sync_every=30, fragments=4,
                                            delta_precision="I2", delta_topk=128,
                                            delta_chunk=4096, error_feedback=1.0),
    "Delayed H=30": dict(sync_every=30, outer_delay=1),
    "Eager H=30": dict(sync_every=30, outer_delay=1, eager=True),
    # The study's tuned rows (BENCHMARKS.md): 2-bit sparse with uint8 indices, and eager.
    "Streaming P=4 H=30 top-9.4% of 256 I2+EF η1 μ0.5": dict(
        sync_every=30, fragments=4, delta_precision="I2", delta_topk=24, delta_chunk=256,
        error_feedback=1.0, outer_learning_rate=1.0, outer_momentum=0.5),
    "Eager H=30 η1 μ0": dict(sync_every=30, outer_delay=1, eager=True,
                             outer_learning_rate=1.0, outer_momentum=0.0),
}


def inner_optimizer(steps: int, lr: float = 3e-3) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10), steps,
                                                end_value=lr / 10)
  return optax.adamw(schedule, weight_decay=0.1)


def bytes_per_step_dp(n: int) -> float:
  return 2 * (LEARNERS - 1) / LEARNERS * 4 * n


def bytes_diloco(config: gmjax.DiLoCo, schema: gmjax.Schema, steps: int) -> int:
  """Bytes of the delta payloads one learner publishes in ``steps`` steps (what a mail
  learner uploads; in-mesh the sharded exchange sends ``(M - 1)/M`` of them and
  all-gathers Θ at the commit precision besides: ``sync_bytes.measure``)."""
  sent = 0
  plan = config.plan(schema)
  for names in plan:
    layout = config.delta_layout(schema.subset(names))
    payload = sum(s.nbytes for s in layout.parameters)
    sent += payload * (steps // config.sync_every)
  return sent


def shards_of(train: np.ndarray, split: str) -> list[np.ndarray]:
  """Each learner's disjoint share of the training bytes.

  ``"iid"``: blocks of ``IID_BLOCK`` bytes dealt round-robin, so that every learner's
  share spans the whole corpus (i.i.d. learners, as in DiLoCo's main experiments);
  ``"contiguous"``: four contiguous quarters of it (each learner on its own part of the
  standard library: non-i.i.d. learners).
  """
  if split == "contiguous":
    size = train.size // LEARNERS
    return [train[m * size:(m + 1) * size] for m in range(LEARNERS)]
  blocks = train[:train.size // IID_BLOCK * IID_BLOCK].reshape(-1, IID_BLOCK)
  return [blocks[m::LEARNERS].reshape(-1) for m in range(LEARNERS)]


def run(label: str, settings: dict | None, steps: int, corpus, every: int,
        batch_size: int = BATCH, lr: float = 3e-3, split: str = "contiguous",
        seed: int = 0):
  """One row. ``seed`` draws the initial parameters and each learner's batch order;
  the held-out windows are the same for every seed."""
  train, valid = corpus
  graphdef, params = model.build(MODEL, seed=seed)
  params = nnx.to_pure_dict(params)
  n = sum(x.size for x in jax.tree.leaves(params))

  def loss(p, batch):
    return model.loss_fn(nnx.merge(graphdef, nnx.State(p)), batch)

  inner = inner_optimizer(steps, lr)
  if settings is None:
    optimizer = inner
  else:
    config = gmjax.DiLoCo(overlap_steps=0, **settings)
    optimizer = gmjax.diloco(inner, config, axis_name="learner")

  def step(p, state, batch):
    value, grads = jax.value_and_grad(loss)(p, batch)
    if settings is None:
      grads = jax.lax.pmean(grads, "learner")
    updates, state = optimizer.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  stacked = jax.tree.map(lambda x: jnp.stack([x] * LEARNERS), params)
  state = jax.vmap(optimizer.init, axis_name="learner")(stacked)
  train_step = jax.jit(jax.vmap(step, axis_name="learner"), donate_argnums=(0, 1))
  evaluate = jax.jit(jax.vmap(loss, in_axes=(None, 0)))
  batches = [data.Batches(share, seq_len=MODEL.seq_len, batch_size=batch_size,
                          seed=seed * LEARNERS + m)
             for m, share in enumerate(shards_of(train, split))]
  held_out = data.Batches(valid, seq_len=MODEL.seq_len, batch_size=32, seed=1)
  eval_set = jnp.stack([held_out.next() for _ in range(EVAL_BATCHES)])

  def global_model(p, state):
    tree = p if settings is None else state.anchor
    return jax.tree.map(lambda x: x[0], tree)

  curve = []
  start = time.perf_counter()
  for t in range(1, steps + 1):
    batch = jnp.asarray(np.stack([b.next() for b in batches]))
    stacked, state, _ = train_step(stacked, state, batch)
    jax.block_until_ready(stacked)
    if t % every == 0 or t == steps:
      curve.append((t, float(jnp.mean(evaluate(global_model(stacked, state), eval_set)))))
  seconds = time.perf_counter() - start
  schema = gmjax.Schema.from_tree(params)
  sent = (bytes_per_step_dp(n) * steps if settings is None
          else bytes_diloco(gmjax.DiLoCo(**settings), schema, steps))
  stats = None if settings is None else jax.tree.map(lambda x: np.asarray(x)[0].item(),
                                                     state.stats._asdict())
  return dict(label=label, params=n, steps=steps, loss=curve[-1][1], curve=curve,
              bytes=sent, seconds=seconds, stats=stats)


def table(results: list[dict]) -> str:
  base = next(r for r in results if r["label"] == "data-parallel")
  lines = ["| run | held-out loss | / data-parallel | bytes per learner | / data-parallel |",
           "| --- | --- | --- | --- | --- |"]
  for r in results:
    lines.append(f"| {r['label']} | {r['loss']:.4f} | {r['loss'] / base['loss']:.3f} |"
                 f" {r['bytes'] / 2**20:,.2f} MiB | 1/{base['bytes'] / r['bytes']:,.0f} |"
                 if r is not base else
                 f"| {r['label']} | {r['loss']:.4f} | 1.000 | {r['bytes'] / 2**20:,.1f} MiB"
                 " | 1 |")
  return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  figure, axis = plt.subplots(figsize=(11, 4.6))
  colors = plt.get_cmap("tab20").colors
  for i, r in enumerate(results):
    steps, losses = zip(*r["curve"])
    dp = r["label"] == "data-parallel"
    axis.plot(steps, losses, label=r["label"], lw=2.5 if dp else 1.2,
              color="black" if dp else colors[i % len(colors)])
  axis.set_xlabel("inner step")
  axis.set_ylabel("held-out loss (nats per byte)")
  axis.set_ylim(top=min(3.0, max(r["curve"][0][1] for r in results)))
  axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  axis.grid(alpha=0.3)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=1200)
  parser.add_argument("--every", type=int, default=100, help="held-out loss every N steps")
  parser.add_argument("--only", nargs="*", default=None, help="labels to run")
  parser.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                      help="an extra row: a label and its gmjax.DiLoCo settings as JSON")
  parser.add_argument("--batch", type=int, default=BATCH, help="windows per learner and step")
  parser.add_argument("--lr", type=float, default=3e-3, help="peak inner learning rate")
  parser.add_argument("--split", choices=("iid", "contiguous"), default="contiguous",
                      help="how the training bytes are shared out (see shards_of)")
  parser.add_argument("--seed", type=int, default=0,
                      help="initial parameters and batch order (held-out set fixed)")
  parser.add_argument("--json", default=None)
  parser.add_argument("--plot", default=None)
  args = parser.parse_args()
  corpus = data.load_corpus(4_000_000)
  variants = dict(VARIANTS)
  for text in args.variant:
    label, settings = text.split("={", 1)  # labels may hold "=" (H=30)
    variants[label] = json.loads("{" + settings)
  labels = args.only if args.only is not None else list(variants)
  labels += [text.split("={", 1)[0] for text in args.variant if args.only is not None]
  results = []
  for label in labels:
    result = run(label, variants[label], args.steps, corpus, args.every, args.batch,
                 args.lr, args.split, args.seed)
    results.append(result)
    print(f"{label}: held-out {result['loss']:.4f}, {result['bytes'] / 2**20:.3f} MiB sent,"
          f" {result['seconds']:.0f} s, stats {result['stats']}", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(results, f)
  print(f"{results[0]['params']:,} parameters, {LEARNERS} learners x {args.steps} steps,"
        f" batch {args.batch} x {MODEL.seq_len} bytes per learner and step, peak inner lr"
        f" {args.lr:g}, {args.split} shares of the training bytes, seed {args.seed}")
  if any(r["label"] == "data-parallel" for r in results):
    print(table(results))
  if args.plot:
    plot(results, args.plot)


if __name__ == "__main__":
  main()
