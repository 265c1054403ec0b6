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
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gmjax.core.codec import CODE_BITS, JNP_DTYPES, QUANTIZED, dequantize, quantize
from gmjax.transform import collectives, explicit


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
    dtype: each leaf's parameter dtype by name, if leaves of different dtypes must not
      share a bucket either (a bucket of masters publishes one dtype).
  """

  def __init__(self, rows: Mapping[str, jax.Array], code: Mapping[str, str],
               axis_name: Any, dtype: Mapping[str, str] | None = None):
    hidden = _layout_hidden(axis_name)
    groups: dict[Any, list[str]] = {}
    self.axes: dict[str, tuple[str, ...]] = {}
    for name, x in rows.items():
      axes = _row_axes(x)
      self.axes[name] = axes
      kind = None if dtype is None else dtype[name]
      key = (name,) if hidden else (code[name], kind, axes)
      groups.setdefault(key, []).append(name)
    self.groups: tuple[tuple[str, ...], ...] = tuple(tuple(g) for g in groups.values())
    self.codes = tuple(code[g[0]] for g in self.groups)
    self.dtypes = tuple(None if dtype is None else dtype[g[0]] for g in self.groups)
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


_UINT = {2: jnp.uint16}


def to_wire(values: jax.Array, code: str) -> list[jax.Array]:
  """``values`` (F32, ``(R, M, 32)`` or ``(R, 32)``) encoded for the wire, learner dim 1.

  Returns the arrays that cross: 16-bit values as ``uint16``, F8 codes as ``uint8``,
  4-bit codes packed as ``uint8`` ``(…, 16)``, 2-bit codes as ``uint8`` ``(…, 8)``, scales
  F32 with the blocks' shape.
  """
  if code not in QUANTIZED:
    cast = values.astype(JNP_DTYPES[code])
    if code == "F32":
      return [cast]
    return [lax.bitcast_convert_type(cast, _UINT[cast.dtype.itemsize])]
  codes, scales = quantize(values, code)
  blocks = values.shape[:-1]
  scales = scales.reshape(blocks)
  if code == "F8_E4M3":
    return [lax.bitcast_convert_type(codes, jnp.uint8), scales]
  per_byte = 8 // CODE_BITS[code]
  return [codes.reshape(*blocks, values.shape[-1] // per_byte), scales]


def from_wire(arrays: Sequence[jax.Array], code: str) -> jax.Array:
  """F32 values ``(…, 32)`` of wire arrays (the inverse of ``to_wire``)."""
  if code not in QUANTIZED:
    value = arrays[0]
    if code != "F32":
      value = lax.bitcast_convert_type(value, JNP_DTYPES[code])
    return value.astype(jnp.float32)
  codes, scales = arrays
  blocks = scales.shape
  if code == "F8_E4M3":
    codes = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
  values = dequantize(jnp.ravel(codes), jnp.ravel(scales), (scales.size * 32,), code)
  return values.reshape(*blocks, 32)


def joined(arrays: Sequence[jax.Array]) -> jax.Array:
  """The wire ``arrays`` of one bucket (``to_wire``: codes ``(…, k)`` and scales ``(…)``,
  or a value array alone) as one array that crosses in one collective: codes and the
  scales' bytes side by side, ``uint8`` ``(…, k + 4)``; ``split`` undoes it.

  XLA:CPU writes each operand of an ``all_to_all`` out device by device (a slice and a
  copy per device and operand), so two arrays a bucket cost twice the program of one as
  the learners grow; and XLA does not combine the two ``all_gather``s they would make,
  each a collective's latency.
  """
  if len(arrays) == 1:
    return arrays[0]
  codes, scales = arrays
  return jnp.concatenate([codes, lax.bitcast_convert_type(scales, jnp.uint8)], axis=-1)


def split(crossed: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
  """The wire arrays shaped as ``like`` out of ``crossed`` (the inverse of ``joined``)."""
  if len(like) == 1:
    return [crossed]
  width = like[0].shape[-1]
  scales = lax.bitcast_convert_type(crossed[..., width:], like[1].dtype)
  return [crossed[..., :width], scales]


def gather_wire(wire: Sequence[jax.Array], axis_name: Any, learners: int
                ) -> list[jax.Array]:
  """Every learner's wire arrays of a bucket (``to_wire``), gathered in one
  ``all_gather`` (``joined``), each with the learners at ``LEARNER_DIM``.

  Under vmap's spmd_axis_name the gathered dimension comes out split over the learners'
  axis; every learner needs all of it, laid out as its own part's rows (an FSDP split of
  the bucket's first dimension stays where it lies).
  """
  crossing = joined(wire)
  got, = collectives.all_gather([crossing], axis_name, learners, LEARNER_DIM)
  return split(explicit.pin(got, gathered_spec(crossing, LEARNER_DIM)), wire)


def gathered_spec(shard: jax.Array, axis: int = 1) -> tuple | None:
  """The layout of ``all_gather(shard, axis=axis)``: ``shard``'s, the learner dim whole."""
  entries = explicit.spec(shard)
  if entries is None:  # an Auto mesh: the rest is XLA's to place
    entries = (jax.sharding.PartitionSpec.UNCONSTRAINED,) * jnp.ndim(shard)
  return (*entries[:axis], None, *entries[axis:])


# A bucket of rows is ``(F, S, M, 32)``: its learners' dimension is 2.
LEARNER_DIM = 2
