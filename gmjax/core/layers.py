"""Layer blocks: stacked leaves cut along their layer axis into fragments' pieces.

A scanned model keeps all its layers in one leaf per parameter type (flax ``nnx.scan``
stacks them on axis 0, MaxText's ``scan_layers`` on ``param_scan_axis``, 1 by default).
Streaming DiLoCo syncs contiguous blocks of layers, so such a leaf is cut into ``B``
pieces along its layer axis, each a leaf of its own on the wire and in the fragment plan:
``decoder/layers/mlp/wi[0:6]`` holds layers 0 to 5 of ``decoder/layers/mlp/wi``. Block
``b`` of ``L`` layers is ``[⌊b·L/B⌋, ⌊(b+1)·L/B⌋)``.

``Pieces`` is the name → array view of a tree's leaves through such a cut: a piece is
sliced from its leaf when it is read, and a leaf is put back together only where a piece
was written, so a step that changes no piece copies nothing.

References:
  Douillard et al., *Streaming DiLoCo with overlapping communication*, arXiv 2501.18512.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_PIECE = re.compile(r"^(?P<leaf>.+)\[(?P<start>\d+):(?P<stop>\d+)\]$")


def piece_name(leaf: str, start: int, stop: int) -> str:
  """The name of layers ``[start, stop)`` of the stacked leaf ``leaf``."""
  return f"{leaf}[{start}:{stop}]"


_PIECE_NAME = re.compile(r"(.+)\[([0-9]+):([0-9]+)\]")


def block_of(name: str) -> tuple[str, int, int] | None:
  """``(leaf, start, stop)`` of a name ``piece_name`` made, else None."""
  block = _PIECE_NAME.fullmatch(name)
  return block and (block[1], int(block[2]), int(block[3]))


@dataclasses.dataclass(frozen=True)
class Piece:
  """Layers ``[start, stop)`` along ``axis`` of leaf ``leaf`` (``axis`` None: the whole leaf)."""

  name: str
  leaf: str
  axis: int | None = None
  start: int = 0
  stop: int = 0

  def take(self, x: Any) -> Any:
    """The piece of the leaf value ``x`` (numpy or jax, traced or not)."""
    if self.axis is None:
      return x
    split = _split_over(x, self.axis)
    if split and (self.stop - self.start) % split:
      # The layer axis is split over an explicit mesh axis that the block's layers do
      # not divide: the leaf is gathered along it first (a slice cannot be typed).
      spec = list(jax.typeof(x).sharding.spec)
      spec[self.axis] = None
      x = jax.sharding.reshard(x, jax.P(*spec))
    index = [slice(None)] * np.ndim(x)
    index[self.axis] = slice(self.start, self.stop)
    return x[tuple(index)]

  def put(self, x: jax.Array, value: jax.Array) -> jax.Array:
    """``x`` with this piece replaced by ``value`` (traced: an in-place update slice)."""
    if self.axis is None:
      return value
    value = value.astype(x.dtype)
    if _split_over(x, self.axis):
      # The layer axis split over an explicit mesh axis: the piece is laid out otherwise
      # than the leaf, and explicit sharding asks where the result goes (the leaf's way).
      index = [slice(None)] * x.ndim
      index[self.axis] = slice(self.start, self.stop)
      return x.at[tuple(index)].set(value, out_sharding=jax.typeof(x).sharding)
    return lax.dynamic_update_slice_in_dim(x, value, self.start, self.axis)


def _split_over(x: Any, axis: int) -> int:
  """How many ways an explicit mesh splits axis ``axis`` of ``x`` (0: it is not split,
  or ``x`` is not a jax value on an explicit mesh)."""
  if not isinstance(x, jax.Array):  # tracers are too; numpy is not
    return 0
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = tuple(getattr(sharding, "spec", None) or ())
  if axis >= len(spec) or spec[axis] is None:
    return 0
  names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
  return int(np.prod([sharding.mesh.shape[n] for n in names]))


def stacked_leaves(names: Mapping[str, tuple[int, ...]],
                   layer_axis: Mapping[str, int]) -> dict[str, int]:
  """The leaves ``layer_axis`` names (a prefix of their ``/`` path) and their layer axis.

  A leaf under several prefixes takes the axis of the longest (``{"layers": 0,
  "layers/w": 1}``: ``layers/w`` on axis 1, the rest of ``layers`` on 0), whatever their
  order: two configs with the same prefixes are equal.

  Args:
    names: leaf name → shape.
    layer_axis: name prefix → layer axis of the leaves under it.

  Raises:
    ValueError: a prefix matches no leaf, a leaf has no such axis, or the stacked leaves
      disagree on the number of layers.
  """
  axes: dict[str, int] = {}
  for prefix, axis in sorted(layer_axis.items(), key=lambda item: len(item[0].rstrip("/"))):
    matched = [n for n in names if n == prefix or n.startswith(prefix.rstrip("/") + "/")]
    if not matched:
      paths = {"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 2)}
      close = difflib.get_close_matches(prefix, sorted(paths), n=3)
      raise ValueError(
          f"DiLoCo layer_axis names {prefix!r}, which is no leaf and no prefix of a leaf's"
          f" path; {f'did you mean {close}? ' if close else ''}the leaves' top-level paths"
          f" are {sorted({n.split('/')[0] for n in names})[:16]}: use the path of the"
          " stacked layers (e.g. 'layers' for nnx.scan, 'decoder/layers' for MaxText).")
    for name in matched:
      if axis >= len(names[name]):
        raise ValueError(
            f"DiLoCo layer_axis[{prefix!r}]={axis}, but leaf {name!r} has shape"
            f" {names[name]}, which has no axis {axis}: give the axis its layers are"
            " stacked on (0 for nnx.scan, MaxText's param_scan_axis).")
      axes[name] = axis
  counts = {names[n][a] for n, a in axes.items()}
  if len(counts) > 1:
    sizes = {n: names[n][a] for n, a in sorted(axes.items())}
    raise ValueError(
        f"DiLoCo layer_axis stacks leaves with different numbers of layers {sizes}: every"
        " leaf it names must hold the same layers; narrow its prefixes.")
  if counts == {0}:
    raise ValueError(
        f"DiLoCo layer_axis stacks leaves with no layers ({sorted(axes)} have 0 along"
        " their layer axis): there are no blocks to cut; leave them out of layer_axis.")
  return axes


def cut(names: Mapping[str, tuple[int, ...]], axes: Mapping[str, int],
        blocks: int) -> dict[str, tuple[Piece, ...]]:
  """Leaf → its pieces: ``blocks`` contiguous blocks for each stacked leaf of ``axes``."""
  pieces = {}
  for name, shape in names.items():
    if name not in axes:
      pieces[name] = (Piece(name, name),)
      continue
    axis, layers = axes[name], shape[axes[name]]
    bounds = [b * layers // blocks for b in range(blocks + 1)]
    pieces[name] = tuple(Piece(piece_name(name, a, b), name, axis, a, b)
                         for a, b in zip(bounds, bounds[1:]))
  return pieces


class Pieces(MutableMapping):
  """A tree's leaves by piece name, read and written through the cut of a schema.

  Args:
    leaves: leaf name → value (numpy or jax arrays).
    pieces: leaf name → its pieces (``cut``).
  """

  def __init__(self, leaves: Mapping[str, Any], pieces: Mapping[str, tuple[Piece, ...]]):
    self._leaves = dict(leaves)
    self._pieces = pieces
    self._index = {p.name: p for ps in pieces.values() for p in ps}
    self._written: dict[str, Any] = {}

  def __getitem__(self, name: str) -> Any:
    if name in self._written:
      return self._written[name]
    piece = self._index[name]
    return piece.take(self._leaves[piece.leaf])

  def __setitem__(self, name: str, value: Any) -> None:
    piece = self._index[name]  # a KeyError for names not in the cut
    if piece.axis is None:
      self._leaves[name] = value
    else:
      self._written[name] = value

  def __delitem__(self, name: str) -> None:
    raise TypeError("the pieces of a tree cannot be deleted, only replaced")

  def __iter__(self) -> Iterator[str]:
    return iter(self._index)

  def __len__(self) -> int:
    return len(self._index)

  def leaves(self) -> dict[str, Any]:
    """Leaf name → value, each stacked leaf put back together from its pieces.

    A leaf none of whose pieces was written is the value it was read from; a jax leaf
    keeps its sharding.
    """
    out = dict(self._leaves)
    for leaf, pieces in self._pieces.items():
      if not any(p.name in self._written for p in pieces):
        continue
      old = self._leaves.get(leaf)  # None: every piece was written
      parts = [self[p.name] for p in pieces]
      dtype = parts[0].dtype if old is None else old.dtype
      if all(isinstance(p, np.ndarray) for p in parts) and not isinstance(old, jax.Array):
        out[leaf] = np.concatenate(parts, axis=pieces[0].axis).astype(dtype, copy=False)
      else:
        value = jnp.concatenate([jnp.asarray(p, dtype) for p in parts],
                                axis=pieces[0].axis)
        sharding = getattr(old, "sharding", None)
        out[leaf] = (jax.device_put(value, sharding)
                     if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer)
                     and sharding is not None else value)
    return out
