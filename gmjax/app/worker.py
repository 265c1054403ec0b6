"""One learner of the demo job, as its own process: ``python -m gmjax.app.worker``.

It opens the run, joins, trains its shard with AdamW, hands its parameters to
``learner.step`` after every inner step, and writes one JSON line of metrics per step.
With ``--state-dir`` it hands ``step`` its AdamW state and its data position too, which
the learner saves there at each commit it applies (``Run.join(..., state_dir=...)``).

A learner that rejoins a run (``gmjax train --resume``) pulls Θ at the step of the run's
newest committed round and restores what it saved in its state dir: its Adam moments,
the schedule's position and its data position go on from its save
(``resume_position``). Without a saved state its moments start from zero and the
schedule and data go on from the run's step.

With ``[train] learner_speeds`` a slower learner sleeps after each inner step (but its
first, which compiles) so that the step takes ``max(speeds) / speed`` times its compute,
or, with ``step_ms``, ``step_ms · max(speeds) / speed`` milliseconds in all. The learner
trains until the run's step (``learner.step_count``) reaches ``steps``: with adaptive
steps a slower learner trains fewer steps of its own.
Each record says how long the learner was blocked in the run (``blocked``: seconds in
``run.join``, ``learner.pull`` and waiting for the job's other learners to join for the
``start``/``resume`` record, which also says when the join began, ``joined``; in
``learner.step`` for a step; in ``learner.close`` for ``closed``): the goodput figure's
idle fraction.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Any, NamedTuple

import numpy as np
import optax

import gmjax
from gmjax.app import config as config_lib
from gmjax.app import data, model


def inner_optimizer(cfg: config_lib.TrainConfig, start: int = 0) -> optax.GradientTransformation:
  """AdamW under a warmup-cosine schedule over ``cfg.steps``, clipped to global norm 1.

  Args:
    cfg: the job's config.
    start: the schedule's step at the optimizer state's count 0: the schedule is at
      step ``count + start`` (a learner that rejoins with fresh Adam moments passes the
      step it starts at; ``resume_position``).
  """
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * 0.1,
  )

  def learning_rate(count):
    return schedule(count + start)

  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(learning_rate, weight_decay=cfg.weight_decay))


class Position(NamedTuple):
  """Where a learner's data and schedule go on from when it starts or rejoins.

  Attributes:
    step: the learner's data position: the batches of its shard it has gone past (its
      own steps trained, plus any skipped at a rejoin), and the ``step`` of its next
      metrics record minus one.
    schedule_offset: the schedule is at the optimizer's count plus this (see
      ``inner_optimizer``), so that it is at ``step`` after each inner step.
  """

  step: int
  schedule_offset: int


def resume_position(start: int, restored: Any, adaptive: bool) -> Position:
  """The data and schedule position of a learner that (re)joins at the run's step ``start``.

  The learner saves ``{"step", "schedule_offset"}`` of its ``Position`` with its Adam
  state at each commit it applies. With fixed steps its steps are the run's steps while
  it runs; with adaptive steps a slower learner trains fewer steps of its own than the
  run's step (``learner.step_count``), which jumps at each round it publishes early, so
  its data and schedule follow its own steps, never the run's step.

  * Nothing restored (a new run, or no saved state): the data and the schedule go on from
    ``start``, with the optimizer's count at zero.
  * ``restored.exact``: the learner goes on from its save, data and schedule where they
    were (its saved position, which under adaptive steps is behind ``start``).
  * Not exact (the run moved on while the learner was stopped), fixed steps: the data is
    skipped and the schedule brought to ``start``, in step with the other learners.
  * Not exact, adaptive steps: from its save, as when exact: it trained no steps of its
    own while it was stopped.

  Args:
    start: ``learner.step_count`` after ``pull`` and ``restore``.
    restored: what ``learner.restore`` gave (``gmjax.mail.Restored``), or None.
    adaptive: whether the run has ``adaptive_steps``.

  Returns:
    ``Position(step, schedule_offset)``.
  """
  if restored is None:
    return Position(start, start)
  saved = Position(int(restored.position["step"]), int(restored.position["schedule_offset"]))
  if restored.exact or adaptive:
    return saved
  # The optimizer's count goes on from the save's: the offset takes the schedule on by
  # the steps the run moved past the save.
  return Position(start, saved.schedule_offset + start - saved.step)


def _joined_since(run, since: str) -> int:
  """How many of the run's learners joined at or after ``since`` (an ISO time)."""
  start = datetime.datetime.fromisoformat(since)
  count = 0
  for record in run.learners().values():
    try:
      joined = datetime.datetime.fromisoformat(record.joined_at)
    except (TypeError, ValueError):
      continue  # a heartbeat without a readable join time is not this job's
    count += joined >= start
  return count


