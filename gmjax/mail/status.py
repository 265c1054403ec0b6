"""``gmjax status RUN``: a run's rounds and learners as plain-text tables.

Besides each learner's heartbeat, ``Run.status()`` shows how it spends its time
(``pace``): its seconds per step and steps per second, the steps it put in each round
(from the round records' participants), the share of its time ``step()`` and ``close()``
spent waiting for commits, and its goodput, the share of the steps it trained that
reached a committed aggregate.
"""

from __future__ import annotations

import datetime
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from gmjax.core import guards
from gmjax.mail import heartbeats
from gmjax.mail.errors import CorruptRecord, RunNotFound

RECENT_ROUNDS = 10
"""``steps_per_round_mean`` is over a learner's last this many committed contributions."""


def _nonnegative(value: Any) -> float | None:
  """A heartbeat's number (untrusted): a finite non-negative number, else None."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value) if math.isfinite(value) and value >= 0 else None


def _span(record: Mapping[str, Any]) -> float | None:
  """Seconds from the heartbeat's ``joined_at`` to its ``last_seen``: both by the
  learner's own clock, so no clocks are compared across machines."""
  try:
    joined = datetime.datetime.fromisoformat(record["joined_at"])
    seen = datetime.datetime.fromisoformat(record["last_seen"])
    span = (seen - joined).total_seconds()
  except (KeyError, TypeError, ValueError):
    return None
  return span if math.isfinite(span) and span > 0 else None


def pace(name: str, record: Mapping[str, Any], rounds: Sequence[Any],
         fragments: int) -> dict[str, Any]:
  """How one learner trains and waits, from its heartbeat and the round records.

  Args:
    name: the learner.
    record: its heartbeat (``step_seconds``, ``trained``, ``idle_seconds`` may be
      missing: a learner of an older version writes none, and each is then None).
    rounds: the run's round records (``RoundRecord``), ordered by round.
    fragments: the run's number of fragments.

  Returns:
    ``step_seconds`` (the lower median of its last 16 seconds per step, waits excluded) and
    ``steps_per_second`` (its inverse); ``trained`` (steps since it joined) and
    ``idle_seconds`` (seconds ``step()``/``close()`` waited for commits since);
    ``idle_fraction`` (``idle_seconds`` over the seconds from its join to its last
    heartbeat); ``steps_per_round_mean`` and ``steps_per_round_last`` (the ``steps`` of
    its last ``RECENT_ROUNDS`` contributions that committed rounds aggregated, since it
    joined: rounds from its ``first_round`` on); ``committed_steps`` (their sum over
    every such round); ``goodput``: ``committed_steps / (trained · fragments)`` (each
    fragment's contributions carry each step once; at most 1: a heartbeat older than
    the learner's last contributions counts the steps they carry), None when the run no
    longer keeps
    every round since the learner joined or it has trained nothing.
  """
  step_seconds = _nonnegative(record.get("step_seconds"))
  trained = record.get("trained")
  trained = trained if type(trained) is int and trained >= 0 else None
  idle = _nonnegative(record.get("idle_seconds"))
  span = _span(record)
  first = record.get("first_round")
  first = first if type(first) is int else 0
  steps = [p.steps for r in rounds if r.round is not None and r.round >= first
           for p in r.participants if p.learner == name]
  recent = steps[-RECENT_ROUNDS:]
  kept_all = not rounds or rounds[0].round <= first
  goodput = None
  if trained and kept_all:
    # The learner trained at least what its committed contributions carry: a heartbeat
    # written before its last ones (a kill right after a commit) counts those.
    goodput = sum(steps) / max(trained * max(1, fragments), sum(steps))
  return {
      "step_seconds": step_seconds,
      "steps_per_second": 1.0 / step_seconds if step_seconds else None,
      "trained": trained,
      "idle_seconds": idle,
      "idle_fraction": None if idle is None or span is None else min(1.0, idle / span),
      "steps_per_round_mean": sum(recent) / len(recent) if recent else None,
      "steps_per_round_last": recent[-1] if recent else None,
      "committed_steps": sum(steps),
      "goodput": goodput,
  }


