"""Synchronous data-parallel training: the reference the demo job compares DiLoCo with.

M learners that all-reduce their gradients every step train exactly like one learner on
an M-times larger batch, so the baseline runs as that single learner (one process).
"""

from __future__ import annotations

import json
import time

import numpy as np

from gmjax.app import config as config_lib
from gmjax.app import data, model
from gmjax.app.worker import evaluate, held_out, inner_optimizer


def train_baseline(cfg: config_lib.TrainConfig, metrics_path: str, progress=None,
                   check=lambda: None) -> None:
  """Trains ``cfg.steps`` steps at batch ``learners·batch_size``; one JSON line a step.

  ``check`` is called between steps (``gmjax.app.stops.deferred``: a stop lands there,
  not inside XLA's work).
  """
  train_tokens, valid_tokens = data.load_corpus(cfg.corpus_bytes)
  shards = [data.Batches(train_tokens, seq_len=cfg.model.seq_len, batch_size=cfg.batch_size,
                         shard=i, shards=cfg.learners, seed=cfg.seed) for i in range(cfg.learners)]
  valid = held_out(cfg, valid_tokens)
  graphdef, params = model.build(cfg.model, seed=cfg.seed)
  optimizer = inner_optimizer(cfg)
  train_step, evaluate_fn = model.make_train_step(graphdef, optimizer)
  opt_state = optimizer.init(params)
  with open(metrics_path, "a", encoding="utf-8") as out:
    def log(**record):
      out.write(json.dumps({"learner": "baseline", "time": time.time(), **record}) + "\n")

    log(event="start", step=0, val_loss=evaluate(evaluate_fn, params, valid))
    for step in range(1, cfg.steps + 1):
      check()
      batch = np.concatenate([s.next() for s in shards])
      params, opt_state, loss = train_step(params, opt_state, batch)
      record = {"event": "step", "step": step, "loss": float(loss)}
      if step % cfg.eval_every == 0 or step == cfg.steps:
        record["val_loss"] = evaluate(evaluate_fn, params, valid)
      log(**record)
      if progress is not None:
        progress.update(1)
