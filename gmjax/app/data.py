"""The demo corpus: the Python standard library's own sources, as bytes.

Every machine that runs gmjax has this corpus, so learners on different machines can
train on disjoint shards of the same text without shipping a data set.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

VOCAB = 256  # byte-level tokens


def stdlib_files() -> list[Path]:
  """The standard library's top-level ``.py`` files, sorted by name."""
  root = Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.glob("*.py") if p.is_file())
  if not files:
    raise FileNotFoundError(f"no Python sources under {root}; the demo corpus needs them")
  return files


def load_corpus(max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """The corpus as uint8 tokens: ``(train, validation)``; every 20th file is validation."""
  train, valid = [], []
  total = 0
  for index, path in enumerate(stdlib_files()):
    data = np.frombuffer(path.read_bytes(), np.uint8)
    (valid if index % 20 == 19 else train).append(data)
    total += data.size
    if max_bytes is not None and total >= max_bytes:
      break
  if not valid:
    valid.append(train.pop())
  empty = np.zeros(0, np.uint8)
  return np.concatenate([empty, *train]), np.concatenate([empty, *valid])


class Batches:
  """Random windows from one learner's shard of the corpus.

  The training tokens are cut into ``shards`` contiguous shards; learner ``shard`` samples
  only from its own, with its own seed, as DiLoCo's learners train on disjoint data.
  """

  def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int,
               shard: int = 0, shards: int = 1, seed: int = 0):
    if not 0 <= shard < shards:
      raise ValueError(f"shard must be in [0, shards={shards}), got {shard}")
    size = tokens.size // shards
    self.tokens = tokens[shard * size : (shard + 1) * size]
    if self.tokens.size <= seq_len + 1:
      raise ValueError(
          f"a shard of {self.tokens.size} tokens is too small for seq_len={seq_len};"
          " use fewer learners or a shorter seq_len"
      )
    self.seq_len, self.batch_size = seq_len, batch_size
    self.rng = np.random.default_rng([seed, shard])

  def skip(self, count: int) -> None:
    """Draws ``count`` batches' starts without reading them: ``next`` then returns what
    its ``count + 1``-th call would have."""
    for _ in range(count):
      self.rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.batch_size)

  def next(self, batch_size: int | None = None) -> np.ndarray:
    """A ``(batch, seq_len + 1)`` int32 array: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    batch = batch_size or self.batch_size
    starts = self.rng.integers(0, self.tokens.size - self.seq_len - 1, size=batch)
    index = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
    return self.tokens[index].astype(np.int32)


def held_out(tokens: np.ndarray, *, seq_len: int, batch_size: int, count: int, seed: int
             ) -> list[np.ndarray]:
  """The job's held-out set: ``count`` batches of random windows of the validation
  ``tokens``, drawn once. Every evaluation, of every learner and of the baseline, at
  every step and after a resume, reads these same windows, so their losses compare (new
  windows at each evaluation would move a loss by more than a run's gap to the
  baseline)."""
  windows = Batches(tokens, seq_len=seq_len, batch_size=batch_size, seed=seed)
  return [windows.next() for _ in range(count)]


def corpus_root() -> str:
  return os.path.dirname(str(stdlib_files()[0]))
