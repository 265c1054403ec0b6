"""Bytes that the collectives of a compiled step send, read from its HLO text.

A jaxpr says which collectives a function asks for; the compiled step says what crosses
the wire: XLA combines collectives into tuples, decomposes reshards, and on some
backends widens narrow types (on CPU, float8 and bf16 collectives travel as f16 and f32).
``collective_bytes`` therefore reads the text of a *compiled* step,
``jax.jit(f).lower(*args).compile().as_text()``, and returns one ``Collective`` per
buffer (a collective over a tuple gives one per element).

Bytes sent per device follow the ring (bandwidth-optimal) model, with ``G`` devices in
the replica group and ``B`` the buffer's bytes on one device:

=====================  ==================================  ===========================
op                     ``B`` is                            bytes sent per device
=====================  ==================================  ===========================
all-reduce             the operand (= result)              ``2(G−1)/G · B``
all-gather             the result (G operands)             ``(G−1)/G · B``
reduce-scatter         the operand (G results)             ``(G−1)/G · B``
all-to-all             the operand (= result)              ``(G−1)/G · B``
collective-permute     the operand (= result)              ``B`` (0 if only self-pairs)
=====================  ==================================  ===========================

Asynchronous forms (``all-gather-start``, ``all-reduce-start``,
``collective-permute-start``, and the sugared ``async-start`` of any of these, e.g.
``reduce-scatter-start``) count once, at their start; the ``-done`` halves count nothing.
The figures are static: a collective inside a ``while`` body counts once, and every branch
of a ``conditional`` counts, whichever runs; ``Collective.computation`` and ``op_name``
(the JAX metadata) tell them apart, and ``trip_counts`` gives the turns of each loop
whose count XLA knows (a ``fori_loop`` with static bounds).

Replica groups come as explicit lists (``{{0,1},{2,3}}``), iota tiles
(``[2,4]<=[8]``, ``[4,2]<=[2,4]T(1,0)``: groups of 4 and of 2), mesh axes
(``mesh['a'=2,'b'=4] {'b'}``, sub-axes ``{'b':(2)2}``), or empty (``{}``: every device of
the module, ``replica_count × num_partitions``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["Collective", "collective_bytes", "spanned_axes", "total_bytes_sent",
           "trip_counts"]

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bits per element of every HLO element type a collective may carry.
_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f4e2m1fn": 4, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8,
    "f8e4m3fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One buffer that one collective instruction of a compiled step moves.

  Attributes:
    name: the HLO instruction's name; buffers of one tuple collective share it.
    op: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
      ``"collective-permute"`` (an async ``-start`` form gives the same op).
    is_async: whether the instruction was a ``-start`` form.
    dtype: the HLO element type, e.g. ``"f32"``, ``"u8"``, ``"f8e4m3fn"``.
    shape: the buffer's shape in the instruction's result, on one device.
    group_size: devices in each replica group (None for a collective-permute).
    bytes: ``B`` of the model in the module docstring (for a reduce-scatter, the
      operand's bytes, ``G`` times the result's).
    bytes_sent: bytes one device sends for this buffer under that model.
    computation: the HLO computation holding the instruction.
    op_name: JAX's ``op_name`` metadata, or ``""``.
    groups: the replica groups as device ids (``()`` for a collective-permute, or groups
      over mesh sub-axes).
  """

  name: str
  op: str
  is_async: bool
  dtype: str
  shape: tuple[int, ...]
  group_size: int | None
  bytes: int
  bytes_sent: float
  computation: str
  op_name: str
  groups: tuple[tuple[int, ...], ...] = ()


def spanned_axes(mesh: Any, group: Iterable[int]) -> set[str]:
  """The axes of ``mesh`` along which the devices of a replica group (ids) differ."""
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  coords = np.array([np.argwhere(ids == d)[0] for d in group])
  return {name for i, name in enumerate(mesh.axis_names) if len(set(coords[:, i])) > 1}


def total_bytes_sent(collectives: Iterable[Collective], *, ops: Iterable[str] | None = None,
                     ) -> float:
  """Sum of ``bytes_sent`` over ``collectives`` (only those whose ``op`` is in ``ops``)."""
  wanted = None if ops is None else set(ops)
  return float(sum(c.bytes_sent for c in collectives if wanted is None or c.op in wanted))


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
# A computation opens with `[ENTRY] %name (params) -> result {` (compiled) or `name {`.
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER_INT = r"\b{}=(\d+)"
# mesh['a'=2,'b'=4][, device_ids=(...)] {'b', ...}: the group's axes in the last braces.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\].*?\s\{('[^}]*)\}")


def _skip_braces(text: str, i: int) -> int:
  """Index just past the balanced ``{...}`` that starts at ``text[i]``."""
  depth = 0
  while True:
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    i += 1
    if depth == 0:
      return i


