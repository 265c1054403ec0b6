"""Error feedback: what quantization drops from one delta travels with the next ones.

A learner keeps an F32 residual ``e`` per fragment (zeros at first), and instead of its
delta ``Δ`` publishes ``q = encode(β·e + Δ)``, keeping ``e ← β·e + Δ − decode(q)``: the
part of ``β·e + Δ`` that the wire did not carry. With ``β = 1`` the decoded deltas sum to
the true ones up to the last residual, ``Σ_t decode(q_t) = Σ_t Δ_t − e_T``.

The residual is computed from the very bytes that travel, so it is what every other
learner (or the mail closer) decodes. A value ``β·e + Δ`` that is not finite cannot be
sent (the mail runtime refuses it; in-mesh screening rejects it) and its residual
restarts at zero.

References:
  Seide et al., *1-bit stochastic gradient descent and its application to data-parallel
  distributed training of speech DNNs*, Interspeech 2014.
  Karimireddy et al., *Error Feedback Fixes SignSGD and other Gradient Compression
  Schemes*, arXiv 1901.09847.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gmjax.core.records import QUANTIZED
from gmjax.core.schema import Schema
from gmjax.core.wire import Wire

_LOSSY = (f"a quantized one, {', '.join(repr(p) for p in QUANTIZED)}, or 16-bit"
          " 'BF16'/'F16'")


def check(beta: Any, wire: Wire) -> float:
  """``beta`` as a float if it is a valid ``error_feedback`` for deltas on ``wire``.

  Raises:
    ValueError: ``beta`` is not a number in ``(0, 1]``, or the deltas are dense F32
      (they then travel exactly, there is no error to feed back; a top-k delta drops
      values at any precision).
  """
  if (isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 < beta <= 1
      or np.float32(beta) == 0):
    raise ValueError(
        f"DiLoCo error_feedback must be None (off) or a number in (0, 1], got {beta!r}:"
        " it is the decay β of the residual e ← β·e + Δ − decode(q) (1 keeps all of it),"
        " in F32, where it must not round to 0."
    )
  if wire.precision == "F32" and not wire.sparse:
    raise ValueError(
        f"DiLoCo error_feedback={beta!r} with delta_precision='F32': F32 deltas travel"
        f" exactly, so there is no error to feed back; pick a lossy delta_precision"
        f" ({_LOSSY}), send sparse deltas (delta_topk), or error_feedback=None."
    )
  return float(beta)


def check_schema(beta: float | None, wire: Wire, schema: Schema) -> None:
  """Refuses error feedback on parameters whose deltas all travel exactly.

  With ``delta_precision=None`` each delta travels at its leaf's dtype: F32 leaves
  exactly (their residual would stay zero), 16-bit ones rounded.

  Raises:
    ValueError: ``beta`` is set, ``delta_precision`` is None and every leaf is F32.
  """
  if (beta is not None and wire.precision is None and not wire.sparse
      and all(spec.dtype == "F32" for spec in schema.parameters)):
    raise ValueError(
        f"DiLoCo error_feedback={beta!r} with delta_precision=None and F32 parameters:"
        " the deltas travel as F32, exactly, so there is no error to feed back; pick a"
        f" lossy delta_precision ({_LOSSY}), or error_feedback=None."
    )


def compensated(residual: Any, delta: Any, beta: float) -> Any:
  """``β·e + Δ`` in F32, leaf by leaf: the value that is encoded and sent."""
  return jax.tree.map(
      lambda e, d: jnp.float32(beta) * e + d.astype(jnp.float32), residual, delta)


_compensated = jax.jit(compensated, static_argnames=("beta",))
_subtract = jax.jit(lambda a, b: jax.tree.map(jnp.subtract, a, b))


class Encoded(NamedTuple):
  """What ``encode`` gives: the payload entries of ``q``, what they decode to, and the
  new residual."""
  entries: dict[str, jax.Array]
  decoded: dict[str, jax.Array]
  residual: dict[str, np.ndarray]


def encode(
    residual: Mapping[str, np.ndarray],
    delta: Mapping[str, Any],
    beta: float,
    schema: Schema,
    wire: Wire,
) -> Encoded:
  """The payload entries of ``q = encode(β·e + Δ)``, their decoded values and the new
  residual.

  Args:
    residual: ``e`` by leaf name, F32 (zeros before the first delta).
    delta: ``Δ`` by leaf name.
    beta: ``β``, in ``(0, 1]``.
    schema: the leaves' specs (their dtypes are the target of ``precision=None``).
    wire: how deltas travel (``DiLoCo.delta_wire``).

  Returns:
    ``Encoded(entries, decoded, residual)``: the entries ``wire.encode`` gives for
    ``β·e + Δ``, ``decode(entries)`` (F32, by leaf name: what every reader of the entries
    gets), and ``β·e + Δ − decode(entries)`` as host F32 arrays.

  Raises:
    ValueError: ``β·e + Δ`` holds NaN or Inf (names the leaf); nothing is sent, and the
      caller keeps its residual.
  """
  value = _compensated(dict(residual), dict(delta), beta=float(beta))
  entries = wire.encode(value, schema)
  decoded = wire.decode(entries, schema)
  decoded = {n: decoded[n] for n in value}
  left = _subtract(value, decoded)
  return Encoded(entries, decoded,
                 {n: np.asarray(v, np.float32) for n, v in jax.device_get(left).items()})

