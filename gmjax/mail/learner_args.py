"""Checks of what a user passes to ``Run.join``, ``Learner.pull`` and ``Learner.step``:
each value as the learner uses it, or an error that names the argument, the value and
the fix, raised before anything counts or is written."""

from __future__ import annotations

import functools
import hashlib
import json
import numbers
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gmjax.core import frozen, guards
from gmjax.core.schema import Schema
from gmjax.mail import delayed
from gmjax.mail.contributions import MAX_TOKENS_PER_STEP


def schema_differences(given: Schema, run: Schema, limit: int = 4) -> str:
  """The leaves where ``given`` differs from ``run``: missing, extra, dtype or shape."""
  specs = {p.name: p for p in given.parameters}
  wanted = {p.name: p for p in run.parameters}
  problems = [f"like lacks {n!r}" for n in wanted if n not in specs]
  problems += [f"like has {n!r}, which the run does not" for n in specs if n not in wanted]
  problems += [
      f"leaf {n!r} is {specs[n].dtype} {specs[n].shape}, the run's {p.dtype} {p.shape}"
      for n, p in wanted.items() if n in specs and specs[n] != p]
  shown = "; ".join(problems[:limit])
  return shown + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")


def tokens_value(tokens: Any) -> int | None:
  """``step``'s ``tokens`` as an int, checked before the step counts.

  Raises:
    ValueError: ``tokens`` is not None nor a non-negative integer (an int, a float with
      no fraction, a numpy integer or a 0-d array of one).
  """
  if tokens is None:
    return None
  try:
    good = (not isinstance(tokens, (bool, np.bool_, str, bytes)) and np.ndim(tokens) == 0
            and int(tokens) == tokens and tokens >= 0)
  except (TypeError, ValueError, OverflowError):  # NaN, infinity, not a number
    good = False
  if not good:
    shape = np.shape(tokens) if not isinstance(tokens, (str, bytes)) else ()
    described = (f"{type(tokens).__name__} of shape {shape}" if shape
                 else guards.quote(tokens))
    raise ValueError(
        f"tokens must be a non-negative int or None, got {described}; pass the step's"
        " token count (e.g. int(batch.size)), or None to count 1 a step.")
  if tokens > MAX_TOKENS_PER_STEP:
    # A closer refuses a contribution of more than 2**30 tokens a step: its learner's
    # every contribution would be dropped (a lone learner's rounds never close).
    raise ValueError(
        f"tokens must be at most 2**30 a step, got {int(tokens)}; pass the step's own"
        " token count (e.g. int(batch.size)), not a running total.")
  return int(tokens)


def loss_value(loss: Any) -> float | None:
  """``step``'s ``loss`` as a float (None for a NaN or infinite one), checked before the
  step counts or publishes.

  Raises:
    ValueError: ``loss`` is not None nor one real number (a Python number or a 0-d
      numpy or jax array).
  """
  if loss is None:
    return None
  shape = np.shape(loss) if not isinstance(loss, (str, bytes)) else None
  if shape == () and np.asarray(loss).dtype.kind in "iuf":  # a real number, not a bool
    # A NaN or infinite loss is kept as None: JSON (the heartbeat on storage) has no
    # value for it, and strict readers refuse Python's NaN.
    return float(loss) if np.isfinite(float(loss)) else None
  described = (f"{type(loss).__name__} of shape {shape}" if shape
               else f"{type(loss).__name__} {guards.quote(loss)}")
  raise ValueError(
      f"step(loss=...): loss must be None or a real number, got {described}; pass one"
      " number for the step (e.g. float(losses.mean()) for per-example losses).")


