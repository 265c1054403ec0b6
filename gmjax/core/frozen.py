"""``FrozenDict``: a read-only dict that copies, pickles and hashes.

Frozen dataclasses (``gmjax.DiLoCo``'s ``outer_options`` and ``layer_axis``, the mail
runtime's records) keep their mappings read-only. ``types.MappingProxyType`` is
read-only too, but cannot be pickled or deep-copied, so neither could the dataclasses
that hold one (``copy.deepcopy``, ``dataclasses.asdict``, ``pickle``, ``multiprocessing``),
and it is not hashable. A ``dict`` subclass whose mutators raise is all of these, and
``json.dumps`` writes it as the dict it is.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np


class FrozenDict(dict):
  """A ``dict`` that refuses changes; equal to, and JSON as, the plain dict."""

  __slots__ = ()

  def _refuse(self, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(f"{type(self).__name__} is read-only; copy it with dict(...) to change it")

  __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
  __ior__ = _refuse

  def __hash__(self) -> int:  # type: ignore[override]
    return json_hash(self)

  def __reduce__(self):
    return type(self), (dict(self),)

  def __copy__(self) -> FrozenDict:
    return self

  def __deepcopy__(self, memo: dict) -> FrozenDict:
    return type(self)(copy.deepcopy(dict(self), memo))

  def __repr__(self) -> str:
    return repr(dict(self))


def frozen(value: Any) -> Any:
  """A JSON-like ``value`` read-only all the way down: dicts as ``FrozenDict``, lists as
  tuples."""
  if isinstance(value, dict):
    return FrozenDict({k: frozen(v) for k, v in value.items()})
  if isinstance(value, (list, tuple)):
    return tuple(frozen(v) for v in value)
  return value


def json_hash(value: Any) -> int:
  """A hash of a JSON-like value that values equal in Python share: ``1`` and ``1.0``
  (equal, but written apart by ``json.dumps``) hash alike, as do equal dicts of any key
  order."""
  return hash(json.dumps(_numbers_as_floats(value), sort_keys=True, default=repr))


def _numbers_as_floats(value: Any) -> Any:
  if isinstance(value, bool) or value is None or isinstance(value, str):
    return value
  if isinstance(value, (int, float)):
    return float(value)
  if isinstance(value, dict):
    return {k: _numbers_as_floats(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_numbers_as_floats(v) for v in value]
  return value


def native(value: Any) -> Any:
  """numpy and JAX scalars and arrays as the Python values JSON holds (``json.dumps``'
  ``default``)."""
  if isinstance(value, np.generic) or hasattr(value, "__array__"):
    return np.asarray(value).tolist()
  raise TypeError(f"{type(value).__name__} is not JSON")
