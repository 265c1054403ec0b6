"""Whether an outer optimizer may run on shards: it must act element by element.

A sharded outer step runs the optimizer on each learner's shard of the master alone, so
it must give every element what it would give it on the whole tree: no norms, trust
ratios or factored moments across elements. ``check`` accepts a transformation when

* ``config`` built it (``outer=None``) from an alias gmjax knows to be elementwise
  (``ELEMENTWISE``), or
* it passes a probe: three steps on a small vector whole and on its two halves as
  separate trees give the same values, and so do three steps on a matrix and on its
  values laid end to end (buckets hold a leaf's values so). The probe cannot prove a
  transformation elementwise, but it catches the usual couplings: global-norm
  clipping, LAMB/LARS trust ratios and normalized gradients change the result of a
  half; Muon's orthogonalized matrices, SM3's accumulators by row and column and
  Adafactor's factored moments change the result of a matrix laid flat.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import optax

# Optax aliases whose update of each element reads only that element's gradient, value
# and state (learning-rate schedules read the step count, which is shared alike).
ELEMENTWISE = frozenset({
    "adabelief", "adadelta", "adagrad", "adam", "adamax", "adamaxw", "adamw", "adan",
    "amsgrad", "lion", "nadam", "nadamw", "radam", "rmsprop", "rprop", "sgd",
    "sign_sgd", "signum", "yogi",
})

_PROBE_SIZE = 64
_PROBE_MATRIX = (128, 128)  # Adafactor factors dimensions of 128 and more
_PROBE_STEPS = 3


def _run(transform, values, gradients):
  state = transform.init(values)
  for gradient in gradients:
    updates, state = transform.update(gradient, state, values)
    values = jax.tree.map(lambda v, u: v + u, values, updates)
  return values


def probe(transform: optax.GradientTransformation) -> bool:
  """Whether ``transform`` gives a vector's halves what it gives them in the whole."""
  rng = np.random.default_rng(0)
  start = jnp.asarray(rng.standard_normal(_PROBE_SIZE), jnp.float32)
  # Halves of very different scales: a norm taken across elements sees the difference.
  scales = np.where(np.arange(_PROBE_SIZE) < _PROBE_SIZE // 2, 1.0, 50.0)
  gradients = [jnp.asarray(scales * rng.standard_normal(_PROBE_SIZE), jnp.float32)
               for _ in range(_PROBE_STEPS)]
  half = _PROBE_SIZE // 2
  whole = _run(transform, (start,), [(g,) for g in gradients])[0]
  parts = [slice(0, half), slice(half, None)]
  together = jnp.concatenate([
      _run(transform, (start[part],), [(g[part],) for g in gradients])[0] for part in parts
  ])
  # Rows of different scales: a moment kept by row or column, or a matrix function,
  # sees them; an elementwise transformation does not see the shape at all.
  rows = np.linspace(1.0, 50.0, _PROBE_MATRIX[0])[:, None]
  matrix = jnp.asarray(rng.standard_normal(_PROBE_MATRIX), jnp.float32)
  steps = [jnp.asarray(rows * rng.standard_normal(_PROBE_MATRIX), jnp.float32)
           for _ in range(_PROBE_STEPS)]
  shaped = _run(transform, (matrix,), [(g,) for g in steps])[0]
  flat = _run(transform, (matrix.ravel(),), [(g.ravel(),) for g in steps])[0]
  return bool(jnp.allclose(whole, together, rtol=1e-5, atol=1e-6)
              and jnp.allclose(shaped.ravel(), flat, rtol=1e-5, atol=1e-6))


def acts_elementwise(transform: optax.GradientTransformation, name: str | None) -> bool:
  """Whether ``transform`` (built from alias ``name``, or user-given) is known to be, or
  probes as, elementwise (``check`` without the error)."""
  if name is not None and name in ELEMENTWISE:
    return True
  try:
    return probe(transform)
  except Exception:  # a transformation that needs other inputs: not known elementwise
    return False


def check(transform: optax.GradientTransformation, name: str | None) -> None:
  """Raises unless ``transform`` (built from alias ``name``, or user-given) is elementwise.

  Raises:
    ValueError: it is not, so it cannot run on shards; names ``shard_outer=False``.
  """
  if name is not None and name in ELEMENTWISE:
    return
  what = f"optax.{name}" if name is not None else repr(transform)
  try:
    ok = probe(transform)
  except Exception as error:  # a transformation that needs other inputs: not sharded
    raise ValueError(
        f"gmjax.diloco: could not check that the outer optimizer {what} is elementwise"
        f" ({type(error).__name__}: {error}); a sharded outer step needs an elementwise"
        " optimizer. Pass shard_outer=False to keep the outer state replicated."
    ) from error
  if not ok:
    raise ValueError(
        f"gmjax.diloco: the outer optimizer {what} is not elementwise (run on two halves"
        " of a vector it gives other values than on the whole), so it cannot run on each"
        " learner's shard of the master. Pass shard_outer=False to keep the outer state"
        " replicated on every learner."
    )
