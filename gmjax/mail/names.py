"""Unique learner names: ``join`` claims a name, and refuses one that is live.

Each join of a name is an *incarnation*, claimed by creating
``learners/<name>.claims/<k>`` exclusively (``k`` one more than the newest claim), so of
two learners joining as one name at once exactly one wins. Before claiming, the joiner
checks the newest claim's holder, through the name's heartbeat:

* ``closed`` or ``failed``: the name is free;
* ``live`` or ``closing``: the holder is alive if, while the joiner watches for the run's
  liveness timeout, its heartbeat rises ``ALIVE_BEATS`` times to a ``seq`` higher than
  any the joiner has seen of it (a live learner beats every few poll intervals, ten
  times or more in that while), and then the join raises ``NameTaken``; otherwise it
  belongs to a dead learner and the name is free. Old heartbeats written back (a
  replay: in a keyed run the only heartbeat anyone without the key can write) never
  rise above the newest one seen, so a replay of a few, in any order, cannot hold a name.
  A holder on this host whose process is gone is dead at once, without the wait;
* no heartbeat of the newest claim yet: its holder is joining, and gets the same watch.

A holder that was only paused (a stopped VM, a network cut longer than the liveness
timeout) while another learner took its name finds, at its beats after a silence, the
newer incarnation's heartbeat rising under the newest claim (``superseded``): it stops
writing its heartbeat and its next ``step`` raises ``NameTaken``, so that two learners
run as one name for a few beats at most.

Observers never compare clocks across machines, only changes they see themselves.
Entries of ``learners/<name>.claims/`` that are not claim numbers as joins write them
(``1``, ``2``, ... below ``2**53``: ASCII digits, no leading zero) are ignored.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from gmjax.mail import heartbeats
from gmjax.mail import layout
from gmjax.mail.errors import NameTaken
from gmjax.mail.store import BadObject

MAX_CLAIM_BYTES = 256  # a claim holds its incarnation, 32 hex digits
# Rises of the holder's seq that show it alive: more than a replay of two old heartbeats
# can make (one), far fewer than a live learner makes in a liveness timeout (ten).
ALIVE_BEATS = 3


def _claims(name: str) -> str:
  return f"learners/{name}.claims"


def _newest_claim(store, name: str) -> tuple[int, str | None]:
  numbers = [n for e in store.list(_claims(name)) if (n := layout.claim_number(e))]
  if not numbers:
    return 0, None
  newest = max(numbers)
  try:
    return newest, store.read(f"{_claims(name)}/{newest}", MAX_CLAIM_BYTES).decode("ascii")
  except (FileNotFoundError, BadObject, UnicodeDecodeError):
    return newest, None  # gone, or planted: no incarnation holds it


def superseded(store, name: str, incarnation: str, key: bytes | None,
               seen: dict[str, tuple[int, int]], claim: int | None = None,
               claimed_at: float | None = None) -> NameTaken | None:
  """``NameTaken`` once a newer incarnation than ``incarnation`` holds ``name``, else None.

  Newer: the newest claim is its, its valid heartbeat has risen ``ALIVE_BEATS - 1``
  times across the calls (``seen``: its highest ``seq`` and rises so far, kept by the
  caller), as a joiner watches a holder, and the claim its heartbeats name is newer than
  this incarnation's: numbered above ``claim``, or made later by the storage's clock
  (``claimed_at``, each claim's date as its joiner read it: the closer deletes the claims
  of a name it judged dead, and joins then number theirs anew). One old heartbeat written
  back, and a claim planted for it, never rise; an older incarnation's heartbeats written
  back in order rise, but name an older claim, by number and date (claims are not
  signed; the heartbeats that name them are): a replay cannot stop a live learner. A
  heartbeat that names no claim (as a gmjax before the field writes it) is not newer
  either: a run's learners run this gmjax or a later one.
  """
  record = _heartbeat(store, name, key)
  other = None if record is None else record.get("incarnation")
  if other is None or other == incarnation:
    return None
  if claim is not None and not (isinstance(record.get("claim"), int) and (
      record["claim"] > claim or _later(record.get("claimed_at"), claimed_at))):
    seen.pop(other, None)  # an older join's heartbeat, or one that names no claim
    return None
  _, holder = _newest_claim(store, name)
  if holder != other or record.get("status") not in (heartbeats.LIVE, heartbeats.CLOSING):
    seen.pop(other, None)
    return None
  last, rises = seen.get(other, (None, 0))
  if last is not None and record["seq"] > last:
    rises += 1
  seen[other] = (record["seq"] if last is None else max(last, record["seq"]), rises)
  if rises < ALIVE_BEATS - 1:
    return None
  return NameTaken(
      f"learner name {name!r} was taken by a newer join (pid {record.get('pid')} on"
      f" {record.get('host')!r}) while this learner was silent for longer than the run's"
      " liveness timeout (paused, or cut off from storage); this learner stopped"
      " publishing. Join again under another name (with its state_dir, if any).")


def _later(date: Any, than: float | None) -> bool:
  return than is not None and type(date) in (int, float) and date > than


def claimed_at(store, name: str, number: int) -> float | None:
  """The storage's date of claim ``number`` of ``name`` (None where it cannot tell)."""
  return store.list_dated(_claims(name)).get(str(number))