def _parse_shape(text: str, i: int):
  """Parses the shape at ``text[i]``: ``(dtype, dims, layout)`` or a list of shapes.

  Returns:
    ``(shape, j)`` with ``j`` the index just past it.
  """
  if text[i] == "(":
    i += 1
    elements = []
    while text[i] != ")":
      element, i = _parse_shape(text, i)
      elements.append(element)
      while text[i] in ", ":
        i += 1
    return elements, i + 1
  match = _ARRAY.match(text, i)
  if match is None:
    raise ValueError(f"collective_bytes: cannot read a shape at {text[i:i + 40]!r}")
  dims = tuple(int(d.lstrip("<=")) for d in match.group(2).split(",") if d)
  j = match.end()
  layout = ""
  if j < len(text) and text[j] == "{":
    end = _skip_braces(text, j)
    layout, j = text[j:end], end
  return (match.group(1), dims, layout), j


def _leaves(shape) -> list[tuple[str, tuple[int, ...], str]]:
  if isinstance(shape, list):
    return [leaf for element in shape for leaf in _leaves(element)]
  return [shape]


def _buffer_bytes(dtype: str, dims: tuple[int, ...], layout: str) -> int:
  if dtype not in _BITS:
    raise ValueError(f"collective_bytes: unknown element type {dtype!r}")
  bits = _BITS[dtype]
  # Sub-byte types are packed only when the layout says so (``E(4)``); else a byte each.
  if bits < 8 and f"E({bits})" not in layout:
    bits = 8
  return math.ceil(math.prod(dims) * bits / 8)


def _attribute(line: str, key: str) -> str | None:
  """The raw text of ``key=...`` in an instruction's attributes, up to the next one."""
  start = line.find(f" {key}=")
  if start < 0:
    return None
  i = start + len(key) + 2
  depth = 0
  j = i
  while j < len(line):
    ch = line[j]
    if ch in "{[(":
      depth += 1
    elif ch in "}])":
      depth -= 1
    elif ch == "," and depth == 0 and re.match(r",\s*[a-z_]+=", line[j:]):
      break
    j += 1
  return line[i:j].strip()


def _group_size(groups: str | None, devices: int, line: str) -> int:
  """Devices per replica group, from any of the forms in the module docstring."""
  if groups is None or groups.replace(" ", "") in ("{}", "{{}}"):
    return devices
  if groups.startswith("{"):
    first = re.match(r"\{\{([^}]*)\}", groups.replace(" ", ""))
    return len(first.group(1).split(",")) if first.group(1) else devices
  if groups.startswith("["):  # iota tile: [groups, size]<=[dims]T(perm)
    return int(groups[1:groups.index("]")].split(",")[-1])
  if groups.startswith("mesh["):
    mesh = _MESH_GROUPS.search(line)
    if mesh is None:
      raise ValueError(f"collective_bytes: cannot read replica_groups={groups!r}")
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
    # A sub-axis 'a':(pre)size has `size` devices.
    axes = mesh.group(2)
    size = 1
    for axis, sub in re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", axes):
      size *= int(sub) if sub else int(sizes[axis])
    return size
  raise ValueError(f"collective_bytes: cannot read replica_groups={groups!r}")


def _iota(text: str) -> np.ndarray:
  """The device ids of an iota tile ``[dims]`` or ``[dims]T(perm)`` (not reshaped)."""
  found = re.fullmatch(r"\[([\d,]*)\](?:T\(([\d,]*)\))?", text.replace(" ", ""))
  if found is None:
    raise ValueError(f"collective_bytes: cannot read the device tile {text!r}")
  dims = [int(d) for d in found.group(1).split(",") if d]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if found.group(2):
    ids = ids.transpose([int(p) for p in found.group(2).split(",")])
  return ids


def _groups(groups: str | None, devices: int, line: str) -> tuple[tuple[int, ...], ...]:
  """The replica groups as device ids, from any of the forms in the module docstring."""
  if groups is None or groups.replace(" ", "") in ("{}", "{{}}"):
    return (tuple(range(devices)),)
  compact = groups.replace(" ", "")
  if compact.startswith("{"):
    return tuple(tuple(int(d) for d in g.split(",") if d)
                 for g in re.findall(r"\{([\d,]*)\}", compact))
  if compact.startswith("["):  # [groups, size]<=[dims]T(perm)
    shape, tile = compact.split("<=")
    sizes = [int(d) for d in shape[1:-1].split(",")]
    return tuple(tuple(int(d) for d in g) for g in _iota(tile).reshape(sizes[0], -1))
  mesh = _MESH_GROUPS.search(line)
  if not compact.startswith("mesh[") or mesh is None:
    raise ValueError(f"collective_bytes: cannot read replica_groups={groups!r}")
  if ":(" in mesh.group(2):
    return ()  # sub-axes: the size is known (``group_size``), the devices are not read
  sizes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
  names = [n for n, _ in sizes]
  shape = [int(d) for _, d in sizes]
  listed = re.search(r"device_ids=\(?(\[[^\]]*\](?:T\([\d,]*\))?)", line)
  ids = (_iota(listed.group(1)).reshape(shape) if listed
         else np.arange(int(np.prod(shape))).reshape(shape))
  axes = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(2))]
  rest = [i for i in range(len(shape)) if i not in axes]
  grouped = ids.transpose(rest + axes).reshape(-1, int(np.prod([shape[a] for a in axes])))
  return tuple(tuple(int(d) for d in g) for g in grouped)


