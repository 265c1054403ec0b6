"""Parameter schemas: the names, dtypes and shapes of a parameter pytree's leaves.

A leaf's name is its pytree key path joined with ``/`` (``params/dense/kernel``,
``layers/0/w``); the trailing ``value`` attribute of a flax ``nnx.Variable`` is left out,
so an ``nnx.State`` names its leaves as the module path does.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from gmjax.core.layers import Piece, Pieces

# Names of the numpy dtypes each safetensors dtype code stands for.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "U8": np.dtype(np.uint8),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
}
_CODES = {dtype: code for code, dtype in NUMPY_DTYPES.items()}
PARAMETER_DTYPES = ("F32", "F16", "BF16")

MOMENTUM = "momentum."
MASTER = "master."
SCALE = ".scale"
INDEX = ".index"  # a sparse delta's index entry (``gmjax.core.sparse``)
# Records of an outer optimizer's state other than the default SGD's momentum
# (``gmjax.core.outer_records``): every name under this prefix is reserved.
OUTER = "outer."
METADATA = "__metadata__"  # the safetensors header's metadata key (``gmjax.core.payload``)


def dtype_code(dtype: Any, *, what: str = "leaf") -> str:
  """The schema code (``F32``/``F16``/``BF16``) of a parameter dtype; float64 is F32."""
  try:
    dtype = np.dtype(dtype)
  except TypeError:  # a dtype numpy cannot hold, e.g. a PRNG key's key<fry>
    code = None
  else:
    if dtype == np.float64:
      return "F32"
    code = _CODES.get(dtype)
  if code not in PARAMETER_DTYPES:
    raise ValueError(
        f"{what} has dtype {dtype}, but gmjax parameters must be float32, float16 or"
        " bfloat16 (float64 is taken as float32); pass only the trainable float"
        " parameters, e.g. nnx.state(model, nnx.Param)."
    )
  return code


def scale_name(name: str) -> str:
  return name + SCALE


def momentum_name(name: str) -> str:
  return MOMENTUM + name


def master_name(name: str) -> str:
  return MASTER + name


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path: tuple[Any, ...]) -> str:
  """The ``/``-joined name of a pytree key path."""
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
    path = path[:-1]  # an nnx.Variable's payload: name it after the variable
  return "/".join(_key_name(k) for k in path)


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
  """One leaf: its name, its dtype code and its shape."""

  name: str
  dtype: str
  shape: tuple[int, ...]

  def __post_init__(self):
    # Checked as made: a negative or fractional dimension gave a layout of negative
    # bytes, an unknown dtype code a bare KeyError at the first plan.
    if not isinstance(self.name, str):
      raise ValueError(f"ParameterSpec name must be a str, got {self.name!r}.")
    if self.dtype not in NUMPY_DTYPES:
      raise ValueError(f"ParameterSpec {self.name!r}: dtype={self.dtype!r} is not one of"
                       f" {sorted(NUMPY_DTYPES)}; pass a dtype code such as 'F32'.")
    try:
      shape = tuple(operator.index(d) for d in self.shape)
    except TypeError:
      shape = None
    if shape is None or any(d < 0 for d in shape):
      raise ValueError(f"ParameterSpec {self.name!r}: shape must be a tuple of"
                       f" non-negative ints, got {self.shape!r}.")
    object.__setattr__(self, "shape", shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * NUMPY_DTYPES[self.dtype].itemsize


@dataclasses.dataclass(frozen=True)
class Schema:
  """A tuple of specs sorted by name, and (when built from a tree) the way back to it.

  Attributes:
    parameters: the specs, sorted by name.
    treedef: the source tree's structure; ``None`` for a schema built from specs.
    leaf_names: the names in the source tree's leaf order.
    payload: a payload layout (see ``codec.layout``), whose derived names are expected.
    pieces: for a schema cut into layer blocks (``cut``), each source leaf's pieces; its
      parameters are the pieces, and ``flatten``/``unflatten`` go through them.
    source: the schema that was cut (None for an uncut schema).
  """

  parameters: tuple[ParameterSpec, ...]
  treedef: Any = dataclasses.field(default=None, compare=False, repr=False)
  leaf_names: tuple[str, ...] | None = dataclasses.field(
      default=None, compare=False, repr=False
  )
  payload: bool = dataclasses.field(default=False, compare=False, repr=False)
  pieces: Mapping[str, tuple[Piece, ...]] | None = dataclasses.field(
      default=None, compare=False, repr=False)
  source: Schema | None = dataclasses.field(default=None, compare=False, repr=False)
  _index: Mapping[str, int] = dataclasses.field(
      default=None, init=False, compare=False, repr=False
  )

  def __post_init__(self):
    # Linear work after the sort: a name→position index, one pass for duplicates (the
    # names are sorted, so equal names are neighbours) and set lookups for derived
    # names. ``from_tree`` runs on every trace of a training step.
    parameters = tuple(self.parameters)
    if any(a.name > b.name for a, b in zip(parameters, parameters[1:])):
      parameters = tuple(sorted(parameters, key=lambda p: p.name))
    object.__setattr__(self, "parameters", parameters)
    names = [p.name for p in parameters]
    duplicates = sorted({a for a, b in zip(names, names[1:]) if a == b})
    if duplicates:
      raise ValueError(
          f"Schema has duplicate leaf names {duplicates}; keys containing '/' can collide"
          " with nested keys, and an empty key (or a lone leaf) is named '_': rename"
          " them."
      )
    object.__setattr__(self, "_index", {name: i for i, name in enumerate(names)})
    if self.payload:
      return  # a payload layout holds derived names (``<name>.scale``) by design
    for name in names:
      if name == METADATA:
        raise ValueError(
            f"Schema leaf name {name!r} is the key safetensors reserves for a payload's"
            " metadata (its header would hold the leaf's entry in its place); rename the"
            " leaf.")
      if name.startswith(OUTER):
        raise ValueError(
            f"Schema leaf name {name!r} starts with {OUTER!r}, which gmjax reserves for"
            " the records of the outer optimizer's state ('outer.<path>.<name>',"
            " 'outer.<path>'); rename the leaf."
        )
      for base in _derived_bases(name):
        if base in self._index:
          raise ValueError(
              f"Schema leaf name {name!r} collides with a name gmjax derives from leaf"
              f" {base!r} ('momentum.<name>', 'master.<name>', '<name>.scale',"
              " '<name>.index'); rename the leaf."
          )

  @classmethod
  def given(cls, value: Any, where: str) -> Schema:
    """``value``, a ``Schema`` passed to ``where``, or a TypeError naming the fix."""
    if not isinstance(value, cls):
      raise TypeError(f"{where} takes a gmjax.Schema, got {type(value).__name__}: pass"
                      " gmjax.Schema.from_tree(params)")
    return value

  @classmethod
  def from_tree(cls, tree: Any) -> Schema:
    """The schema of a pytree of float arrays (dicts, lists, NamedTuples, nnx.State)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not leaves:
      raise ValueError(
          f"Schema.from_tree got a tree with no array leaves ({type(tree).__name__}"
          f" {str(tree)[:80]}): pass the parameters themselves, a pytree of float arrays"
          " (e.g. nnx.state(model, nnx.Param), or the params dict of a flax.linen init).")
    specs, names = [], []
    for path, leaf in leaves:
      name = path_name(path) or "_"
      if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
        raise ValueError(
            f"Schema.from_tree: leaf {name!r} is {type(leaf).__name__}, not an array;"
            " pass a pytree of arrays."
        )
      code = dtype_code(leaf.dtype, what=f"Schema.from_tree: leaf {name!r}")
      specs.append(ParameterSpec(name, code, tuple(int(d) for d in leaf.shape)))
      names.append(name)
    return cls(tuple(specs), treedef=treedef, leaf_names=tuple(names))

  def cut(self, pieces: Mapping[str, tuple[Piece, ...]]) -> Schema:
    """This tree's schema with each leaf replaced by its ``pieces`` (``gmjax.core.layers``)."""
    specs = []
    taken = {spec.name for spec in self.parameters}
    for spec in self.parameters:
      for piece in pieces[spec.name]:
        if piece.name != spec.name and piece.name in taken:
          raise ValueError(
              f"DiLoCo layer_axis cuts leaf {spec.name!r} into blocks named like"
              f" {piece.name!r}, which is also a leaf of the tree; rename that leaf, or"
              f" leave {spec.name!r} out of layer_axis.")
        shape = list(spec.shape)
        if piece.axis is not None:
          shape[piece.axis] = piece.stop - piece.start
        specs.append(ParameterSpec(piece.name, spec.dtype, tuple(shape)))
    return Schema(tuple(specs), treedef=self.treedef, leaf_names=self.leaf_names,
                  pieces=pieces, source=self)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(p.name for p in self.parameters)

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.parameters)

  def __iter__(self) -> Iterator[ParameterSpec]:
    return iter(self.parameters)

  def __len__(self) -> int:
    return len(self.parameters)

  def __contains__(self, name: object) -> bool:
    return name in self._index

  def __getitem__(self, name: str) -> ParameterSpec:
    return self.parameters[self._index[name]]

  def subset(self, names: Iterable[str]) -> Schema:
    """The specs of ``names`` (a fragment), as a schema of its own."""
    wanted = set(names)
    missing = wanted - self._index.keys()
    if missing:
      raise KeyError(f"names not in the schema: {sorted(missing)}")
    return Schema(tuple(p for p in self.parameters if p.name in wanted))

  def flatten(self, tree: Any) -> MutableMapping[str, Any]:
    """The leaves of ``tree`` (structured like this schema's source) by name.

    For a cut schema, the pieces (``gmjax.core.layers.Pieces``: sliced when read).
    """
    if self.source is not None:
      return Pieces(self.source.flatten(tree), self.pieces)
    if self.treedef is None:
      raise ValueError("This schema was not built from a tree; use Schema.from_tree.")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef != self.treedef:
      raise ValueError(
          f"tree structure {treedef} does not match the schema's {self.treedef}; pass a"
          " tree shaped like the parameters the run was created with."
      )
    return dict(zip(self.leaf_names, leaves))

  def unflatten(self, entries: Mapping[str, Any]) -> Any:
    """The tree of this schema's source structure holding ``entries[name]`` at each leaf.

    For a cut schema, ``entries`` holds pieces (a ``Pieces`` or a dict of every piece).
    """
    if self.source is not None:
      if not isinstance(entries, Pieces):
        missing = [n for n in self.names if n not in entries]
        if missing:
          raise KeyError(f"entries lack pieces {missing}")
        pieces, entries = entries, Pieces({}, self.pieces)
        for name, value in pieces.items():
          entries[name] = value
      return self.source.unflatten(entries.leaves())
    if self.treedef is None:
      raise ValueError("This schema was not built from a tree; use Schema.from_tree.")
    missing = [n for n in self.leaf_names if n not in entries]
    if missing:
      raise KeyError(f"entries lack leaves {missing}")
    return jax.tree_util.tree_unflatten(self.treedef, [entries[n] for n in self.leaf_names])

  def check(self, tree: Any, *, what: str = "params") -> dict[str, Any]:
    """Flattens ``tree`` and checks each leaf's shape and dtype against the schema
    (float64 is taken as F32).

    Raises:
      ValueError: a leaf of another shape, of another float dtype, or not a float.
    """
    if self.source is not None:
      return Pieces(self.source.check(tree, what=what), self.pieces)
    flat = self.flatten(tree)
    for spec in self.parameters:
      leaf = flat[spec.name]
      if tuple(leaf.shape) != spec.shape:
        raise ValueError(
            f"{what}: leaf {spec.name!r} has shape {tuple(leaf.shape)}, expected"
            f" {spec.shape}."
        )
      dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
      code = dtype_code(dtype, what=f"{what}: leaf {spec.name!r}")
      if code != spec.dtype:
        raise ValueError(
            f"{what}: leaf {spec.name!r} has dtype {dtype}, expected"
            f" {np.dtype(NUMPY_DTYPES[spec.dtype])} (the schema's {spec.dtype}); cast it"
            " back to the dtype the run was created with.")
    return flat

  def to_json(self) -> list[list[Any]]:
    return [[p.name, p.dtype, list(p.shape)] for p in self.parameters]

  @classmethod
  def from_json(cls, record: Iterable[Iterable[Any]]) -> Schema:
    specs = []
    for entry in record:
      try:
        name, dtype, shape = entry
      except (TypeError, ValueError):
        raise ValueError(f"a stored schema's entry must be [name, dtype, shape], got"
                         f" {entry!r}") from None
      if dtype not in NUMPY_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} for {name!r} in a stored schema")
      specs.append(ParameterSpec(str(name), str(dtype), tuple(shape)))
    return cls(tuple(specs))


def _derived_bases(name: str) -> Iterator[str]:
  if name.startswith(MOMENTUM):
    yield name[len(MOMENTUM):]
  if name.startswith(MASTER):
    yield name[len(MASTER):]
  if name.endswith(SCALE):
    yield name[: -len(SCALE)]
  if name.endswith(INDEX):
    yield name[: -len(INDEX)]
