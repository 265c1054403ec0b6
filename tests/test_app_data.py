"""The demo corpus: stdlib sources, disjoint shards, deterministic batches."""

import numpy as np
import pytest

from gmjax.app import data


def test_corpus_is_the_stdlib_and_splits():
  train, valid = data.load_corpus(500_000)
  assert train.dtype == np.uint8 and train.size > 100_000 and valid.size > 0
  assert b"def " in train[:200_000].tobytes()


def test_shards_are_disjoint_and_deterministic():
  tokens = np.arange(10_000, dtype=np.int64) % 251
  a = data.Batches(tokens, seq_len=8, batch_size=4, shard=0, shards=2, seed=1)
  b = data.Batches(tokens, seq_len=8, batch_size=4, shard=1, shards=2, seed=1)
  assert a.next().shape == (4, 9)
  np.testing.assert_array_equal(
      data.Batches(tokens, seq_len=8, batch_size=4, shard=0, shards=2, seed=1).next(),
      data.Batches(tokens, seq_len=8, batch_size=4, shard=0, shards=2, seed=1).next())
  assert a.tokens.size == b.tokens.size == 5000
  assert not np.shares_memory(a.tokens, b.tokens)


def test_bad_shard():
  with pytest.raises(ValueError, match="shard"):
    data.Batches(np.zeros(100, np.uint8), seq_len=8, batch_size=2, shard=2, shards=2)


def test_skip_resumes_the_batch_stream():
  tokens = np.arange(10_000, dtype=np.uint8)
  straight = data.Batches(tokens, seq_len=8, batch_size=3, shard=1, shards=2, seed=4)
  expected = [straight.next() for _ in range(6)][-1]
  resumed = data.Batches(tokens, seq_len=8, batch_size=3, shard=1, shards=2, seed=4)
  resumed.skip(5)
  np.testing.assert_array_equal(resumed.next(), expected)
