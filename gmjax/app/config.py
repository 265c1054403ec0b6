"""The demo job's TOML configuration."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tomllib
from pathlib import Path
from typing import Any

from gmjax.app import data
from gmjax.app.model import ModelConfig, parameter_count
from gmjax.core.diloco import CUSTOM, DiLoCo


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything ``gmjax train`` needs; see ``configs/quickstart.toml``."""

  name: str
  out: str
  learners: int
  steps: int
  seed: int
  batch_size: int
  learning_rate: float
  weight_decay: float
  warmup_steps: int
  eval_every: int
  eval_batches: int
  poll_interval: float
  baseline: bool
  corpus_bytes: int | None
  model: ModelConfig
  diloco: DiLoCo
  learner_speeds: tuple[float, ...] | None = None
  step_ms: float | None = None
  source: str = ""

  def __post_init__(self):
    # ``~`` is the user's home, as the run's store reads it: the job's outputs, its lock
    # and its checks for a run already there must lie where the run is.
    object.__setattr__(self, "out", os.path.expanduser(self.out))

  def to_json(self) -> dict[str, Any]:
    record = dataclasses.asdict(self)
    record["model"] = dataclasses.asdict(self.model)
    record["diloco"] = self.diloco.to_json()
    if self.learner_speeds is None:
      del record["learner_speeds"]  # as configs without it were recorded
    else:
      record["learner_speeds"] = list(self.learner_speeds)
    if self.step_ms is None:
      del record["step_ms"]  # as configs without it were recorded
    return record

  @classmethod
  def from_json(cls, record: dict[str, Any]) -> "TrainConfig":
    """The config ``to_json`` recorded (already checked: a job's ``config.json``)."""
    record = dict(record)
    record["model"] = ModelConfig(**record["model"])
    record["diloco"] = DiLoCo.from_json(record["diloco"])
    if record.get("learner_speeds") is not None:
      record["learner_speeds"] = tuple(record["learner_speeds"])
    return cls(**record)

  def slowdown(self, index: int) -> float:
    """How many times longer learner ``index``'s steps take than the fastest learner's:
    ``max(learner_speeds) / learner_speeds[index]`` (1 without ``learner_speeds``)."""
    if self.learner_speeds is None:
      return 1.0
    return max(self.learner_speeds) / self.learner_speeds[index]

  def step_seconds(self, index: int) -> float | None:
    """The seconds learner ``index``'s inner step takes, compute included (it sleeps the
    rest): ``step_ms`` times its ``slowdown``; None without ``step_ms`` (then a slower
    learner sleeps ``slowdown − 1`` times its compute)."""
    if self.step_ms is None:
      return None
    return self.step_ms / 1000 * self.slowdown(index)


MAX_LEARNERS = 64
"""The most learner processes ``gmjax train`` starts on one machine."""

_RUN_KEYS = {
    "name": str, "out": str, "learners": int, "steps": int, "seed": int,
    "batch_size": int, "learning_rate": float, "weight_decay": float,
    "warmup_steps": int, "eval_every": int, "eval_batches": int,
    "poll_interval": float, "baseline": bool, "corpus_bytes": int, "learner_speeds": list,
    "step_ms": float,
}
_DEFAULTS = {
    "seed": 0, "weight_decay": 0.1, "warmup_steps": 0, "eval_every": 50,
    "eval_batches": 4, "poll_interval": 0.05, "baseline": True, "corpus_bytes": None,
    "learner_speeds": None, "step_ms": None,
}


# A value of the right type for each ``[train]`` key, for the messages (quickstart's).
_EXAMPLES = {
    "name": "quickstart", "out": "runs/quickstart", "learners": 2, "steps": 240, "seed": 0,
    "batch_size": 16, "learning_rate": 0.003, "weight_decay": 0.1, "warmup_steps": 20,
    "eval_every": 40, "eval_batches": 4, "poll_interval": 0.02, "baseline": True,
    "corpus_bytes": 2000000, "learner_speeds": [1, 1, 0.5, 0.25], "step_ms": 100.0,
}
_KINDS = {int: "a whole number", float: "a number", bool: "true or false",
          str: "a string", list: "a list"}


