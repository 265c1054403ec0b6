"""Pure guards against hostile or broken input: short quotes, positive seconds and the
outlier rule.

Both runtimes judge what learners report by the same rules: the mail closer before it
aggregates a round, and the in-mesh transformation can call ``reference``/``outliers``
inside a jitted step (pass ``xp=jax.numpy``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

QUOTE_CHARS = 64
"""The most characters of attacker-controlled text a message or record quotes."""

OUTLIER_FACTOR = 10.0
"""A value more than this many times its reference (``reference``) is an outlier."""


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
  """A short, escaped, ASCII rendering of untrusted ``value`` for messages and records.

  Args:
    value: text (or any object: its ``repr``) that came from storage or a peer.
    limit: how many characters of it to keep.

  Returns:
    ``ascii()`` of at most ``limit`` characters, followed by ``...(N chars)`` when the
    text was longer: never a newline, a control character or megabytes of it.
  """
  if not isinstance(value, str):
    # A repr can be huge (a list of a million items); render only its start.
    text = _short_repr(value, limit)
    return text.encode("ascii", "backslashreplace").decode("ascii")[: 4 * limit]
  if len(value) <= limit:
    return ascii(value)
  return f"{ascii(value[:limit])}...({len(value)} chars)"


def _short_repr(value: Any, limit: int) -> str:
  import reprlib  # pylint: disable=g-import-not-at-top

  short = reprlib.Repr()
  short.maxstring = short.maxother = short.maxlong = limit
  return short.repr(value)


def seconds(argument: str, value: Any, *, finite: bool = False, none: str = "",
            example: str = "60.0") -> float:
  """``value`` as positive seconds (numpy numbers included): a timeout, a poll interval.

  Args:
    argument: the argument's name, for the message.
    value: what was passed.
    finite: refuse infinity too (a poll interval times queue waits, which overflow).
    none: how the message says None is allowed, if it is.
    example: the value the message suggests.

  Returns:
    ``value`` as a float.

  Raises:
    TypeError: ``value`` is a str.
    ValueError: ``value`` is not a positive number (or, with ``finite``, is infinite).
  """
  what = f"{argument} must be {none}a positive{', finite' if finite else ''} number of seconds"
  if isinstance(value, (str, bytes)):
    raise TypeError(f"{what}, got {type(value).__name__} {quote(value)}; pass a"
                    " number.")
  good = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and float(value) > 0 and not (finite and math.isinf(float(value))))
  if not good:
    raise ValueError(f"{what}, got {quote(value)}; pass e.g. {argument}="
                     f"{example}.")
  return float(value)


def reference(values: Any, *, xp: Any = np) -> Any:
  """For each value, the lower median of the positive, finite values, its own included;
  NaN where no *other* value is one.

  The lower median (the ``⌊(n−1)/2⌋``-th smallest of ``n``) is a rank: values above it
  cannot raise it, however large, and fewer than half of the values, however small,
  cannot lower it below the smallest of the rest. So a minority can neither vouch for
  its own outliers nor make the others outliers. (The lower median of the *others*, by
  which each value was judged before, is the smaller of the two others among three: one
  learner with a tiny delta made both others outliers, and was aggregated alone.) With
  ``M = 2`` the larger value is judged by the smaller; with ``M = 1`` there is nothing
  to compare with (NaN). Zeros and non-finite values are no reference for anyone.

  Args:
    values: a 1-d array of ``M`` values (e.g. delta norms per step).
    xp: ``numpy`` or ``jax.numpy`` (jittable: static shapes, no data-dependent control).

  Returns:
    An array of ``M`` references, NaN where value ``i`` has no other to compare with.
  """
  values = xp.asarray(values)
  count = values.shape[0]
  usable = xp.isfinite(values) & (values > 0)
  # Without sorting, so that the traced form is a few elementwise passes over M × M
  # (sorts and gathers of M values split a compiled program into many small kernels):
  # ``before[i, j]``, value ``j`` sorts before value ``i`` (unusable ones last, ties by
  # position); ``rank[i]`` its place in that order.
  v = xp.where(usable, values, xp.inf)
  position = xp.arange(count)
  before = (v[None, :] < v[:, None]) | ((v[None, :] == v[:, None])
                                        & (position[None, :] < position[:, None]))
  rank = xp.sum(before, axis=1)
  n = xp.sum(usable)
  median = xp.sum(xp.where(usable & (rank == (n - 1) // 2), v, 0))
  others = n - usable.astype(rank.dtype)  # usable values besides each one
  return xp.where(others > 0, median, xp.nan)


def outliers(values: Any, factor: float = OUTLIER_FACTOR, *, xp: Any = np) -> Any:
  """Which values exceed ``factor`` times their ``reference``; a non-finite value is an
  outlier whenever there is a reference to judge it by, and a lone value never is."""
  values = xp.asarray(values)
  ref = reference(values, xp=xp)
  judged = ~xp.isnan(ref)
  too_big = xp.where(xp.isfinite(values), values > factor * xp.where(judged, ref, 0), True)
  return judged & too_big