def process_number(argument: str, value: Any) -> int:
  """``value`` as an int (numpy integers included), for ``join``'s process numbers."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
        f"{argument} must be None (from jax) or an int, got {type(value).__name__}"
        f" {guards.quote(value)}; pass jax.process_index() / jax.process_count().")
  return int(value)


def check_position(position: Any) -> Any:
  """``position`` as the JSON value a save holds; ``ValueError`` where it is not JSON.

  numpy and JAX scalars and arrays (a step count kept as ``np.int64``, an offset per
  data shard) are taken as the numbers they hold.
  """
  try:
    return json.loads(json.dumps(position, allow_nan=False, default=frozen.native))
  except (TypeError, ValueError) as error:
    raise ValueError(f"step(position=...): the position must be JSON (numbers, strings,"
                     f" lists, dicts), got {position!r} ({error}); pass e.g. the data"
                     " stream's step or offset as an int.") from error


def check_step(state_dir: Any, name: str, state: Any, position: Any, *,
               restore_checked: bool) -> Any:
  """Checks the ``state`` and ``position`` handed to ``Learner.step``.

  Returns:
    ``position`` as the JSON value a save holds (``check_position``).

  Raises:
    ValueError: with a ``state_dir``, no ``state``, a ``state`` leaf Orbax cannot save,
      or a saved state not ``restore``d first (``restore_checked`` False), or a
      ``position`` that is not JSON; without one, a ``state`` or ``position`` given.
  """
  if state_dir is not None:
    if state is None:
      raise ValueError(f"learner {name!r} has state_dir={state_dir.path!r}:"
                       " pass step(params, state=opt_state, position=...) to save it.")
    if not restore_checked:
      raise ValueError(
          f"learner {name!r}: state_dir={state_dir.path!r} holds a saved"
          " state; call learner.restore(opt_state) after pull() to continue from it, or"
          " join with an empty state_dir to start afresh.")
    check_state(state)
    return check_position(position)
  if state is not None or position is not None:
    raise ValueError(f"learner {name!r}: step(state=..., position=...) needs"
                     " join(..., state_dir=...) to save them.")
  return None


def check_state(state: Any) -> None:
  """Raises a ValueError naming the first leaf of ``state`` that Orbax cannot save: an
  array (numpy or JAX) or a number of numeric dtype. Checked before the step counts;
  Orbax would refuse it after the step had merged a commit."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if isinstance(leaf, (bool, float)) or (isinstance(leaf, int)
                                           and -2**63 <= leaf < 2**63):  # as an int64
      continue
    dtype = getattr(leaf, "dtype", None) if isinstance(
        leaf, (np.generic, np.ndarray, jax.Array)) else None
    if dtype is not None and np.size(leaf) == 0:
      raise ValueError(
          f"step(state=...): leaf state{jax.tree_util.keystr(path)} is an empty array"
          f" (shape {np.shape(leaf)}), which Orbax cannot save; leave it out of the state.")
    if dtype is not None and (jnp.issubdtype(dtype, jnp.number)
                              or jnp.issubdtype(dtype, jnp.bool_)):
      continue
    raise ValueError(
        f"step(state=...): leaf state{jax.tree_util.keystr(path)} is"
        f" {type(leaf).__name__} {guards.quote(leaf)}, which cannot be saved; pass a tree"
        " of arrays and numbers (ints within int64; e.g. the optimizer state"
        " optimizer.init made).")


def one_call_at_a_time(method):
  """A ``Learner`` method (``step``, ``pull``, ``restore``) that raises a RuntimeError
  when called while another of them runs in another thread: the learner's rounds are
  one sequence, and two threads stepping it at once published contributions of wrong
  step counts, then crashed or waited out ``wait_timeout``."""
  @functools.wraps(method)
  def guarded(self, *args, **kwargs):
    if not self._calling.acquire(blocking=False):  # pylint: disable=protected-access
      # Read once, without the lock: the holder may be between taking it and naming itself.
      found = self._holder  # pylint: disable=protected-access
      running = (f"{found[1]}() runs in thread {found[0]!r}" if found
                 else "another call runs in another thread")
      raise RuntimeError(
          f"learner {self.name!r}: {method.__name__}() called in thread"
          f" {threading.current_thread().name!r} while {running}; a Learner takes one call"
          " at a time: call it from one thread.")
    try:
      previous = self._holder  # pylint: disable=protected-access
      self._holder = (threading.current_thread().name, method.__name__)  # pylint: disable=protected-access
      try:
        return method(self, *args, **kwargs)
      finally:
        self._holder = previous  # pylint: disable=protected-access
    finally:
      self._calling.release()  # pylint: disable=protected-access

  return guarded


def check_same_state_dir(state_dir: Any, process_index: int, process_count: int) -> None:
  """Raises a ValueError on every process of a learner whose processes passed different
  ``state_dir``s (or some none): their saves are one Orbax checkpoint, which then waited
  for the other processes forever. They call this in lockstep, from ``join``."""
  path = os.fspath(state_dir) if isinstance(state_dir, os.PathLike) else state_dir
  digest = hashlib.sha256(repr(path).encode()).digest()
  every = delayed.every_process(dict(enumerate(digest)), process_count)  # its bytes, as ints
  differ = [i for i, seen in enumerate(every) if seen != every[0]]
  if differ:
    raise ValueError(
        f"join(state_dir={state_dir!r}) in process {process_index}: processes {differ} of"
        " this learner passed another state_dir than process 0's (or none where it passed"
        " one); pass every process the same path, on storage they all see (a shared disk"
        " or a gs:// URL), or none.")
