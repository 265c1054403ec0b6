"""The ``gmjax`` command: ``gmjax train CONFIG`` and ``gmjax status RUN``."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import sys
from collections.abc import Mapping
from typing import Any


def results_table(losses: dict, sent: dict) -> str:
  """Each learner's and the baseline's held-out loss and bytes sent, against the baseline."""
  base_loss, base_sent = losses.get("baseline"), sent.get("baseline")
  rows = ["| learner | held-out loss | / baseline | sent | / baseline's |",
          "| --- | --- | --- | --- | --- |"]
  for name, value in losses.items():
    loss = "-" if value is None else f"{value:.4f}"
    ratio = "-" if value is None or not base_loss else f"{value / base_loss:.3f}"
    mib = sent.get(name, 0) / 2**20
    share = ("-" if not base_sent or not sent.get(name)
             else "1" if name == "baseline" else f"1/{base_sent / sent[name]:,.0f}")
    rows.append(f"| {name} | {loss} | {ratio} | {mib:,.2f} MiB | {share} |")
  return "\n".join(rows)


# What ``gmjax train`` needs beyond the core library: ``pip install 'gmjax[app]'``.
APP_PACKAGES = ("flax", "matplotlib", "tqdm")


class MissingExtra(ImportError):
  """A package of the ``app`` extra that ``gmjax train`` needs is not installed."""


def _import_app():
  """The training job's modules, or MissingExtra naming the extra that installs them."""
  try:
    from gmjax.app import config as config_lib  # pylint: disable=g-import-not-at-top
    from gmjax.app.train import train  # pylint: disable=g-import-not-at-top
  except ImportError as error:
    missing = (error.name or "").split(".")[0]
    if missing not in APP_PACKAGES:
      raise
    raise MissingExtra(
        f"{missing} is not installed: the training job needs the app extra,"
        " pip install 'gmjax[app]'.", name=missing) from error
  return config_lib, train


def settings_line(cfg) -> str:
  """The settings a ``gmjax train`` run used, in one line under its results table."""
  d = cfg.diloco
  # The arguments the outer optimizer is built with: outer_options' where they set one.
  arguments = d.outer_arguments()
  shown = lambda v: f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else (
      json.dumps(v, sort_keys=True) if isinstance(v, Mapping) else str(v))
  outer = f"outer {d.outer}"
  if "learning_rate" in arguments:
    outer += f" η {shown(arguments.pop('learning_rate'))}"
  if d.outer == "sgd":
    momentum, nesterov = arguments.pop("momentum", None), arguments.pop("nesterov", False)
    outer += f" μ {shown(momentum)}{' Nesterov' if nesterov else ''}"
  if arguments:
    outer += f" {arguments}"
  parts = [f"{cfg.learners} learners x {cfg.steps} steps of batch {cfg.batch_size}"
           f" (lr {cfg.learning_rate:g})", f"sync_every {d.sync_every}",
           f"fragments {d.fragments}", f"deltas {d.delta_precision or 'F32'}",
           f"overlap {d.overlap_steps}", outer]
  if d.commit_precision:
    parts.append(f"commit {d.commit_precision}")
  if d.error_feedback is not None:
    parts.append(f"error feedback {d.error_feedback:g}")
  if d.delta_topk:
    parts.append(f"top-{d.delta_topk} of {d.delta_chunk}")
  if d.outer_delay:
    parts.append("eager" if d.eager else "delayed")
  if d.adaptive_steps:
    parts.append("adaptive steps")
  from gmjax.core import guards  # pylint: disable=g-import-not-at-top (loaded with cfg)
  if d.outlier_factor != guards.OUTLIER_FACTOR:
    parts.append("no outlier screening" if d.outlier_factor is None
                 else f"outliers past {d.outlier_factor:g}x")
  return "settings: " + ", ".join(parts)


