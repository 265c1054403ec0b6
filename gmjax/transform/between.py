"""The update of a step between rounds: ``update(..., between_rounds=True)``.

Every update of ``gmjax.diloco`` may run round work (the first update's alignment, a
fragment's sync, its merge), so its program holds the round in loops that run once or
not at all (``gmjax.transform.control``). XLA must then write the inner optimizer's
updates out for the loops to read, where plain optax computes them inside the fusion
of the user's ``optax.apply_updates``: a parameter-sized buffer and about three
parameter-sized passes a step. Most steps do no round work, and which ones do is known
on the host from the step count (``RoundSchedule.due``), so a caller may compile a
second program for them, one without the round: the inner step, the finiteness check
and the counters: no loop, and nothing that crosses the learners' axis.

Such a program is only correct on a step that is not due. On a step that is, it drops
the step: the updates are zero, DiLoCo's state is left as it was (its count too, so the
next call meets the same step), the inner optimizer takes the step as it takes any
dropped one, and ``stats.dropped`` counts it, so that a wrong host count wastes a step
instead of skipping a round.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gmjax.transform import explicit, structure


class Schedule(NamedTuple):
  """What the step count says of an update: the global step it makes (``step``,
  ``count + 1``), ``first`` (the alignment), the 1-based fragment that syncs
  (``sync_index``, 0: none) and the one that merges (``merge_index``)."""
  step: jax.Array
  first: jax.Array
  sync_index: jax.Array
  merge_index: jax.Array

  @property
  def due(self) -> jax.Array:
    """Whether the update does round work (``RoundSchedule.due`` on the host)."""
    return self.first | (self.sync_index > 0) | (self.merge_index > 0)


def schedule(table: structure.SyncTable, tau: int, count: jax.Array) -> Schedule:
  """The round work of the update at state count ``count`` (``t = count + 1``)."""
  sync_every = table.sync_every
  t = optax.safe_int32_increment(count)
  merge_index = jnp.where(t > tau, structure.lookup(table, (t - tau) % sync_every), 0)
  return Schedule(t, count == 0, structure.lookup(table, t % sync_every), merge_index)


def update(state: Any, schedule_: Schedule, inner_updates: Any, inner_state: Any,
           dropped: jax.Array, counts: jax.Array, stats: Any) -> tuple[Any, Any]:
  """The updates and state of a step between rounds (``state`` a ``DiLoCoState``).

  ``inner_updates``, ``inner_state``, ``counts`` and ``stats`` are what the step made of
  the inner step, its tokens and its finiteness check (``dropped``); every choice below
  is a select that XLA fuses into the computation of its value. ``schedule_``: the
  step's ``Schedule``.
  """
  due = schedule_.due
  # ``dropped | due`` as the larger of the two by a sort, which XLA does not fuse into
  # the sort's readers: it would otherwise fuse the check's sum over every leaf into
  # each leaf's select, a program quadratic in the leaf count. (An optimization barrier
  # is gone before fusion; a loop would need every learner's predicate under ``vmap``,
  # a collective.)
  skip = jnp.sort(jnp.stack([dropped, due]))[-1]
  updates = jax.tree.map(lambda u: explicit.where(skip, jnp.zeros_like(u), u), inner_updates)
  keep = lambda new, old: explicit.where(due, old, new)
  stats = jax.tree.map(keep, stats, state.stats)
  stats = stats._replace(dropped=stats.dropped + due.astype(stats.dropped.dtype))
  return updates, state._replace(
      inner_state=inner_state,
      count=keep(schedule_.step, state.count),
      tokens=keep(counts, state.tokens),
      stats=stats,
  )