def learner_rows(records: Mapping[str, Mapping[str, Any]],
                 dated: Mapping[str, float | None], rounds: Sequence[Any], fragments: int,
                 timeout: float | None) -> list[dict[str, Any]]:
  """``run.status()``'s learners: each valid heartbeat's fields, its age, whether it is
  silent, and its ``pace``.

  Args:
    records: valid heartbeats by name.
    dated: ``Store.list_dated("learners")``.
    rounds: the run's round records, oldest first.
    fragments: the plan's fragment count.
    timeout: the run's liveness timeout (None: the least, ``MIN_LIVENESS_SECONDS``).
  """
  now = datetime.datetime.now(datetime.timezone.utc)
  rows = []
  for name, record in sorted(records.items()):
    # Aged by the storage's date where it keeps one, not by the clock of the machine
    # that wrote the heartbeat (one an hour off made a live learner silent and a dead
    # one live); else by its last_seen.
    written, age = dated.get(f"{name}.json"), None
    try:
      age = (now.timestamp() - written if written is not None else (
          now - datetime.datetime.fromisoformat(record["last_seen"])).total_seconds())
    except (KeyError, TypeError, ValueError):
      pass  # a heartbeat without a readable time shows no age
    # A heartbeat that says live but has not changed for as long as learners wait
    # before they presume its learner dead: killed, or its machine gone.
    silent = (record.get("status") in (heartbeats.LIVE, heartbeats.CLOSING)
              and age is not None and age > heartbeats.liveness(
                  record, max(timeout or 0.0, heartbeats.MIN_LIVENESS_SECONDS)))
    rows.append({
        "name": name, "status": record.get("status"), "silent": silent,
        "step": record.get("step"),
        "first_round": record.get("first_round"), "versions": record.get("versions"),
        "loss": record.get("loss"), "last_seen": record.get("last_seen"),
        "seconds_since_seen": None if age is None else round(age, 3),
        **pace(name, record, rounds, fragments),
    })
  return rows


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return lines


def _number(value: Any, digits: int) -> str | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None if value is None else repr(value)[:20]
  return f"{float(value):.{digits}f}"


def _seconds(value: Any) -> str | None:
  return _number(value, 2)


def _percent(value: Any) -> str | None:
  number = _number(value, 1) if value is None else _number(100 * value, 1)
  return None if number is None else f"{number}%"


def _steps_per_round(mean: Any, last: Any) -> str | None:
  if mean is None:
    return None
  return f"{_number(mean, 1)} (last {last})"