def _open_metrics(path: str):
  """``path`` opened to append lines; a last line that a stopped process left unfinished
  is ended first, so that the next record starts on a line of its own."""
  out = open(path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
  if out.tell() > 0:
    with open(path, "rb") as f:
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        out.write("\n")
  return out


def held_out(cfg: config_lib.TrainConfig, tokens: np.ndarray) -> list[np.ndarray]:
  """The job's held-out batches (``data.held_out``), the same for its learners and its
  baseline."""
  return data.held_out(tokens, seq_len=cfg.model.seq_len, batch_size=cfg.batch_size,
                       count=cfg.eval_batches, seed=cfg.seed + 1)


def evaluate(evaluate_fn, params, batches: list[np.ndarray]) -> float:
  """The mean loss of ``params`` over the held-out ``batches``."""
  return float(np.mean([float(evaluate_fn(params, batch)) for batch in batches]))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--config", required=True)
  parser.add_argument("--run", required=True, help="the run's URL")
  parser.add_argument("--name", required=True)
  parser.add_argument("--index", type=int, required=True)
  parser.add_argument("--metrics", required=True, help="JSONL file to append to")
  parser.add_argument("--since", help="wait for the job's learners that joined at or after"
                      " this ISO time (default: for as many heartbeats as learners)")
  parser.add_argument("--resume", action="store_true",
                      help="the learner rejoins a run it trained in before")
  parser.add_argument("--state-dir", help="the learner's own directory, where it keeps its"
                      " Adam state and data position across restarts")
  args = parser.parse_args(argv)

  cfg = config_lib.load_record(args.config)  # what the job checked, not the TOML file
  train_tokens, valid_tokens = data.load_corpus(cfg.corpus_bytes)
  batches = data.Batches(train_tokens, seq_len=cfg.model.seq_len, batch_size=cfg.batch_size,
                         shard=args.index, shards=cfg.learners, seed=cfg.seed)
  valid = held_out(cfg, valid_tokens)
  graphdef, params = model.build(cfg.model, seed=cfg.seed + 1 + args.index)

  joined_at, joining = time.time(), time.perf_counter()
  run = gmjax.mail.open(args.run)
  learner = run.join(args.name, poll_interval=cfg.poll_interval, state_dir=args.state_dir)
  params = learner.pull(params)
  slowdown, step_seconds = cfg.slowdown(args.index), cfg.step_seconds(args.index)
  # The schedule is at step count + offset; the offset is kept with the state, since a
  # state saved after a resume without one counts from that resume's step.
  restored = None
  if args.state_dir is not None:
    restored = learner.restore(inner_optimizer(cfg).init(params))
  start, offset = resume_position(learner.step_count, restored, cfg.diloco.adaptive_steps)
  batches.skip(start)
  optimizer = inner_optimizer(cfg, offset)
  train_step, evaluate_fn = model.make_train_step(graphdef, optimizer)
  opt_state = (model.init_state(optimizer, params) if restored is None
               else model.placed(restored.state, params))
  # The job's learners start together: a round closes with the learners live at the time,
  # so one that is still starting up would miss the first rounds.
  deadline = time.monotonic() + 300

  def joined():
    return len(run.learners()) if args.since is None else _joined_since(run, args.since)

  while joined() < cfg.learners:
    if time.monotonic() > deadline:
      raise TimeoutError(f"only {joined()} of {cfg.learners} learners joined in 300 s")
    time.sleep(cfg.poll_interval)
  joined_seconds = time.perf_counter() - joining
  with _open_metrics(args.metrics) as out:
    def log(**record):
      out.write(json.dumps({"learner": args.name, "time": time.time(), **record}) + "\n")
      out.flush()

    kept = {} if restored is None else {"restored": "exact" if restored.exact else "moved on"}
    log(event="resume" if args.resume else "start", step=start, joined=joined_at,
        blocked=joined_seconds, **kept,
        val_loss=evaluate(evaluate_fn, params, valid))
    # The job ends at the run's step cfg.steps: with adaptive steps a slower learner's
    # step count jumps at each round it publishes, and it stops with the others.
    step = start
    while learner.step_count < cfg.steps:
      step += 1
      batch = batches.next()
      started = time.perf_counter()
      params, opt_state, loss = train_step(params, opt_state, batch)
      loss = float(loss)
      computed = time.perf_counter() - started
      slept = 0.0
      if step > start + 1:  # not the first step, which compiles
        slept = (computed * (slowdown - 1.0) if step_seconds is None
                 else max(0.0, step_seconds - computed))
      time.sleep(slept)
      own = {} if args.state_dir is None else {
          "state": opt_state, "position": {"step": step, "schedule_offset": offset}}
      stepping = time.perf_counter()
      params = learner.step(params, tokens=int(batch[:, 1:].size), loss=loss, **own)
      blocked = time.perf_counter() - stepping
      record = {"event": "step", "step": step, "loss": loss,
                "seconds": time.perf_counter() - started, "slept": slept, "blocked": blocked}
      if step % cfg.eval_every == 0 or learner.step_count >= cfg.steps:
        record["val_loss"] = evaluate(evaluate_fn, params, valid)
      log(**record)
    closing = time.perf_counter()
    params = learner.close(params)
    log(event="closed", step=cfg.steps, blocked=time.perf_counter() - closing,
        val_loss=evaluate(evaluate_fn, params, valid))


if __name__ == "__main__":
  main()