def _toml(value: Any) -> str:
  """``value`` as a TOML file spells it, for messages: ``true``, ``"64"``, ``[1, 0.5]``."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, str):
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(_toml(v) for v in value) + "]"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
  return repr(value)


_TABLES = {
    "train": set(_RUN_KEYS),
    "model": {f.name for f in dataclasses.fields(ModelConfig)},
    "diloco": {f.name for f in dataclasses.fields(DiLoCo)},
}
# DiLoCo fields that take None (written ``false`` in TOML, which has no null); none of
# them takes a bool.
_NULLABLE = {f.name for f in dataclasses.fields(DiLoCo)
             if (str(f.type).endswith("| None") or str(f.type) == "Precision")
             and "bool" not in str(f.type)}
_AT_LEAST_ONE = {
    "learners": "the learner processes to start",
    "steps": "inner steps per learner",
    "batch_size": "sequences in each learner's batch",
    "eval_every": "steps between two evaluations",
    "eval_batches": "batches per evaluation",
    "corpus_bytes": "bytes of the corpus to read; leave it out to read all of it",
}
MAX_STEP_MS = 3_600_000  # an hour: a learner sleeps its step time out
MAX_SPEED_RATIO, MAX_POLL_SECONDS = 1000, 60  # slowest step time over fastest; seconds
_FLOAT_BOUNDS = {"learning_rate": "> 0", "weight_decay": ">= 0", "poll_interval": "> 0"}
MAX_PARAMETERS = 2**30
"""The largest demo model a config may ask for."""
ATTENTION_BYTES = 4 * 2**30
"""The most the demo model's attention scores may take in one training process."""
MAX_HELD_OUT_TOKENS = 2**26  # held-out windows: kept in memory, read at each evaluation


def _unknown(table: str, key: str, known) -> str:
  """The error for an unknown key of ``[table]``, naming the closest known key, or the
  table where the key belongs."""
  home = next((t for t, keys in _TABLES.items() if t != table and key in keys), None)
  if home is not None:
    return f"config [{table}]: unknown key {key!r}; it belongs in [{home}]: move it there"
  close = difflib.get_close_matches(key, sorted(known), n=1)
  hint = f"did you mean {close[0]!r}? " if close else ""
  return f"config [{table}]: unknown key {key!r}; {hint}known: {sorted(known)}"


