"""``gmjax.DiLoCo``: the algorithm's configuration and its fragment plan.

The configuration only: the aggregator that closes a round, and a fragment's version 0,
are ``gmjax.core.aggregator.DiLoCoAggregator``'s.

References:
  Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language
  Models*, arXiv 2311.08105.
  Douillard et al., *Streaming DiLoCo with overlapping communication*, arXiv 2501.18512.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import numbers
from collections.abc import Mapping
from typing import Any, Self

import optax

from gmjax.core import diloco_checks, feedback, guards, layers, outer, robust
from gmjax.core.frozen import json_hash
from gmjax.core.records import Precision
from gmjax.core.schedule import RoundSchedule
from gmjax.core.schema import Schema
from gmjax.core.wire import Wire


CUSTOM = "custom"
"""``DiLoCo.outer`` when the outer optimizer is given in code: ``gmjax.diloco(...,
outer=tx)``."""
_LEFT_OUT = {"error_feedback": None, "layer_axis": None, "outer_delay": 0, "eager": False,
             "adaptive_steps": False, "aggregation": robust.MEAN, "trim": 1,
             "outlier_factor": guards.OUTLIER_FACTOR}
"""Fields a configuration's record leaves out at these values (``DiLoCo.to_json``)."""


@dataclasses.dataclass(frozen=True)
class DiLoCo:
  """DiLoCo and Streaming DiLoCo: the configuration every gmjax runtime shares.

  Learners train ``sync_every`` (``H``) inner steps, then exchange the pseudo-gradient
  ``Δ = anchor − θ``; the outer optimizer (Nesterov SGD by default) applies the
  token-weighted mean of the deltas to an F32 master. With ``fragments = P > 1`` the
  parameters sync in ``P`` staggered fragments (Streaming DiLoCo).

  Attributes:
    sync_every: ``H``, inner steps between two syncs of a fragment.
    fragments: ``P``, ``1 <= P <= H``; the plan uses ``min(P, #leaves)``, or with
      ``layer_axis`` ``min(P, L)`` blocks of the ``L`` stacked layers.
    outer_learning_rate: ``η`` of the outer SGD (0.7 in the paper).
    outer_momentum: ``μ`` of the outer SGD, in ``[0, 1)`` (0.9 in the paper).
    nesterov: Nesterov momentum (the paper's choice) or plain momentum.
    delta_precision: how deltas travel (None: the parameter dtype).
    delta_topk: None sends deltas dense; ``k`` sends, per chunk of ``delta_chunk`` values
      of each flattened leaf, the ``k`` largest magnitudes (at ``delta_precision``) and
      their indices within the chunk (``gmjax.core.sparse``).
    delta_chunk: the chunk length of ``delta_topk``, at least ``delta_topk``.
    commit_precision: None publishes Θ; otherwise commits carry ``master − Θ_old`` at it.
    mixing: the share of its local θ a learner keeps when it aligns, in ``[0, 1)``.
    overlap_steps: ``τ``, steps trained past publishing before merging a round's commit;
      ``0`` is classic DiLoCo, ``None`` (mail only) bounds waiting by ``in_flight``.
    in_flight: rounds a learner may keep outstanding (mail): one that is to publish a
      round while ``in_flight`` of its rounds await their merges merges the oldest first,
      before its ``overlap_steps`` are up (in-mesh learners, which ignore it, merge every
      round ``overlap_steps`` past its sync). ``⌈overlap_steps / ⌊sync_every /
      fragments⌋⌉`` rounds train as in-mesh.
    quorum_size: contributions that can close a round after the grace period (mail).
    flush_on_close: a leaving learner publishes its last steps as final contributions.
    global_batch_size: the batch the live learners share (mail).
    outer: the outer optimizer, an optax alias by name (``"sgd"``, ``"adam"``,
      ``"lion"``, ...), applied to the outer gradient ``g`` as a gradient:
      ``master ← master + outer.update(g, state, master)``. It must be elementwise to be
      sharded in-mesh (``gmjax.diloco(..., shard_outer=True)``, the default there).
      ``"custom"``: the outer optimizer is given in code, ``gmjax.diloco(inner, config,
      outer=tx)`` (in-mesh only: mail learners build the outer step from the config, and
      ``eager`` needs the config's SGD); ``outer_learning_rate``, ``outer_momentum``,
      ``nesterov`` and ``outer_options`` must then keep their defaults, since they would
      not be used.
    outer_options: JSON keyword arguments of ``optax.<outer>``; a value
      ``{"schedule": NAME, ...}`` is ``optax.NAME(...)`` (e.g. a learning-rate
      schedule). With ``outer="sgd"`` the defaults are ``learning_rate=
      outer_learning_rate, momentum=outer_momentum, nesterov=nesterov`` (DiLoCo's
      Nesterov SGD); for any other ``outer`` only ``learning_rate`` defaults to
      ``outer_learning_rate`` (where ``optax.<outer>`` takes one: ``polyak_sgd``
      takes ``max_learning_rate``), and ``outer_momentum``/``nesterov`` are not used.
    error_feedback: ``β`` in ``(0, 1]``, or None (off). Each learner keeps an F32
      residual ``e`` of every fragment, publishes ``q = encode(β·e + Δ)`` and keeps
      ``e ← β·e + Δ − decode(q)``, so what quantization drops from one delta travels
      with the next ones. It needs deltas that travel lossily (a quantized or 16-bit
      ``delta_precision``, None with 16-bit parameters, or top-k sparse deltas at any
      precision) and costs 4 bytes per parameter on each learner. In mail
      mode the residuals live in the learner's memory: a restarted learner starts from
      zero.
    outer_delay: ``0`` (DiLoCo) or ``1``: delayed outer gradients (Kale et al.). A
      learner that sends the delta of an inner phase does not wait for its round: it
      starts the next phase from the previous round's Θ, so the outer step that uses
      round ``k``'s aggregate shapes the start of phase ``k + 2``, and the exchange has a
      whole inner phase to finish. Each delta is ``start − θ``, from the phase's own start.
      It needs ``overlap_steps=0`` and ``mixing=0``.
    eager: with ``outer_delay=1``, eager updates (Kale et al.): each learner also runs
      the outer step on its own fresh delta in place of its stale one, so its start is
      ``outer(Θ, g_{k−1} − w·Δ_{m,k−1} + w·Δ_{m,k})`` (``gmjax.core.eager``). It needs
      the outer SGD at a constant learning rate, and costs 16 bytes per parameter on
      each learner.
    layer_axis: None, or a JSON mapping from a leaf path prefix to the axis its leaves
      stack layers on (``{"layers": 0}`` for flax ``nnx.scan``, ``{"decoder/layers": 1}``
      for MaxText's ``scan_layers``). Fragments are then contiguous blocks of layers
      (Streaming DiLoCo): each stacked leaf is cut into ``B = min(P, L)`` pieces, piece
      ``b`` holding layers ``[⌊b·L/B⌋, ⌊(b+1)·L/B⌋)`` as a leaf named
      ``<leaf>[start:stop]`` (on the wire, in mail payloads and in the state), fragment
      ``b`` holds block ``b`` of every stacked leaf, and the other leaves join the
      lightest fragments (``plan``). Every stacked leaf must hold the same ``L``.
    aggregation: how a round combines the kept deltas (``gmjax.core.robust``):
      ``"mean"``, the token-weighted mean (every learner with a valid key is trusted);
      ``"clipped_mean"``, each delta's norm clipped to the round's median norm and each
      token weight capped at the median weight, then renormalized; ``"trimmed_mean"``,
      per coordinate the ``trim`` largest and ``trim`` smallest values dropped and the
      rest averaged with equal weights (the coordinate-wise median when fewer than
      ``2·trim + 1`` deltas are kept). Not with ``eager``, whose correction assumes the
      mean.
    trim: values ``"trimmed_mean"`` drops from each side of every coordinate: at least
      the number of colluding attackers it must withstand.
    outlier_factor: the screening before any rule: a delta whose norm is more than this
      many times the lower median of the learners' is rejected, and a token count
      above it clamped (``gmjax.core.guards``). None rejects only non-finite deltas:
      DiLoCo exactly, for a trusted pool whose honest deltas may differ that much (of
      two learners, the larger of two deltas 10x apart is rejected).
    adaptive_steps: (mail only) learners train for the same wall time per round instead
      of the same number of steps. A round's deadline follows the fastest live learner's
      pace (``sync_every / fragments`` of its steps, ``gmjax.mail.pace``); every learner
      publishes at the deadline what it has trained (at least one step, at most the
      round's scheduled steps), weighted by its tokens, so a slower learner makes no one
      wait. ``Learner.step_count`` stays on the schedule (it jumps to the round's step
      when a round is published early) and ``Learner.local_step`` counts the steps
      trained. In-mesh training (``gmjax.diloco``) refuses it: its learners step in
      lockstep.

  Example:
    >>> import numpy as np
    >>> import gmjax
    >>> config = gmjax.DiLoCo(sync_every=8, fragments=2, delta_precision="I4")
    >>> params = {"w": np.zeros((4, 4), np.float32), "b": np.zeros(4, np.float32)}
    >>> config.plan(gmjax.Schema.from_tree(params))  # the leaves of each fragment
    (('b',), ('w',))
    >>> schedule = config.schedule(2)  # round r syncs fragment r mod 2 at step_of(r)
    >>> [schedule.step_of(r) for r in range(4)]
    [4, 8, 12, 16]

  References:
    Douillard et al., arXiv 2311.08105; Douillard et al., arXiv 2501.18512; Kale,
    Douillard and Donchev, *Eager Updates For Overlapped Communication and Computation
    in DiLoCo*, arXiv 2502.12996.
  """

  sync_every: int
  fragments: int = 1
  outer_learning_rate: float = 0.7
  outer_momentum: float = 0.9
  nesterov: bool = True
  delta_precision: Precision = None
  commit_precision: Precision = None
  mixing: float = 0.0
  overlap_steps: int | None = 0
  in_flight: int = 1
  quorum_size: int | None = None
  flush_on_close: bool = True
  global_batch_size: int | None = None
  outer: str = "sgd"
  outer_options: Mapping[str, Any] | None = None
  error_feedback: float | None = None
  delta_topk: int | None = None
  delta_chunk: int = 4096
  outer_delay: int = 0
  eager: bool = False
  layer_axis: Mapping[str, int] | None = None
  aggregation: str = robust.MEAN
  trim: int = 1
  adaptive_steps: bool = False
  outlier_factor: float | None = guards.OUTLIER_FACTOR

  def __post_init__(self):
    """Checks every field as the configuration is made (``gmjax.core.diloco_checks``)."""
    diloco_checks.check_fields(self)
    if self.outer == CUSTOM:
      diloco_checks.check_custom_outer(self)
    else:
      self.outer_transform()  # fails now, naming the argument, rather than at the first round
    diloco_checks.check_exchange(self)

  def check_parameters(self, schema: Schema) -> None:
    """Checks what the configuration needs of the parameters of ``schema``.

    Raises:
      ValueError: ``error_feedback`` with deltas that travel exactly (F32), or a
        ``layer_axis`` that does not fit the leaves (``cut``, which also raises).
    """
    self.cut(schema)
    feedback.check_schema(self.error_feedback, self.delta_wire, schema)

  def cut(self, schema: Schema) -> Schema:
    """The schema whose leaves the fragments hold: ``schema`` itself, or with
    ``layer_axis`` its stacked leaves cut into ``min(P, L)`` blocks of layers
    (``gmjax.core.layers``). A schema already cut is cut again from its source, as
    this configuration cuts it (another one's blocks would give another plan).

    Raises:
      TypeError: ``schema`` is not a ``gmjax.Schema`` (params: ``Schema.from_tree``).
      ValueError: ``layer_axis`` does not fit ``schema`` (``layers.stacked_leaves``).
    """
    if Schema.given(schema, "DiLoCo.plan").source is not None:
      schema = schema.source
    if self.layer_axis is None:
      return schema
    shapes = {p.name: p.shape for p in schema.parameters}
    axes = layers.stacked_leaves(shapes, self.layer_axis)
    count = next(shapes[n][a] for n, a in axes.items())
    return schema.cut(layers.cut(shapes, axes, min(self.fragments, count)))

  @property
  def delta_wire(self) -> Wire:
    """How deltas travel: ``delta_precision``, dense or top-``delta_topk``."""
    return Wire(self.delta_precision, self.delta_topk, self.delta_chunk)

  @property
  def rule(self) -> robust.Rule:
    """How a round screens and combines deltas: ``aggregation``, ``trim``,
    ``outlier_factor``."""
    return robust.Rule(self.aggregation, self.trim, self.outlier_factor)

  @property
  def commit_wire(self) -> Wire:
    """How commits travel: ``commit_precision`` (None: Θ itself), dense."""
    return Wire(self.commit_precision)

  def delta_layout(self, schema: Schema) -> Schema:
    """The payload layout of ``schema``'s deltas (``delta_wire.layout``)."""
    return self.delta_wire.layout(schema, "DiLoCo.delta_layout")

  def __hash__(self):
    # Equal configurations hash alike: ``outer_learning_rate=1`` equals ``1.0``.
    return json_hash(self.to_json())

  def _refuse_custom(self, what: str) -> None:
    if self.outer == CUSTOM:
      raise ValueError(
          f"DiLoCo.{what}: outer='custom' means the outer optimizer is given in code,"
          " gmjax.diloco(inner, config, outer=tx), so the configuration cannot build it;"
          " name an optax optimizer in outer (e.g. outer='sgd') to build it from the"
          " configuration.")

  def outer_description(self) -> str:
    """What the configuration says the outer optimizer is, for messages: e.g.
    ``config.outer='sgd' (learning_rate 0.7, momentum 0.9, nesterov)``."""
    if self.outer == CUSTOM:
      return "config.outer='custom' (given in code)"
    parts = []
    for name, value in self.outer_arguments().items():
      if value is True:
        parts.append(name)
      elif value is False:
        parts.append(f"no {name}")
      elif isinstance(value, Mapping):
        parts.append(f"{name} {json.dumps(dict(value), sort_keys=True)}")
      else:
        parts.append(f"{name} {value!r}")
    return f"config.outer={self.outer!r} ({', '.join(parts)})"

  def outer_arguments(self) -> dict[str, Any]:
    """The keyword arguments ``optax.<outer>`` is built with (defaults filled in).

    Raises:
      ValueError: ``outer='custom'`` (the optimizer is given in code).
    """
    self._refuse_custom("outer_arguments")
    defaults: dict[str, Any] = {}
    if outer.takes(self.outer, "learning_rate"):
      defaults["learning_rate"] = float(self.outer_learning_rate)
    if self.outer == "sgd":
      defaults.update(momentum=float(self.outer_momentum), nesterov=self.nesterov)
    return {**defaults, **dict(self.outer_options or {})}

  def outer_transform(self) -> optax.GradientTransformation:
    """The outer optimizer as an optax transformation (``optax.<outer>(**options)``).

    Raises:
      ValueError: ``outer='custom'``: the optimizer is given in code, to ``gmjax.diloco``.
    """
    self._refuse_custom("outer_transform")
    return outer.transformation(self.outer, self.outer_arguments())

  # The ``gmjax.core.records.Algorithm`` protocol, which the mail runtime drives.

  def schedule(self, fragments: int | Schema | None = None) -> RoundSchedule:
    """The round schedule of a fragment plan.

    The plan has ``min(P, #leaves)`` fragments (``min(P, L)`` with ``layer_axis``), so
    a model with fewer syncs on fewer, more widely spaced, rounds: pass the state, the
    schema or the plan's length to get the schedule runtimes follow.

    Args:
      fragments: a ``gmjax.diloco`` state (learners stacked or not): the schedule of the
        plan it holds; a ``Schema``: of ``plan(schema)``; an int: the count of a plan, in
        ``[1, fragments]`` (``len(plan)``); None: the configured ``fragments`` itself,
        the plan's count only for a model with at least that many leaves (layers).

    Returns:
      The ``RoundSchedule`` (``sync_every``, that count, ``in_flight``, ``overlap_steps``).

    Raises:
      ValueError: a count outside ``[1, fragments]``, or none of the above.
    """
    pending = getattr(fragments, "pending", None)  # a DiLoCoState: a counter a fragment
    fragments = fragments if pending is None else pending.shape[-1]
    if fragments is None:
      count = self.fragments
    elif isinstance(fragments, Schema):
      count = len(self.plan(fragments))
    elif isinstance(fragments, bool) or not isinstance(fragments, numbers.Integral) or not (
        1 <= fragments <= self.fragments):  # a numpy integer too
      raise ValueError(
          f"DiLoCo.schedule(fragments={guards.quote(fragments)}): pass the gmjax.diloco"
          f" state{diloco_checks.state_inside(fragments)}, the Schema of the parameters"
          " (gmjax.Schema.from_tree(params)), or the number of fragments of the plan, an"
          f" int in [1, {self.fragments}] (len(config.plan(schema))).")
    else:
      count = int(fragments)
    return RoundSchedule(sync_every=self.sync_every, fragments=count,
                         in_flight=self.in_flight, overlap_steps=self.overlap_steps)

  def plan(self, schema: Schema) -> tuple[tuple[str, ...], ...]:
    """Partitions the leaves into ``min(P, #leaves)`` fragments of near-equal bytes
    (with ``layer_axis``, ``min(P, L)``: one a block of the ``L`` stacked layers).

    Greedy: leaves from the largest (ties by name) go to the lightest fragment (ties by
    index). Deterministic; every leaf lands in exactly one fragment; each fragment's names
    are sorted and fragments are ordered by their first name.

    With ``layer_axis`` the names are those of ``cut(schema)``: fragment ``b`` starts
    with block ``b`` of the stacked leaves (fragments in layer order), then the other
    leaves go greedily, as above, to the lightest fragment.
    """
    schema = self.cut(schema)
    bins: list[list[str]]
    if schema.pieces is None:
      count = min(self.fragments, len(schema))
      bins = [[] for _ in range(count)]
      rest = schema.parameters
    else:
      stacked = [ps for ps in schema.pieces.values() if ps[0].axis is not None]
      count = len(stacked[0])
      bins = [[ps[b].name for ps in stacked] for b in range(count)]
      rest = [schema[ps[0].name] for ps in schema.pieces.values() if ps[0].axis is None]
    heap = [(sum(schema[n].nbytes for n in b), i) for i, b in enumerate(bins)]
    heapq.heapify(heap)
    for spec in sorted(rest, key=lambda p: (-p.nbytes, p.name)):
      load, index = heapq.heappop(heap)
      bins[index].append(spec.name)
      heapq.heappush(heap, (load + spec.nbytes, index))
    plan = tuple(tuple(sorted(b)) for b in bins)
    return plan if schema.pieces is not None else tuple(sorted(plan))

  @property
  def delta_dtype(self) -> Precision:
    return self.delta_precision

  @property
  def commit_dtype(self) -> Precision:
    return self.commit_precision

  def quorum(self) -> int:
    return 1 if self.quorum_size is None else self.quorum_size

  def global_batch(self) -> int | None:
    return self.global_batch_size

  def keeps_master(self, dtype: str) -> bool:
    """Whether a leaf of ``dtype`` needs a ``master.<name>`` beside its published Θ."""
    return dtype != "F32" or self.commit_precision is not None

  def to_json(self) -> dict[str, Any]:
    record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    if record["outer_options"] is not None:
      record["outer_options"] = json.loads(json.dumps(dict(record["outer_options"])))
    if record["layer_axis"] is not None:
      record["layer_axis"] = dict(record["layer_axis"])
    for name, default in _LEFT_OUT.items():
      # Left out at their defaults: the record of a configuration without them reads as
      # before, and from_json takes a record without them as the defaults.
      if record[name] == default:
        del record[name]
    return {"name": "DiLoCo", **record}

  @classmethod
  def from_json(cls, record: Mapping[str, Any]) -> Self:
    """The configuration ``to_json`` gave ``record`` (a dict, ``json.loads`` of its text)."""
    return cls(**diloco_checks.json_fields(record, [f.name for f in dataclasses.fields(cls)]))