def _heartbeat(store, name: str, key: bytes | None) -> dict | None:
  # Bounded and checked like every heartbeat: a planted one cannot crash a join.
  return heartbeats.read_one(store, name, key)


def _gone_here(record: dict) -> bool:
  """Whether the heartbeat's process ran on this host and has exited."""
  pid = record.get("pid")
  if record.get("host") != socket.gethostname() or not isinstance(pid, int):
    return False
  if pid == os.getpid():
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    return False  # someone else's process, alive
  return False


def _holder_state(record: dict | None, incarnation: str | None) -> str:
  """``free``, ``alive?`` (watch it) or ``absent`` (the claim's heartbeat is not there)."""
  if record is None or (incarnation is not None and record.get("incarnation") != incarnation):
    return "absent" if incarnation is not None else "free"
  if record.get("status") in (heartbeats.LIVE, heartbeats.CLOSING):
    return "free" if _gone_here(record) else "alive?"
  return "free"


def claim(store, name: str, *, incarnation: str, liveness_timeout: float,
          poll_interval: float, key: bytes | None = None) -> int:
  """Claims ``name`` for a new incarnation; returns its number.

  Args:
    store: the run's store.
    name: the learner name.
    incarnation: this join's unique id (its heartbeat carries it).
    liveness_timeout: how long a holder's heartbeat may stay unchanged before it is
      presumed dead.
    poll_interval: seconds between reads of the holder's heartbeat while watching.

  Raises:
    NameTaken: the name's holder is live, or another learner claimed it concurrently.
  """
  number, holder = _newest_claim(store, name)
  record = _heartbeat(store, name, key)
  state = _holder_state(record, holder)
  if state != "free":
    newest: dict[str | None, int] = {}  # the highest seq seen of each incarnation
    rises = 0
    deadline = time.monotonic() + heartbeats.liveness(record, liveness_timeout)
    while True:
      if state == "alive?":
        seen = newest.get(record.get("incarnation"))
        if seen is None or record["seq"] > seen:
          rises += seen is not None
          newest[record.get("incarnation")] = record["seq"]
      if rises >= ALIVE_BEATS:
        raise NameTaken(
            f"learner name {name!r} is taken: its heartbeat ({layout.heartbeat(name)},"
            f" pid {record.get('pid')} on {record.get('host')!r}) is live; join with"
            " another name, or wait until that learner closes or its heartbeat stops.")
      if state == "free" or time.monotonic() >= deadline:
        break
      time.sleep(poll_interval)
      record = _heartbeat(store, name, key)
      state = _holder_state(record, holder)
  if number + 1 >= layout.MAX_CLAIM:  # its claim would be one no reader counts
    raise NameTaken(
        f"learner name {name!r} has a claim {number}, the last a reader counts: it was"
        f" planted; delete {_claims(name)}/{number} from the run (it names no live"
        " learner), or join with another name.")
  if not store.create(f"{_claims(name)}/{number + 1}", incarnation.encode()):
    raise NameTaken(f"learner name {name!r} was claimed by another learner joining at the"
                    " same time; join with another name.")
  return number + 1
