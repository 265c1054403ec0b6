"""Health statistics of a round: how much the learners' deltas agree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def gram(deltas: Sequence[Any]) -> jax.Array:
  """The M×M matrix of dot products of whole-tree deltas, in F32 (traceable)."""
  # Pairwise fused multiply-reduce passes: on CPU, XLA runs these several times faster
  # than a stacked (M, n) @ (n, M) product, and they need no stacked copy.
  leaves = [[jnp.ravel(p).astype(jnp.float32) for p in jax.tree.leaves(d)] for d in deltas]
  count = len(deltas)
  dots = {}
  for i in range(count):
    for j in range(i, count):
      dots[i, j] = sum(jnp.sum(a * b) for a, b in zip(leaves[i], leaves[j]))
  return jnp.stack(
      [jnp.stack([dots[min(i, j), max(i, j)] for j in range(count)]) for i in range(count)]
  )


def cosine(deltas: Sequence[Any]) -> float | None:
  """Mean pairwise cosine similarity of whole-tree deltas.

  Each delta's leaves are concatenated; the mean is over pairs ``i < j`` of
  ``cos(Δ_i, Δ_j)``, skipping pairs with a zero-norm delta.

  Args:
    deltas: pytrees of one structure (decoded deltas of one fragment).

  Returns:
    The mean cosine, or None with fewer than two deltas (or no pair of nonzero ones).
  """
  deltas = list(deltas)
  if len(deltas) < 2:
    return None
  return cosine_from_gram(_gram_jit(deltas))


_gram_jit = jax.jit(gram)


def cosine_from_gram(matrix: Any) -> float | None:
  """The mean pairwise cosine of the deltas whose dot products ``matrix`` holds."""
  gram = np.asarray(jax.device_get(matrix), np.float64)
  if gram.shape[0] < 2:
    return None
  norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
  values = [
      gram[i, j] / (norms[i] * norms[j])
      for i in range(gram.shape[0])
      for j in range(i + 1, gram.shape[0])
      if norms[i] > 0 and norms[j] > 0
  ]
  if not values:
    return None
  return float(np.clip(np.mean(values), -1.0, 1.0))