def _check_train(train: dict[str, Any]) -> None:
  """Raises ValueError naming the first ``[train]`` value the job cannot run with."""
  for key, meaning in _AT_LEAST_ONE.items():
    value = train[key]
    if value is not None and value < 1:
      raise ValueError(f"config [train] {key} = {value!r} must be >= 1 ({meaning}); set it"
                       " to a positive int")
  for key in ("seed", "warmup_steps"):
    if train[key] < 0:
      raise ValueError(f"config [train] {key} = {train[key]!r} must be >= 0; set it to 0 or"
                       " more")
  if train["learners"] > MAX_LEARNERS:
    raise ValueError(
        f"config [train] learners = {train['learners']} must be at most {MAX_LEARNERS}:"
        " gmjax train starts each learner as a JAX process on this machine; for more, run"
        " learners on their own machines with gmjax.mail")
  # Learner i is seeded with seed + 1 + i, which JAX takes as a 32-bit integer.
  if train["seed"] + train["learners"] >= 2**31:
    raise ValueError(f"config [train] seed = {train['seed']} must be below 2**31 - learners"
                     f" = {2**31 - train['learners']} (each learner's seed is seed + 1 +"
                     " its index); e.g. seed = 0")
  for key, bound in _FLOAT_BOUNDS.items():
    value = train[key]
    if not math.isfinite(value) or (value <= 0 if bound == "> 0" else value < 0):
      raise ValueError(f"config [train] {key} = {value!r} must be a finite number {bound};"
                       f" e.g. {key} = {_DEFAULTS.get(key, 1e-3)!r}")
  for key in ("name", "out"):
    if not train[key].strip():
      raise ValueError(f"config [train] {key} = {train[key]!r} must not be empty; leave it"
                       " out for the config file's name")
  if "://" in train["out"]:
    raise ValueError(f"config [train] out = {train['out']!r} must be a local folder (the job"
                     " writes its metrics, plots and run there); e.g. out = 'runs/mine'")
  if train["poll_interval"] > MAX_POLL_SECONDS:
    raise ValueError(f"config [train] poll_interval = {train['poll_interval']!r} must be at"
                     f" most {MAX_POLL_SECONDS} (seconds between a learner's looks at the"
                     " run's storage); e.g. poll_interval = 0.05")
  step_ms = train["step_ms"]
  if step_ms is not None and step_ms > MAX_STEP_MS:
    raise ValueError(f"config [train] step_ms = {step_ms!r} must be at most {MAX_STEP_MS}"
                     " (an hour a step; a learner sleeps that long); e.g. step_ms = 100")
  if step_ms is not None and not (math.isfinite(step_ms) and step_ms > 0):
    raise ValueError(f"config [train] step_ms = {step_ms!r} must be a finite number > 0: the"
                     " milliseconds the fastest learner's inner step takes, compute included"
                     " (e.g. step_ms = 100), or left out to step at the speed of compute")
  speeds = train["learner_speeds"]
  if speeds is not None:
    if len(speeds) != train["learners"]:
      raise ValueError(f"config [train] learner_speeds = {_toml(speeds)} has {len(speeds)}"
                       f" values for learners = {train['learners']}; give one speed per"
                       " learner, e.g. learner_speeds = [1, 1, 0.5, 0.25] for 4 learners")
    for speed in speeds:
      if (isinstance(speed, bool) or not isinstance(speed, (int, float))
          or not math.isfinite(speed) or speed <= 0):
        raise ValueError(f"config [train] learner_speeds = {_toml(speeds)}: {_toml(speed)} is not a"
                         " finite number > 0; a learner at speed s takes 1/s of the"
                         " fastest's step time (e.g. 0.5 is twice as slow)")
    if max(speeds) > MAX_SPEED_RATIO * min(speeds):
      raise ValueError(f"config [train] learner_speeds = {_toml(speeds)}: the slowest"
                       f" learner would take {max(speeds) / min(speeds):.3g} times the"
                       f" fastest's step time, over {MAX_SPEED_RATIO}; keep the speeds"
                       " within that ratio, e.g. learner_speeds = [1, 1, 0.5, 0.25]")
    train["learner_speeds"] = tuple(float(s) for s in speeds)


def _model(raw: dict[str, Any]) -> ModelConfig:
  """The ``[model]`` table as a ``ModelConfig``; raises ValueError naming a bad value."""
  for key, value in raw.items():
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      example = getattr(ModelConfig(), key, 1)
      raise ValueError(f"config [model] {key} = {_toml(value)} must be a positive whole"
                       f" number; e.g. {key} = {example}")
  model = ModelConfig(**raw)
  count = parameter_count(model)
  if count > MAX_PARAMETERS:
    raise ValueError(f"config [model] makes a model of {count:,} parameters, over the"
                     f" demo job's {MAX_PARAMETERS:,} (4 GiB in F32, one copy a learner and"
                     " more for its optimizer); lower vocab, d_model, mlp or layers")
  if model.vocab < data.VOCAB:
    raise ValueError(f"config [model] vocab = {model.vocab} is too small for the demo"
                     f" corpus's {data.VOCAB} byte values; set vocab = {data.VOCAB}")
  if model.d_model % model.heads:
    divisors = [h for h in range(1, model.d_model + 1) if model.d_model % h == 0]
    closest = min(divisors, key=lambda h: abs(h - model.heads))
    raise ValueError(f"config [model] heads = {model.heads} does not divide d_model ="
                     f" {model.d_model}; set heads to a divisor of d_model, e.g. {closest}")
  return model


