"""The exchange under ``shard_map`` with only the learners' axis manual: compile-only.

``gmjax.diloco`` on a ``(learner=M, fsdp=2)`` mesh, stepped as
``jit(shard_map(step, axis_names={"learner"}))`` (XLA partitions ``fsdp``), one leaf of
4096 F32 parameters a learner with its rows split over ``fsdp``, compiled at a sync
step (the step count folded in). The exchange's collectives run on each device's own
rows (``gmjax.transform.collectives``), so:

* the collective instructions of the step are the same at ``M = 2`` and ``M = 4``
  (they were ``M − 1`` ``ppermute``s for each array exchanged), and none gathers over
  ``fsdp``;
* what one learner's devices send per sync is the README's bound
  ``(M−1)/M · (b_delta + b_publish) · n`` plus the screening's few statistics, read from
  the compiled step (a collective in a loop counted once a turn).
"""

import collections
import functools

import pytest
from jax.sharding import AxisType

from gmjax.transform import hlo

import bench_support

FSDP, N = 2, 4096  # (64, 64): whole rows of 32·M on each fsdp device for M ≤ 4


partially_manual = bench_support.load("partially_manual")


@functools.cache
def _compiled(learners, shard_outer, axis_type=AxisType.Auto):
  """The compiled text of a sync step (F8_E4M3 deltas, Θ at F32), and its mesh."""
  return partially_manual.compiled(learners, "F8_E4M3", shard_outer, N,
                                   explicit=axis_type == AxisType.Explicit)


# On an explicit mesh JAX replicates the operands' fsdp split at the boundary of a
# partially manual shard_map (tests/test_transform_fsdp.py): not the step's own.
_BOUNDARY = "jit(step)/shard_map"


def _instructions(text):
  """The step's collective instructions by op (a tuple collective once)."""
  return collections.Counter(op for _, op in {(c.name, c.op)
                                              for c in hlo.collective_bytes(text)
                                              if c.op_name != _BOUNDARY})


@pytest.mark.parametrize("shard_outer,axis_type", [
    (True, AxisType.Auto), (False, AxisType.Auto), (True, AxisType.Explicit),
], ids=["sharded-auto", "replicated-auto", "sharded-explicit"])
def test_collectives_do_not_grow_with_learners(shard_outer, axis_type):
  two, _ = _compiled(2, shard_outer, axis_type)
  four, mesh = _compiled(4, shard_outer, axis_type)
  assert _instructions(four) == _instructions(two)
  # The token counts' gather, the deltas' codes and scales (all_to_all or ring), the
  # screening's sums, Θ's codes: a few, whatever M.
  assert sum(_instructions(four).values()) <= 12, _instructions(four)
  permutes = [c for c in hlo.collective_bytes(four) if c.op == "collective-permute"]
  assert len(permutes) <= 2  # the replicated exchange's ring (codes, scales) on Auto
  assert [c for c in hlo.collective_bytes(four) if c.op == "all-gather" and any(
      hlo.spanned_axes(mesh, g) - {"learner"} for g in c.groups)
          and c.op_name != _BOUNDARY] == []


@pytest.mark.parametrize("learners", [2, 4])
def test_sync_bytes_within_the_bound(learners):
  text, _ = _compiled(learners, True)
  trips = hlo.trip_counts(text)
  found = hlo.collective_bytes(text)
  sent = sum(c.bytes_sent * trips.get(c.computation, 1) for c in found)
  by_learner = FSDP * sent  # each device sends its own rows' part
  bound = (learners - 1) / learners * (1.125 + 4.0) * N
  # The Gram matrix's and token counts' psums over the learners, and their partial sums
  # over fsdp.
  statistics = 2 * FSDP * (2 * 4 * (learners**2 + 2) + 8 * learners)
  print(f"M={learners}: {by_learner:.0f} bytes a learner, bound {bound:.0f} + {statistics}")
  assert bound <= by_learner <= bound + statistics
