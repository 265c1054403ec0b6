"""A fragment's leaves as few buffers: its *buckets*, so a round is one program per fragment.

A round works on each leaf's rows of codec blocks (``gmjax.transform.shards``: ``(R, …)``
arrays whose leading dimension is the rows). The bucket of a group of leaves is their
rows laid end to end: encoded, exchanged, screened and summed once, whatever the number
of leaves. Leaves share a bucket when they travel alike (the same wire code) and lie
alike: on an explicit mesh, rows split over the same mesh axes (FSDP) are cut into one
piece a device, ``(F, R/F, …)``, and the pieces laid end to end along the second
dimension, so each device's bucket is built from its own rows and nothing is gathered
over those axes; a leaf whose rows are replicated joins the other replicated ones
(``F = 1``). Where the layout cannot be seen (an Auto mesh axis of size > 1 besides the
learners', which XLA partitions as it propagates), each leaf is a bucket of its own,
since laying pieces of differently split leaves end to end would move them.

Every bucket has the shape ``(F, S, …)``, ``S`` the sum of its leaves' ``R/F``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gmjax.transform import explicit


def _row_axes(x: jax.Array) -> tuple[str, ...]:
  """The explicit mesh axes that split ``x``'s leading dimension (its rows)."""
  entries = explicit.spec(x)
  if not entries or entries[0] is None:
    return ()
  return entries[0] if isinstance(entries[0], tuple) else (entries[0],)


def _layout_hidden(axis_name: Any) -> bool:
  """Whether a mesh axis XLA partitions on its own (Auto, size > 1) is not the learners'."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return False
  learners = set(axis_name if isinstance(axis_name, tuple) else (axis_name,))
  return any(t == AxisType.Auto and size > 1 and name not in learners
             for name, size, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types))


class Buckets:
  """How the rows of a fragment's leaves lie in its buckets.

  Args:
    rows: each leaf's rows by name (an array, or anything with ``shape`` and a
      sharding); the names' order is the order within a bucket.
    code: each leaf's wire code by name (leaves of different codes never share one).
    axis_name: the learners' axis, whose own split is not a layout to keep.
  """

  def __init__(self, rows: Mapping[str, jax.Array], code: Mapping[str, str],
               axis_name: Any):
    hidden = _layout_hidden(axis_name)
    groups: dict[Any, list[str]] = {}
    self.axes: dict[str, tuple[str, ...]] = {}
    for name, x in rows.items():
      axes = _row_axes(x)
      self.axes[name] = axes
      key = (name,) if hidden else (code[name], axes)
      groups.setdefault(key, []).append(name)
    self.groups: tuple[tuple[str, ...], ...] = tuple(tuple(g) for g in groups.values())
    self.codes = tuple(code[g[0]] for g in self.groups)
    self.rows = {n: x.shape[0] for n, x in rows.items()}
    self.pieces: list[int] = []
    for group in self.groups:
      axes = self.axes[group[0]]
      if not axes:
        self.pieces.append(1)
      else:
        mesh = jax.typeof(rows[group[0]]).sharding.mesh
        self.pieces.append(math.prod(mesh.shape[a] for a in axes))

  def __len__(self) -> int:
    return len(self.groups)

  def _spec(self, index: int, ndim: int) -> tuple | None:
    axes = self.axes[self.groups[index][0]]
    if not axes:
      return None
    return (axes if len(axes) > 1 else axes[0],) + (None,) * (ndim - 1)

  def pack(self, values: Mapping[str, jax.Array]) -> list[jax.Array]:
    """The buckets ``(F, S, …)`` of ``values`` (each leaf ``(R, …)``, laid out as its rows)."""
    out = []
    for index, group in enumerate(self.groups):
      pieces = self.pieces[index]
      parts = []
      for name in group:
        x = values[name]
        shape = (pieces, x.shape[0] // pieces, *x.shape[1:])
        spec = self._spec(index, x.ndim + 1)
        if spec is None:
          parts.append(x.reshape(shape))
        else:
          # Splitting the leading dimension keeps its split where it lies.
          parts.append(jnp.reshape(x, shape, out_sharding=P(*spec)))
      out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1))
    return out

  def unpack(self, buckets: Sequence[jax.Array]) -> dict[str, jax.Array]:
    """Each leaf's rows ``(R, …)`` from buckets ``(F, S, …)`` (the inverse of ``pack``)."""
    out = {}
    for index, (group, bucket) in enumerate(zip(self.groups, buckets)):
      pieces, offset = self.pieces[index], 0
      spec = self._spec(index, bucket.ndim - 1)
      for name in group:
        length = self.rows[name] // pieces
        part = bucket[:, offset:offset + length] if len(group) > 1 else bucket
        offset += length
        shape = (self.rows[name], *bucket.shape[2:])
        if spec is None:
          out[name] = part.reshape(shape)
        else:
          out[name] = jnp.reshape(part, shape, out_sharding=P(*spec))
    return out
