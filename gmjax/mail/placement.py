"""Where a learner's arrays live: host copies for the exchange, ``like``'s sharding back.

The delta of a fragment and its merge with a commit are computed from host copies of
its leaves (they may live on different devices, or, in a multi-process JAX job, be
global arrays that no process holds whole: ``process_allgather`` then gathers them, a
collective every process of the job takes part in). The results go back where the
caller's leaves were: numpy stays numpy, a ``jax.Array`` gets its sharding back.
Computations run on this process's first local device, which in a multi-process job
is not always the default one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from gmjax.core import outer

_delta = jax.jit(outer.pseudo_gradient)
_align = jax.jit(outer.align, static_argnames=("mixing",))


def to_host(value: Any) -> np.ndarray:
  """A leaf as a host array (a global array is gathered from every process)."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.array(jax.device_get(value))


def like(value: Any, template: Any) -> Any:
  """``value`` as a leaf like ``template``: numpy stays numpy (in its dtype), a
  ``jax.Array`` comes back with its sharding, anything else becomes a jax array."""
  if isinstance(template, np.ndarray) or np.isscalar(template):
    return np.array(value, dtype=template.dtype if hasattr(template, "dtype") else None)
  if isinstance(template, jax.Array):
    if template.is_fully_addressable:
      return jax.device_put(value, template.sharding)
    host = np.asarray(jax.device_get(value))
    return jax.make_array_from_callback(host.shape, template.sharding,
                                        lambda index: host[index])
  return jax.numpy.asarray(value)


def delta(anchor: Mapping[str, Any], theta: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """``anchor − θ`` (``outer.pseudo_gradient``) on this process's device."""
  with jax.default_device(jax.local_devices()[0]):
    return _delta(dict(anchor), dict(theta))


def align(current: Mapping[str, Any], committed: Mapping[str, np.ndarray], *,
          mixing: float) -> dict[str, Any]:
  """``mixing·θ + (1 − mixing)·Θ`` (``outer.align``) of host copies of ``current``."""
  host = {n: to_host(v) for n, v in current.items()}
  with jax.default_device(jax.local_devices()[0]):
    return _align(host, dict(committed), mixing=mixing)
