"""Named records of an outer optimizer's state, as a ``FragmentState`` stores them.

A committed fragment keeps its outer optimizer state (an optax state pytree) as flat
named arrays beside Θ, so that any closer can save it (Orbax, by position) and rebuild it
from the structure ``tx.init`` gives. A leaf's record name is ``outer.`` followed by its
key path in the state, components joined with ``.``; the parameter's name, when the path
ends in one, comes last:

- ``outer.<k>.<field>.<name>`` for a parameter-shaped leaf, e.g. Adam's first moment
  ``outer.0.mu.<name>`` (``<k>`` is the position in optax's chain);
- ``outer.<k>.<field>`` for a scalar, e.g. Adam's step count ``outer.0.count``.

The default outer optimizer, ``optax.sgd``, keeps the shorter name of its momentum ``u``:
the trace at ``0.trace`` is stored as ``momentum.<name>`` (``seed_aliases``; README.md,
"Across machines"). ``Schema`` rejects parameter names under ``outer.`` and parameter
names that collide with ``momentum.<name>``, so no record can shadow a parameter. Names
are only ever generated from a template, never parsed, so parameter names may hold ``.``
and ``/``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gmjax.core.schema import MOMENTUM, OUTER

Aliases = Sequence[tuple[str, str]]


def seed_aliases(outer: str) -> tuple[tuple[str, str], ...]:
  """Record prefixes that store some of ``outer``'s state leaves under fixed names.

  ``optax.sgd`` is ``chain(trace, scale_by_learning_rate)``: its trace (the momentum
  ``u``) is stored as ``momentum.<name>``.
  """
  return (("0.trace", MOMENTUM[:-1]),) if outer == "sgd" else ()


def _component(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _names(tree: Any, aliases: Aliases) -> list[tuple[str, Any]]:
  """``(record name, leaf)`` for every leaf of ``tree``, in its flattening order."""
  prefixes = dict(aliases)
  named, seen = [], {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = [_component(k) for k in path]
    prefix = ".".join(parts[:-1])
    if parts and isinstance(path[-1], jax.tree_util.DictKey) and prefix in prefixes:
      name = f"{prefixes[prefix]}.{parts[-1]}"
    else:
      name = OUTER + ".".join(parts)
    if name in seen:
      raise ValueError(
          f"outer optimizer state leaves {seen[name]} and {jax.tree_util.keystr(path)}"
          f" both map to the record name {name!r}; rename the parameters whose names"
          " hold '.' so that they differ."
      )
    seen[name] = jax.tree_util.keystr(path)
    named.append((name, leaf))
  return named


def record_names(template: Any, aliases: Aliases = ()) -> tuple[str, ...]:
  """The record names of an optax state (or of its template, ``tx.init(master)``)."""
  return tuple(name for name, _ in _names(template, aliases))


def flatten(state: Any, aliases: Aliases = ()) -> dict[str, Any]:
  """An optax state as records by name (the leaves themselves, not copies).

  Args:
    state: the outer optimizer's state, as ``tx.init``/``tx.update`` return it.
    aliases: ``(path prefix, record prefix)`` pairs, e.g. ``seed_aliases(outer)``.

  Returns:
    ``{record name: leaf}``.

  Raises:
    ValueError: two leaves would share a record name.
  """
  return dict(_names(state, aliases))


def unflatten(records: Mapping[str, Any], template: Any, aliases: Aliases = ()) -> Any:
  """The optax state of ``template``'s structure holding ``records`` (traceable).

  Args:
    records: arrays by record name; names of other records (``master.<name>``) are
      ignored.
    template: a state of the right structure, shapes and dtypes (``tx.init(master)``,
      or ``jax.eval_shape`` of it).
    aliases: as given to ``flatten``.

  Returns:
    The state, each leaf at its template dtype.

  Raises:
    ValueError: a record is missing or has another shape than the template's leaf.
  """
  leaves = []
  for name, leaf in _names(template, aliases):
    if name not in records:
      raise ValueError(
          f"outer state lacks record {name!r} that the outer optimizer's state needs (it"
          f" holds {sorted(records)[:8]}); the run's outer optimizer and its stored"
          " state disagree."
      )
    value = jnp.asarray(records[name])
    if tuple(value.shape) != tuple(leaf.shape):
      raise ValueError(
          f"outer state record {name!r} has shape {tuple(value.shape)}, the outer"
          f" optimizer's state needs {tuple(leaf.shape)}."
      )
    leaves.append(value.astype(leaf.dtype))
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)