def _train(args: argparse.Namespace) -> int:
  from gmjax.app import stops  # pylint: disable=g-import-not-at-top

  cfg = None
  # From here on a signal stops the job as Ctrl-C does (the modules load, the config is
  # read, then the job runs).
  try:
    with stops.stopped_by_signals():
      config_lib, train = _import_app()
      cfg = config_lib.load(args.config)
      if args.out is not None and (not args.out.strip() or "://" in args.out):
        raise ValueError(f"--out {args.out!r}: must be a local folder (the job writes its"
                         " metrics, plots and run there), e.g. --out runs/mine")
      if args.out:
        import dataclasses  # pylint: disable=g-import-not-at-top

        cfg = dataclasses.replace(cfg, out=args.out)
      summary = train(cfg, show_progress=not args.quiet, force=args.force,
                      resume=args.resume)
  except (KeyboardInterrupt, stops.LearnersFailed) as stop:
    stopped = isinstance(stop, KeyboardInterrupt)
    print(f"\ngmjax train: {'stopped (' + (str(stop) or 'Ctrl-C') + ')' if stopped else stop}",
          file=sys.stderr)
    from gmjax.app import outdir  # pylint: disable=g-import-not-at-top

    if cfg is not None and outdir.resumable(cfg, pathlib.Path(cfg.out)):
      print(f"gmjax train: the learners are stopped; continue the run with: gmjax train"
            f" {shlex.quote(args.config)} --out {shlex.quote(cfg.out)} --resume",
            file=sys.stderr)
    return 130 if stopped else 1
  losses = summary["final_val_loss"]
  print(f"\nrun: {summary['run']}  rounds committed: {summary['rounds']}"
        f"  mean cosine: {summary['mean_cosine'] if summary['mean_cosine'] is None else round(summary['mean_cosine'], 3)}")
  print(results_table(losses, summary["bytes_sent"]))
  print(settings_line(cfg))
  print(f"figures: {', '.join(summary['figures'])}\nmetrics: {summary['metrics']}")
  print(f"see the rounds with: gmjax status {shlex.quote(summary['run'])}")
  return 0


class _Unavailable(Exception):
  """The run's storage did not answer in time: one line for the user."""


def _status(args: argparse.Namespace) -> int:
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.mail.status import format_status  # pylint: disable=g-import-not-at-top

  key = args.key
  if key is not None and not key:
    raise ValueError("--key is empty; give the run's key, or drop --key for a run without"
                     " a key")
  if args.key_env is not None:
    key = os.environ.get(args.key_env)
    if not key:
      raise ValueError(
          f"--key-env {args.key_env}: the environment variable {args.key_env} is"
          f" {'not set' if key is None else 'empty'}; export the run's key in it, or"
          " drop --key-env for a run without a key")
  if not 0 < args.retry_seconds < float("inf"):
    raise ValueError(f"--retry-seconds {args.retry_seconds:g}: must be a positive number of"
                     " seconds, e.g. --retry-seconds 30")
  try:
    run = gmjax.mail.open(args.run, key=key, retry_seconds=args.retry_seconds)
  except gmjax.mail.AuthenticationError as error:
    flag = "--key" if args.key is not None else f"--key-env {args.key_env}"
    fixes = {"unexpected": f"was created without a key: drop {flag}",
             "missing": "is signed: give its key with --key KEY or --key-env VAR",
             "wrong": f"is signed with another key than {flag} gives"}
    if error.key not in fixes:
      raise
    raise PermissionError(f"run {args.run} {fixes[error.key]}") from error
  except gmjax.mail.RunNotFound as error:
    job_run = os.path.join(args.run, "run")
    if "://" not in args.run and os.path.isfile(os.path.join(job_run, "manifest.json")):
      raise FileNotFoundError(  # a gmjax train job's folder: its run is <out>/run
          f"no run at {args.run!r}, but {job_run} holds one (a gmjax train job keeps its"
          f" run there): gmjax status {shlex.quote(job_run)}") from error
    raise
  except gmjax.mail.StorageUnavailable as error:
    cause = error.__cause__ or error
    said = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    # The endpoint a status reads from, the command having no storage_options.
    endpoint = ("AWS_ENDPOINT_URL, for an S3-compatible service" if args.run.startswith(
        "s3://") else "STORAGE_EMULATOR_HOST")
    raise _Unavailable(
        f"the storage at {args.run} did not answer within {args.retry_seconds:g} s"
        f" ({said}); check the URL, the credentials and the"
        f" network (or {endpoint}), or wait longer with --retry-seconds"
    ) from error
  problems = gmjax.mail.verify(run, deep=args.verify)
  try:
    _print_status(run, problems, args)
  except BrokenPipeError:
    # The reader went away (``gmjax status --json | head``): the exit status still says
    # whether the run is damaged. Quiet the interpreter's final flush.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  if problems:
    print(f"gmjax status: run {args.run} is damaged: {len(problems)} problem(s)"
          f"{' (checked every file)' if args.verify else ''}", file=sys.stderr)
    return 1
  return 0


