"""The demo job's TOML configuration."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from pathlib import Path
from typing import Any

from gmjax.app.model import ModelConfig
from gmjax.core.diloco import DiLoCo


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
  source: str = ""

  def to_json(self) -> dict[str, Any]:
    record = dataclasses.asdict(self)
    record["model"] = dataclasses.asdict(self.model)
    record["diloco"] = self.diloco.to_json()
    return record


_RUN_KEYS = {
    "name": str, "out": str, "learners": int, "steps": int, "seed": int,
    "batch_size": int, "learning_rate": float, "weight_decay": float,
    "warmup_steps": int, "eval_every": int, "eval_batches": int,
    "poll_interval": float, "baseline": bool, "corpus_bytes": int,
}
_DEFAULTS = {
    "seed": 0, "weight_decay": 0.1, "warmup_steps": 0, "eval_every": 50,
    "eval_batches": 4, "poll_interval": 0.05, "baseline": True, "corpus_bytes": None,
}


def _unknown(table: str, key: str, known) -> str:
  """The error for an unknown key of ``[table]``, naming the closest known key."""
  close = difflib.get_close_matches(key, sorted(known), n=1)
  hint = f"did you mean {close[0]!r}? " if close else ""
  return f"config [{table}]: unknown key {key!r}; {hint}known: {sorted(known)}"


def load(path: str | Path) -> TrainConfig:
  """Reads and checks a TOML config with ``[train]``, ``[model]`` and ``[diloco]`` tables.

  Raises:
    FileNotFoundError: no such file.
    ValueError: an unknown key, a missing key or a value of the wrong type (named).
  """
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"config {str(path)!r} not found; see configs/quickstart.toml")
  with path.open("rb") as f:
    try:
      raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as error:
      raise ValueError(f"config {str(path)!r} is not valid TOML: {error}") from None
  unknown = sorted(set(raw) - {"train", "model", "diloco"})
  if unknown:
    raise ValueError(f"config {str(path)!r}: unknown tables {unknown}; use [train], [model], [diloco]")
  train = dict(_DEFAULTS, name=path.stem, out=f"runs/{path.stem}")
  for key, value in raw.get("train", {}).items():
    if key not in _RUN_KEYS:
      raise ValueError(_unknown("train", key, _RUN_KEYS))
    kind = _RUN_KEYS[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
      raise ValueError(f"config [train] {key} = {value!r} must be a {kind.__name__}")
    train[key] = value
  missing = sorted(k for k in ("learners", "steps", "batch_size", "learning_rate") if k not in train)
  if missing:
    raise ValueError(f"config [train] lacks {missing}")
  for key in ("learners", "steps", "batch_size"):
    if train[key] < 1:
      raise ValueError(f"config [train] {key} = {train[key]!r} must be >= 1")
  model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
  bad = sorted(set(raw.get("model", {})) - model_fields)
  if bad:
    raise ValueError(_unknown("model", bad[0], model_fields))
  model = ModelConfig(**raw.get("model", {}))
  diloco_raw = dict(raw.get("diloco", {}))
  diloco_fields = {f.name for f in dataclasses.fields(DiLoCo)}
  bad = sorted(set(diloco_raw) - diloco_fields)
  if bad:
    raise ValueError(_unknown("diloco", bad[0], diloco_fields))
  if "sync_every" not in diloco_raw:
    raise ValueError("config [diloco] needs sync_every")
  try:
    diloco = DiLoCo.from_json(diloco_raw)
  except TypeError as error:
    raise ValueError(f"config [diloco]: {error}") from None
  return TrainConfig(**train, model=model, diloco=diloco, source=str(path))