def _check_context(model: ModelConfig, train: dict[str, Any]) -> None:
  """Raises ValueError if ``seq_len``, or the held-out windows, are beyond what a job holds.

  The model attends densely: each layer keeps ``batch·heads·seq_len²`` F32 scores and
  as many probabilities for the backward pass, and the baseline trains on the learners'
  batches at once.
  """
  batch = train["batch_size"] * (train["learners"] if train["baseline"] else 1)
  per_token_pair = 2 * 4 * model.layers * batch * model.heads
  needed = per_token_pair * model.seq_len**2
  if needed > ATTENTION_BYTES:
    longest = math.isqrt(ATTENTION_BYTES // per_token_pair)
    why = " (the baseline's, learners·batch_size)" if train["baseline"] else ""
    if longest < 2:  # no seq_len would do: the batch is what is too large
      raise ValueError(
          f"config [train] batch_size = {train['batch_size']} is too large for the demo"
          f" model: its dense attention would keep {needed / 2**30:,.1f} GiB of scores at"
          f" batch {batch}{why}, over the {ATTENTION_BYTES // 2**30} GiB allowed, at any"
          " seq_len; lower batch_size (or learners, or set baseline = false)")
    raise ValueError(
        f"config [model] seq_len = {model.seq_len} is too long for the demo model: its"
        f" dense attention would keep {needed / 2**30:,.1f} GiB of scores at batch"
        f" {batch}{why}, over the {ATTENTION_BYTES // 2**30} GiB allowed; set seq_len <="
        f" {longest}, or lower batch_size, heads or layers")
  window = train["batch_size"] * (model.seq_len + 1)
  if train["eval_batches"] * window > MAX_HELD_OUT_TOKENS:
    raise ValueError(
        f"config [train] eval_batches = {train['eval_batches']} is too many: the held-out"
        f" windows would hold {train['eval_batches'] * window:,} tokens, over the"
        f" {MAX_HELD_OUT_TOKENS:,} a job keeps in memory; set eval_batches <="
        f" {max(MAX_HELD_OUT_TOKENS // window, 1)} (or lower batch_size or seq_len)")


def check_data(cfg: TrainConfig) -> None:
  """Checks that the demo corpus is there and long enough for every learner's shard and
  the validation windows at ``seq_len``.

  Raises:
    FileNotFoundError: the standard library's sources are missing.
    ValueError: a shard or the validation part is shorter than ``seq_len + 2`` tokens.
  """
  train_tokens, valid_tokens = data.load_corpus(cfg.corpus_bytes)
  need = cfg.model.seq_len + 2
  read = ("all of the standard library's sources" if cfg.corpus_bytes is None
          else f"[train] corpus_bytes = {cfg.corpus_bytes}")
  fix = ("raise corpus_bytes (or leave it out to read the whole corpus), or lower"
         if cfg.corpus_bytes is not None else "lower")
  shard = train_tokens.size // cfg.learners
  if shard < need:
    raise ValueError(
        f"config [model] seq_len = {cfg.model.seq_len}: with {read}, each of the"
        f" {cfg.learners} learners' shards holds {shard} training tokens, and a window"
        f" needs seq_len + 2 = {need}; {fix} seq_len or learners")
  if valid_tokens.size < need:
    raise ValueError(
        f"config [model] seq_len = {cfg.model.seq_len}: with {read}, the validation part"
        f" holds {valid_tokens.size} tokens, and a window needs seq_len + 2 = {need};"
        f" {fix} seq_len")


def load_record(path: str | Path) -> TrainConfig:
  """The config a ``gmjax train`` job checked and recorded at ``path`` (its
  ``config.json``), which its learner processes train with."""
  return TrainConfig.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def load(path: str | Path) -> TrainConfig:
  """Reads and checks a TOML config with ``[train]``, ``[model]`` and ``[diloco]`` tables.

  Every value is checked here, before any process starts or any file is written: types,
  ranges, ``[model]`` sizes (and ``seq_len`` against what the model's attention can
  hold), the ``[diloco]`` configuration. ``check_data`` checks the corpus.

  Raises:
    FileNotFoundError: no such file.
    ValueError: an unknown key, a missing key, or a value of the wrong type or out of
      range: one line naming the key, the value and the fix.
  """
  path = Path(path)
  if path.is_dir():
    raise ValueError(f"config {str(path)!r} is a folder; pass a TOML file, e.g."
                     " configs/quickstart.toml")
  if not path.is_file():
    raise FileNotFoundError(f"config {str(path)!r} not found; see configs/quickstart.toml")
  content = path.read_bytes()
  try:
    raw = tomllib.loads(content.decode("utf-8"))
  except UnicodeDecodeError as error:
    raise ValueError(f"config {str(path)!r} is not UTF-8 text ({error}); save it as UTF-8"
                     ) from None
  except tomllib.TOMLDecodeError as error:
    bom = " (it starts with a byte order mark: save it as UTF-8 without one)" if (
        content.startswith(b"\xef\xbb\xbf")) else ""
    raise ValueError(f"config {str(path)!r} is not valid TOML: {error}{bom}") from None
  unknown = sorted(set(raw) - {"train", "model", "diloco"})
  if unknown:
    raise ValueError(f"config {str(path)!r}: unknown tables {unknown}; use [train], [model], [diloco]")
  for table in ("train", "model", "diloco"):
    if not isinstance(raw.get(table, {}), dict):
      raise ValueError(f"config {str(path)!r}: {table} = {_toml(raw[table])} must be a table;"
                       f" write it as [{table}] followed by its keys, one per line")
  train = dict(_DEFAULTS, name=path.stem, out=f"runs/{path.stem}")
  for key, value in raw.get("train", {}).items():
    if key not in _RUN_KEYS:
      raise ValueError(_unknown("train", key, _RUN_KEYS))
    kind = _RUN_KEYS[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
      raise ValueError(
          f"config [train] {key} = {_toml(value)} must be {_KINDS[kind]}; e.g."
          f" {key} = {_toml(_EXAMPLES[key])}")
    train[key] = value
  missing = [k for k in ("learners", "steps", "batch_size", "learning_rate") if k not in train]
  if missing:
    raise ValueError(
        f"config [train] lacks {', '.join(missing)}; set {'it' if len(missing) == 1 else 'them'},"
        f" e.g. {'; '.join(f'{k} = {_toml(_EXAMPLES[k])}' for k in missing)}")
  _check_train(train)
  model_fields = _TABLES["model"]
  bad = sorted(set(raw.get("model", {})) - model_fields)
  if bad:
    raise ValueError(_unknown("model", bad[0], model_fields))
  model = _model(raw.get("model", {}))
  _check_context(model, train)
  diloco_raw = dict(raw.get("diloco", {}))
  diloco_fields = _TABLES["diloco"]
  bad = sorted(set(diloco_raw) - diloco_fields)
  if bad:
    raise ValueError(_unknown("diloco", bad[0], diloco_fields))
  if "sync_every" not in diloco_raw:
    raise ValueError("config [diloco] needs sync_every (inner steps between a fragment's"
                     " syncs); set it, e.g. sync_every = 20")
  if diloco_raw.get("outer") == CUSTOM:
    raise ValueError(
        f"config [diloco] outer = {CUSTOM!r} means an outer optimizer given in code, but"
        " gmjax train's learners build it from the config; name an optax optimizer, e.g."
        " outer = 'sgd'")
  for name in _NULLABLE & set(diloco_raw):  # TOML has no null: false stands for None
    if diloco_raw[name] is False:
      diloco_raw[name] = None
  try:
    diloco = DiLoCo.from_json(diloco_raw)
  except (TypeError, ValueError) as error:
    raise ValueError(f"config [diloco]: {error}") from None
  return TrainConfig(**train, model=model, diloco=diloco, source=str(path))
