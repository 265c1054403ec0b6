"""One learner of the demo job, as its own process: ``python -m gmjax.app.worker``.

It opens the run, joins, trains its shard with AdamW, hands its parameters to
``learner.step`` after every inner step, and writes one JSON line of metrics per step.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import optax

import gmjax
from gmjax.app import config as config_lib
from gmjax.app import data, model


def inner_optimizer(cfg: config_lib.TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * 0.1,
  )
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=cfg.weight_decay))


def evaluate(evaluate_fn, params, batches: data.Batches, count: int) -> float:
  return float(np.mean([float(evaluate_fn(params, batches.next())) for _ in range(count)]))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--config", required=True)
  parser.add_argument("--run", required=True, help="the run's URL")
  parser.add_argument("--name", required=True)
  parser.add_argument("--index", type=int, required=True)
  parser.add_argument("--metrics", required=True, help="JSONL file to write")
  args = parser.parse_args(argv)

  cfg = config_lib.load(args.config)
  train_tokens, valid_tokens = data.load_corpus(cfg.corpus_bytes)
  batches = data.Batches(train_tokens, seq_len=cfg.model.seq_len, batch_size=cfg.batch_size,
                         shard=args.index, shards=cfg.learners, seed=cfg.seed)
  valid = data.Batches(valid_tokens, seq_len=cfg.model.seq_len, batch_size=cfg.batch_size,
                       seed=cfg.seed + 1)
  graphdef, params = model.build(cfg.model, seed=cfg.seed + 1 + args.index)
  optimizer = inner_optimizer(cfg)
  train_step, evaluate_fn = model.make_train_step(graphdef, optimizer)

  run = gmjax.mail.open(args.run)
  learner = run.join(args.name, poll_interval=cfg.poll_interval)
  params = learner.pull(params)
  opt_state = optimizer.init(params)
  # The job's learners start together: a round closes with the learners live at the time,
  # so one that is still starting up would miss the first rounds.
  deadline = time.monotonic() + 300
  while len(run.learners()) < cfg.learners:
    if time.monotonic() > deadline:
      raise TimeoutError(f"only {len(run.learners())} of {cfg.learners} learners joined in 300 s")
    time.sleep(cfg.poll_interval)
  with open(args.metrics, "a", encoding="utf-8") as out:
    def log(**record):
      out.write(json.dumps({"learner": args.name, "time": time.time(), **record}) + "\n")
      out.flush()

    log(event="start", step=0, val_loss=evaluate(evaluate_fn, params, valid, cfg.eval_batches))
    for step in range(1, cfg.steps + 1):
      batch = batches.next()
      started = time.perf_counter()
      params, opt_state, loss = train_step(params, opt_state, batch)
      loss = float(loss)
      params = learner.step(params, tokens=int(batch[:, 1:].size), loss=loss)
      record = {"event": "step", "step": step, "loss": loss,
                "seconds": time.perf_counter() - started}
      if step % cfg.eval_every == 0 or step == cfg.steps:
        record["val_loss"] = evaluate(evaluate_fn, params, valid, cfg.eval_batches)
      log(**record)
    params = learner.close(params)
    log(event="closed", step=cfg.steps, val_loss=evaluate(evaluate_fn, params, valid, cfg.eval_batches))


if __name__ == "__main__":
  main()