def _print_status(run, problems: list[str], args) -> None:
  """Prints the run's status (``--json``: as JSON) with ``problems``."""
  import gmjax  # pylint: disable=g-import-not-at-top
  from gmjax.mail.status import format_status  # pylint: disable=g-import-not-at-top

  if args.json:
    try:
      summary = {"status": run.status(), "rounds": [r.to_json() for r in run.rounds()]}
    except (gmjax.mail.RunNotFound, gmjax.mail.CorruptRecord) as error:
      if not problems:
        raise
      summary = {"status": None, "rounds": None, "error": str(error)}  # see the problems
    print(json.dumps(_strict({**summary, "problems": problems}), indent=2, default=str,
                     allow_nan=False))
  else:
    print(format_status(run, problems=problems))


def _strict(value: Any) -> Any:
  """``value`` with each NaN or infinity (a heartbeat's loss, a pace of 1/0 s) as None:
  standard JSON, which strict parsers (jq, JSON.parse) read; Python writes them bare."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _strict(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_strict(v) for v in value]
  return value


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="gmjax", description="Low-communication training with JAX.")
  commands = parser.add_subparsers(dest="command", required=True)
  train = commands.add_parser("train", help="run the demo job described by a TOML config")
  train.add_argument("config", help="a TOML file, e.g. configs/quickstart.toml")
  train.add_argument("--out", help="output folder (default: the config's [train] out)")
  train.add_argument("--quiet", action="store_true", help="no progress bars")
  train.add_argument("--force", action="store_true",
                     help="delete a run, or an earlier job's outputs, already in the output"
                     " folder and train anew")
  train.add_argument("--resume", action="store_true",
                     help="continue the run in the output folder, started with this config,"
                     " until its steps are done")
  train.set_defaults(func=_train)
  status = commands.add_parser("status", help="print a run's rounds and learners")
  status.add_argument("run", help="the run's URL or directory")
  status.add_argument("--json", action="store_true", help="print JSON instead of a table")
  status.add_argument("--retry-seconds", type=float, default=30.0, metavar="S",
                      help="how long to retry a storage that does not answer (30 s)")
  status.add_argument("--verify", action="store_true",
                      help="re-read every commit, state and update and check every sha256;"
                      " exit 1 on any problem")
  keys = status.add_mutually_exclusive_group()
  keys.add_argument("--key", help="the run's key (checks signatures)")
  keys.add_argument("--key-env", metavar="VAR",
                    help="read the run's key from this environment variable instead")
  status.set_defaults(func=_status)
  args = parser.parse_args(argv)
  try:
    return args.func(args)
  except (FileNotFoundError, FileExistsError, ValueError, PermissionError,
          MissingExtra, _Unavailable) as error:
    print(f"gmjax {args.command}: {error}", file=sys.stderr)
    return 2
  except ImportError as error:
    from gmjax.mail.errors import StorageNotInstalled  # pylint: disable=g-import-not-at-top
    if not isinstance(error, StorageNotInstalled):
      raise
    print(f"gmjax {args.command}: {error}", file=sys.stderr)
    return 2
  except BrokenPipeError:
    # The reader went away (``gmjax status --json | head``): what it read is all it
    # wanted. Point stdout at /dev/null so that the interpreter's final flush is quiet.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
  sys.exit(main())
