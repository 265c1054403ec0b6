"""The checks of ``gmjax.DiLoCo``'s configuration, which its ``__post_init__`` runs.

Every field is checked when the configuration is made, so a bad value fails where it
is written, with a message that names the field, shows the value and says what to
change, rather than at the first round. The checks live here, apart from the dataclass
(``gmjax.core.diloco``), whose module keeps the fields, their documentation and what
the configuration builds (schedule, fragment plan, wires, outer optimizer). They take
the configuration itself, and replace its mappings (``outer_options``, ``layer_axis``)
and ``error_feedback`` by the frozen, normalized values it keeps.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from gmjax.core import eager as eager_updates
from gmjax.core import feedback, robust
from gmjax.core.frozen import FrozenDict
from gmjax.core.frozen import frozen as frozen_json
from gmjax.core.frozen import native
from gmjax.core.wire import F32_MAX, check_precision


MAX_SYNC_EVERY = 2**31 - 1


def check_fields(config: Any) -> None:
  """Checks the fields of ``config`` (a ``DiLoCo``) that stand alone; freezes its mappings.

  ``outer_options`` and ``layer_axis`` are replaced by read-only copies (the options
  after a JSON round trip), so that a frozen configuration stays as it was checked.

  Raises:
    ValueError: a field out of its range or of the wrong type, naming it and its value.
  """
  # numpy scalars (a count read from an array, a rate from a sweep) as the Python values
  # they stand for: np.int64 is no int, np.float32 no float.
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if isinstance(value, np.generic) and isinstance(value, (np.bool_, np.integer, np.floating)):
      object.__setattr__(config, field.name, value.item())
  _positive_int("sync_every", config.sync_every)
  if config.sync_every > MAX_SYNC_EVERY:
    raise ValueError(
        f"DiLoCo sync_every must be at most 2**31 - 1, got {config.sync_every}: the"
        " in-mesh step count is an int32, which never reaches a larger one.")
  _positive_int("fragments", config.fragments)
  if config.fragments > config.sync_every:
    raise ValueError(
        f"DiLoCo needs 1 <= fragments <= sync_every, got fragments={config.fragments},"
        f" sync_every={config.sync_every}: every fragment must sync once per sync_every"
        " steps, so lower fragments or raise sync_every."
    )
  lr = config.outer_learning_rate
  if (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr <= F32_MAX
      or np.float32(lr) == 0):
    raise ValueError(
        f"DiLoCo outer_learning_rate must be a positive number that F32 holds (the outer"
        f" step runs in F32: not 0 there, at most its largest), got {lr!r} (the paper"
        " uses 0.7)."
    )
  mu = config.outer_momentum
  if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0 <= mu < 1:
    raise ValueError(
        f"DiLoCo outer_momentum must be in [0, 1), got {mu!r} (the paper uses 0.9)."
    )
  if not isinstance(config.nesterov, bool):
    raise ValueError(f"DiLoCo nesterov must be a bool, got {config.nesterov!r}; e.g."
                     " nesterov=True (Nesterov momentum, DiLoCo's outer step).")
  check_precision(config.delta_precision, "delta_precision")
  check_precision(config.commit_precision, "commit_precision")
  _check_sparse(config)
  mixing = config.mixing
  if isinstance(mixing, bool) or not isinstance(mixing, (int, float)) or not 0 <= mixing < 1:
    raise ValueError(
        f"DiLoCo mixing must be in [0, 1), got {mixing!r}: it is the share of local"
        " parameters kept when aligning to a commit (0 adopts the commit)."
    )
  if config.overlap_steps is not None:
    tau = config.overlap_steps
    if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < config.sync_every:
      raise ValueError(
          f"DiLoCo overlap_steps must be None or an int in [0, sync_every), got {tau!r}"
          f" with sync_every={config.sync_every}: the next round of a fragment needs the"
          " merged anchor."
      )
  _positive_int("in_flight", config.in_flight)
  _positive_int("quorum_size", config.quorum_size, allow_none=True)
  _positive_int("global_batch_size", config.global_batch_size, allow_none=True)
  if not isinstance(config.flush_on_close, bool):
    raise ValueError(f"DiLoCo flush_on_close must be a bool, got {config.flush_on_close!r};"
                     " True sends a leaving learner's last steps, False drops them.")
  if not isinstance(config.adaptive_steps, bool):
    raise ValueError(
        f"DiLoCo adaptive_steps must be a bool, got {config.adaptive_steps!r}: True lets"
        " mail learners train for the same wall time per round instead of the same"
        " number of steps.")
  options = config.outer_options
  if options is not None:
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
      raise ValueError(
          f"DiLoCo outer_options must be None or a dict of keyword arguments of"
          f" optax.{config.outer}, got {options!r}."
      )
    try:
      # A JSON round trip: the manifest stores the options, and every closer must
      # build the same optimizer from them.
      options_json = json.loads(json.dumps(dict(options), sort_keys=True, allow_nan=False,
                                           default=native))
    except (TypeError, ValueError) as error:
      raise ValueError(
          f"DiLoCo outer_options must be JSON (numbers, strings, bools, lists, dicts),"
          f" got {options!r}: {error}."
      ) from None
    object.__setattr__(config, "outer_options", frozen_json(options_json))
  _check_layer_axis(config)


def check_custom_outer(config: Any) -> None:
  """Checks that ``config`` (``outer='custom'``) leaves the fields of a built outer
  optimizer at their defaults: the optimizer given in code would not use them.

  Raises:
    ValueError: naming the fields that are not at their defaults.
  """
  defaults = {f.name: f.default for f in dataclasses.fields(config)}
  ignored = [f"{name}={getattr(config, name)!r}"
             for name in ("outer_learning_rate", "outer_momentum", "nesterov", "outer_options")
             if getattr(config, name) != defaults[name]]
  if ignored:
    raise ValueError(
        f"DiLoCo outer='custom' takes the outer optimizer given in code"
        f" (gmjax.diloco(inner, config, outer=tx)), so {', '.join(ignored)} would not be"
        f" used; leave them at their defaults, or name an optax optimizer in outer"
        f" (e.g. outer='sgd') to use them.")


def check_exchange(config: Any) -> None:
  """Checks how ``config``'s rounds combine and travel: eager updates, the aggregation
  rule, and error feedback against the delta wire (``error_feedback`` is then kept as a
  float).

  Raises:
    ValueError: ``eager_updates.check``'s, ``robust.check``'s or ``feedback.check``'s
      errors, or ``eager`` with a robust aggregation.
  """
  eager_updates.check(config)
  robust.check(config.aggregation, config.trim, config.outlier_factor)
  if config.eager and config.aggregation != robust.MEAN:
    raise ValueError(
        f"DiLoCo eager=True needs aggregation='mean', got"
        f" aggregation={config.aggregation!r}: an eager learner swaps its own weighted"
        " delta in the mean, which a robust rule does not form; set eager=False.")
  if config.error_feedback is not None:
    # A float, so that equal configurations hash alike (their JSON is the same).
    object.__setattr__(config, "error_feedback",
                       feedback.check(config.error_feedback, config.delta_wire))


_EXAMPLES = {"sync_every": "sync_every=500 (inner steps a round)",
             "fragments": "fragments=1 (plain DiLoCo) or 4 (Streaming DiLoCo)",
             "in_flight": "in_flight=1 (the default)",
             "quorum_size": "quorum_size=None (every live learner) or 2",
             "global_batch_size": "global_batch_size=None, or the tokens of a global batch"}


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
  if allow_none and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"DiLoCo {name} must be a positive int, got {value!r}; e.g."
                     f" {_EXAMPLES[name]}.")


def json_fields(record: Any, known: list[str]) -> dict[str, Any]:
  """The fields of a ``DiLoCo.to_json`` record, or an error naming what is wrong in it."""
  if not isinstance(record, Mapping):
    raise TypeError(f"DiLoCo.from_json takes the dict to_json gives (json.loads of its"
                    f" text), got {type(record).__name__} {str(record)[:80]!r}.")
  record = dict(record)
  name = record.pop("name", "DiLoCo")
  if name != "DiLoCo":
    raise ValueError(f"DiLoCo.from_json: not a DiLoCo configuration: name={name!r}.")
  unknown = sorted(set(record) - set(known))
  if unknown:
    close = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
    hints = "".join(f" ({u!r}: did you mean {c[0]!r}?)" for u, c in close.items() if c)
    raise ValueError(f"DiLoCo.from_json: unknown fields {unknown}{hints}; the fields are"
                     f" {sorted(known)}.")
  return record


def _check_sparse(config: Any) -> None:
  topk, chunk = config.delta_topk, config.delta_chunk
  if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
    raise ValueError(
        f"DiLoCo delta_topk must be None (dense deltas) or a positive int, got {topk!r}:"
        " it is the number of values each chunk of delta_chunk values keeps."
    )
  if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 2**32:
    raise ValueError(
        f"DiLoCo delta_chunk must be a positive int (at most 2**32), got {chunk!r}:"
        " it is the length of the chunks delta_topk keeps values of (4096 by default)."
    )
  if topk is not None and chunk < topk:
    raise ValueError(
        f"DiLoCo needs delta_chunk >= delta_topk, got delta_chunk={chunk},"
        f" delta_topk={topk}: a chunk keeps at most all its values, so raise"
        " delta_chunk or lower delta_topk."
    )


def _check_layer_axis(config: Any) -> None:
  axes = config.layer_axis
  if axes is None:
    return
  if isinstance(axes, Mapping):  # numpy integers, as the other fields take them
    axes = {k: v.item() if isinstance(v, np.integer) else v for k, v in axes.items()}
  if (not isinstance(axes, Mapping) or not axes
      or not all(isinstance(k, str) and k for k in axes)
      or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                 for v in axes.values())):
    raise ValueError(
        f"DiLoCo layer_axis must be None or a non-empty dict from a leaf path prefix to"
        f" the non-negative axis its layers are stacked on, got {axes!r}; e.g."
        " {'layers': 0} for nnx.scan, {'decoder/layers': 1} for MaxText.")
  object.__setattr__(config, "layer_axis", FrozenDict(axes))


def state_inside(value: Any) -> str:
  """Where in ``value`` (an optimizer state that wraps one, e.g. ``optax.chain``'s or
  ``optax.MultiSteps``') a ``gmjax.diloco`` state lies, as a hint for a message; "" if
  none does."""
  is_state = lambda x: hasattr(x, "pending") and hasattr(x, "anchor")
  found = [jax.tree_util.keystr(path) for path, leaf in
           jax.tree_util.tree_flatten_with_path(value, is_leaf=is_state)[0] if is_state(leaf)]
  return f" (this one holds it at state{found[0]}: pass that)" if found else ""