def format_status(run, *, last: int | None = 50, problems: Sequence[str] | None = None
                  ) -> str:
  """The run's summary, its rounds (the ``last`` ones; None for all) and its learners.

  Args:
    run: a ``gmjax.mail.Run`` (``gmjax.mail.open(url)``).
    last: how many of the newest rounds kept to list: an int >= 0, or None for all.
    problems: what ``gmjax.mail.verify`` found (a list); None runs its quick check
      (records, and the newest version's files). A damaged run says so first.

  Returns:
    Text: a header, a rounds table (round, fragment, version, step, participants with
    their weights, rejected, cosine, the seconds to the quorum, past it (``grace_s``),
    waiting for the designated closer (``takeover_s``), in all (``wait_s``) and to save
    the state (``sync_s``), closer, commit time) and a learners table (status, step,
    versions, loss, seconds since the last heartbeat, steps per second, steps per round
    (the mean of the last ten, and the last), the share of time waiting for commits, and
    goodput: see ``pace``).

  Raises:
    TypeError: ``run`` is not a run (a URL: open it first), or ``problems`` a string.
    ValueError: ``last`` is not None or an int >= 0.
  """
  if not hasattr(run, "status"):
    raise TypeError(f"format_status: run must be a gmjax.mail.Run, got"
                    f" {type(run).__name__} {guards.quote(run)}; open it first:"
                    f" format_status(gmjax.mail.open(url)).")
  if last is not None and (isinstance(last, bool) or not isinstance(last, numbers.Integral)
                           or last < 0):
    raise ValueError(f"format_status: last={guards.quote(last)} must be None (every round)"
                     " or an int >= 0 (that many of the newest rounds).")
  if isinstance(problems, (str, bytes)):
    raise TypeError(f"format_status: problems must be a list of problems, as"
                    f" gmjax.mail.verify(run) returns, got a string {guards.quote(problems)}.")
  if problems is None:
    from gmjax.mail.verify import verify  # pylint: disable=g-import-not-at-top

    problems = verify(run, deep=False)
  lines = [f"DAMAGED: {len(problems)} problem(s)"] + [f"  {p}" for p in problems] + [
      ""] if problems else []
  try:
    status = run.status()
  except (RunNotFound, CorruptRecord) as error:
    if not problems:
      raise
    # No version of some fragment is readable: the problems are the report.
    return "\n".join(lines + [f"run {run.url}: no summary ({error})"])
  try:
    rounds = run.rounds()
  except CorruptRecord:
    rounds = []  # the problems above say which record
  shown = rounds if last is None else rounds[len(rounds) - min(int(last), len(rounds)):]
  # The records a run keeps are each fragment's newest keep_versions; fewer is damage
  # (the problems above), not pruning.
  keep = status["keep_versions"] or max(status["versions"].values(), default=0)
  pruned = sum(min(v, keep) for v in status["versions"].values()) == status["rounds_kept"]
  kept = ("" if status["rounds_kept"] == status["rounds"]
          else f"the last {status['rounds_kept']} kept, " if pruned
          else f"{status['rounds_kept']} readable, ")
  lines += [
      f"run {status['run']}: {status['parameters']:,} parameters in {status['leaves']}"
      f" leaves, {status['fragments']} fragment(s), sync every {status['sync_every']}"
      f" steps{', signed' if status['signed'] else ''}",
      f"rounds committed: {status['rounds']} ({kept}latest step {status['latest_step']}),"
      f" versions {status['versions']}",
      "",
  ]
  rows = []
  for r in shown:
    participants = " ".join(f"{p.learner}:{p.weight:.3f}" for p in r.participants)
    rejected = " ".join(f"{x.learner}({x.reason[:40]})" for x in r.rejected)
    repair = r.extra.get("repair")
    if isinstance(repair, dict):
      participants = f"(repaired from version {repair.get('from_version')})"
    rows.append([
        r.round, r.fragment, r.version, r.step, len(r.participants),
        participants or "(none: no outer step)", rejected or None,
        _number(r.cosine, 4),
        _seconds(r.quorum_seconds), _seconds(r.grace_seconds), _seconds(r.takeover_seconds),
        _seconds(r.wait_seconds), _seconds(r.sync_seconds), r.closer, r.committed_at,
    ])
  if rows:
    if len(shown) < len(rounds):
      lines.append(f"(the last {len(shown)} of the {len(rounds)} rounds kept)")
    lines += _table(["round", "frag", "ver", "step", "n", "weights", "rejected", "cosine",
                     "quorum_s", "grace_s", "takeover_s", "wait_s", "sync_s", "closer",
                     "committed_at"], rows)
  elif rounds:
    lines.append(f"(none of the {len(rounds)} rounds kept listed: last=0)")
  else:
    lines.append("no rounds committed yet")
  lines.append("")
  learner_rows = [
      [l["name"], f"{l['status']}, silent" if l.get("silent") else l["status"], l["step"],
       l["first_round"],
       " ".join(f"{f}:{v}" for f, v in sorted((l.get("versions") or {}).items())) or None,
       _number(l.get("loss"), 4),
       _seconds(l["seconds_since_seen"]),
       _number(l.get("steps_per_second"), 2),
       _steps_per_round(l.get("steps_per_round_mean"), l.get("steps_per_round_last")),
       _percent(l.get("idle_fraction")), _percent(l.get("goodput"))]
      for l in status["learners"]
  ]
  if learner_rows:
    lines += _table(["learner", "status", "step", "first_round", "versions", "loss",
                     "seen_s_ago", "steps/s", "steps/round", "idle", "goodput"],
                    learner_rows)
  else:
    lines.append("no learners have joined")
  return "\n".join(lines)
