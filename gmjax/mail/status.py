"""``gmjax status RUN``: a run's rounds and learners as plain-text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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


def format_status(run, *, last: int | None = 50, problems: Sequence[str] | None = None
                  ) -> str:
  """The run's summary, its rounds (the ``last`` ones; None for all) and its learners.

  Args:
    run: a ``gmjax.mail.Run`` (``gmjax.mail.open(url)``).
    last: how many of the newest rounds to list.
    problems: what ``gmjax.mail.verify`` found; None runs its quick check (records, and
      the newest version's files). A damaged run says so first.

  Returns:
    Text: a header, a rounds table (round, fragment, version, step, participants with
    their weights, rejected, cosine, quorum and sync seconds, closer, commit time) and a
    learners table (status, step, versions, loss, seconds since the last heartbeat).
  """
  if problems is None:
    from gmjax.mail.verify import verify  # pylint: disable=g-import-not-at-top

    problems = verify(run, deep=False)
  status = run.status()
  rounds = run.rounds()
  shown = rounds if last is None else rounds[-last:]
  lines = [f"DAMAGED: {len(problems)} problem(s)"] + [f"  {p}" for p in problems] + [
      ""] if problems else []
  lines += [
      f"run {status['run']}: {status['parameters']:,} parameters in {status['leaves']}"
      f" leaves, {status['fragments']} fragment(s), sync every {status['sync_every']}"
      f" steps{', signed' if status['signed'] else ''}",
      f"rounds committed: {status['rounds']} (latest step {status['latest_step']}),"
      f" versions {status['versions']}",
      "",
  ]
  rows = []
  for r in shown:
    participants = " ".join(f"{p.get('learner')}:{_number(p.get('weight'), 3)}"
                            for p in r["participants"] if isinstance(p, dict))
    rejected = " ".join(f"{x.get('learner')}({str(x.get('reason'))[:40]})"
                        for x in r.get("rejected", []) if isinstance(x, dict))
    if r.get("repair"):
      participants = f"(repaired from version {r['repair'].get('from_version')})"
    rows.append([
        r["round"], r["fragment"], r["version"], r["step"], len(r["participants"]),
        participants or "(none: no outer step)", rejected or None,
        _number(r.get("cosine"), 4),
        _seconds(r.get("quorum_seconds")), _seconds(r.get("sync_seconds")),
        r.get("closer"), r.get("committed_at"),
    ])
  if rows:
    if len(shown) < len(rounds):
      lines.append(f"(the last {len(shown)} of {len(rounds)} rounds)")
    lines += _table(["round", "frag", "ver", "step", "n", "weights", "rejected", "cosine",
                     "quorum_s", "sync_s", "closer", "committed_at"], rows)
  else:
    lines.append("no rounds committed yet")
  lines.append("")
  learner_rows = [
      [l["name"], l["status"], l["step"], l["first_round"],
       " ".join(f"{f}:{v}" for f, v in sorted((l.get("versions") or {}).items())) or None,
       _number(l.get("loss"), 4),
       _seconds(l["seconds_since_seen"])]
      for l in status["learners"]
  ]
  if learner_rows:
    lines += _table(["learner", "status", "step", "first_round", "versions", "loss",
                     "seen_s_ago"], learner_rows)
  else:
    lines.append("no learners have joined")
  return "\n".join(lines)
