"""A fragment's merge: its learner's θ aligned to the fragment's new anchor.

``gmjax.transform.rounds`` runs it where a fragment's pending code says (``MERGE``: with
``mixing``, ``RESET``: the round was skipped, to the anchor), ``overlap_steps`` after
the sync, or at the fragment's next sync where a changed schedule left it pending.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gmjax.core import outer
from gmjax.transform import explicit
from gmjax.transform import finite as finite_steps
from gmjax.transform.state import MERGE, NOTHING


def difference(theta: jax.Array, params: jax.Array, update: jax.Array) -> jax.Array:
  """The update that takes ``params`` to ``theta``, at ``update``'s dtype."""
  return (theta.astype(jnp.float32) - params.astype(jnp.float32)).astype(update.dtype)


def piece_theta(layout, n, updates, params):
  """``θ`` of piece ``n``, at the parameter dtype, as ``optax.apply_updates`` forms it."""
  piece = layout.pieces[n]
  return finite_steps.applied(piece.take(params[piece.leaf]), piece.take(updates[piece.leaf]))


def merge_of(layout, config, names, code):
  """The merge of a fragment (its piece ``names``) by its pending ``code``: its learner's θ
  aligned to the anchor (or the start, with a delay) read with the parameters; with
  nothing pending, the updates as they are. ``merge(updates, (flat_params,
  flat_anchor))`` returns the flat updates."""
  def merge(updates, reads):
    flat_params, flat_anchor = reads
    current = {n: piece_theta(layout, n, updates, flat_params) for n in names}
    target = layout.view(flat_anchor, names)
    mixed = outer.align(current, target, config.mixing)
    reset = outer.align(current, target, 0.0)
    thetas = {n: explicit.where(code == MERGE, mixed[n], reset[n]) for n in names}
    params, pieces = layout.view(flat_params, names), layout.view(updates, names)
    new = dict(updates)
    layout.write(new, {n: explicit.where(code == NOTHING, pieces[n],
                                         difference(thetas[n], params[n], pieces[n]))
                       for n in names})
    return new

  return merge
