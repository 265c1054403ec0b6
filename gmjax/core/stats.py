"""Health statistics of a round: how much the learners' deltas agree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gmjax.core import round as round_ops


def gram(deltas: Sequence[Any]) -> jax.Array:
  """The M×M matrix of dot products of whole-tree deltas, in F32 (traceable).

  Each leaf's deltas are stacked and contracted at once (``gmjax.core.round.gram``).
  """
  stacked = [jnp.stack([jnp.ravel(p) for p in leaves])
             for leaves in zip(*(jax.tree.leaves(d) for d in deltas))]
  return round_ops.gram(stacked, 0)


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