def _sent(op: str, group: int | None, nbytes: int, line: str) -> float:
  if op == "collective-permute":
    pairs = re.findall(r"\{(\d+),(\d+)\}", _attribute(line, "source_target_pairs") or "")
    return float(nbytes) if any(s != t for s, t in pairs) else 0.0
  fraction = (group - 1) / group
  return (2 * fraction if op == "all-reduce" else fraction) * nbytes


def collective_bytes(hlo_text: str) -> list[Collective]:
  """The buffers every collective of an HLO module moves, and the bytes each device sends.

  Args:
    hlo_text: an HLO module's text, normally of a compiled step:
      ``jax.jit(f).lower(*args).compile().as_text()`` (the unoptimized
      ``lower(...).as_text(dialect="hlo")`` parses too, but is not what runs).

  Returns:
    One ``Collective`` per buffer, in the order of the text; see the module docstring for
    the model behind ``bytes_sent``.

  Raises:
    ValueError: if a collective's shape, element type or replica groups cannot be read.
  """
  header = hlo_text[:hlo_text.find("\n")] if "\n" in hlo_text else hlo_text
  devices = 1
  for key in ("replica_count", "num_partitions"):
    found = re.search(_HEADER_INT.format(key), header)
    devices *= int(found.group(1)) if found else 1
  found: list[Collective] = []
  computation = ""
  for raw in hlo_text.splitlines():
    head = _COMPUTATION.match(raw)
    if head and " = " not in raw.split("(", 1)[0]:
      computation = head.group(1)
      continue
    match = _INSTRUCTION.match(raw)
    if match is None:
      continue
    line = _COMMENT.sub("", raw)
    match = _INSTRUCTION.match(line)
    try:
      shape, i = _parse_shape(line, match.end())
    except (ValueError, IndexError):
      continue  # not an instruction with a shape (e.g. a constant's literal text)
    opcode = _OPCODE.match(line, i)
    if opcode is None:
      continue
    op = opcode.group(1)
    is_async = op.endswith("-start")
    op = op.removesuffix("-start")
    if op not in _OPS:
      continue
    if is_async and isinstance(shape, list):
      # `-start` results hold (operands, results, contexts...), except a native
      # all-reduce-start, whose result is its operands' shapes (a tuple of arrays).
      native_all_reduce = op == "all-reduce" and not isinstance(shape[0], list)
      shape = shape if native_all_reduce else shape[1]
    group = None if op == "collective-permute" else _group_size(
        _attribute(line, "replica_groups"), devices, line)
    groups = () if op == "collective-permute" else _groups(
        _attribute(line, "replica_groups"), devices, line)
    op_name = _OP_NAME.search(line)
    for dtype, dims, layout in _leaves(shape):
      nbytes = _buffer_bytes(dtype, dims, layout)
      if op == "reduce-scatter":
        nbytes *= group  # the result is 1/G of the operand
      found.append(Collective(
          name=match.group(1), op=op, is_async=is_async, dtype=dtype, shape=dims,
          group_size=group, bytes=nbytes, bytes_sent=_sent(op, group, nbytes, line),
          computation=computation, op_name=op_name.group(1) if op_name else "",
          groups=groups,
      ))
  return found


_WHILE_BODY = re.compile(r"\swhile\(.*?\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def trip_counts(hlo_text: str) -> dict[str, int]:
  """The turns of each ``while`` loop of a compiled module whose trip count XLA knows.

  A collective of ``collective_bytes`` whose ``computation`` is such a loop's body runs
  that many times a call of the loop; loops nested in it multiply (not done here).

  Args:
    hlo_text: a compiled module's text, as for ``collective_bytes``.

  Returns:
    The trip count by the name of the loop's body computation; loops whose count XLA
    does not know (``backend_config`` without ``known_trip_count``) are left out.
  """
  counts = {}
  for line in hlo_text.splitlines():
    body, trips = _WHILE_BODY.search(line), _TRIP_COUNT.search(line)
    if body and trips:
      counts[body.group(1)] = int(trips.group(1))
  return counts
