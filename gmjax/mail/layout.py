"""Where a run keeps each record under its prefix, and the rules for learner names.

::

  <run>/manifest.json
  <run>/learners/<name>.json                       heartbeat
  <run>/rounds/<r>/<name>.safetensors              contribution
  <run>/fragments/<f>/<v>-<nonce>/                 Orbax checkpoint of FragmentState v
  <run>/fragments/<f>/<v>-<nonce>/theta.safetensors    its Θ alone, for learners
  <run>/fragments/<f>/<v>-<nonce>.update.safetensors
  <run>/fragments/<f>/<v>.commit.json              the round record: the commit
  <run>/fragments/<f>/<v>.commit-<k>.json          supersedes damaged earlier records of v
"""

from __future__ import annotations

import re

FORMAT = "gmjax/1"
MANIFEST = "manifest.json"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_COMMIT = re.compile(r"(0|[1-9][0-9]*)\.commit\.json")
_SUPERSEDING = re.compile(r"(0|[1-9][0-9]*)\.commit-([1-9][0-9]*)\.json")
CONTRIBUTION_SUFFIX = ".safetensors"


def check_name(name: object, *, argument: str = "name") -> str:
  """Returns ``name`` if it is a valid learner name, else raises ValueError/TypeError."""
  if not isinstance(name, str):
    raise TypeError(f"{argument} must be a str, got {type(name).__name__}: {name!r}")
  if not NAME_PATTERN.fullmatch(name):
    raise ValueError(
        f"{argument}={name!r} is not a valid learner name: use 1 to 64 characters from"
        " letters, digits, '.', '_' and '-', starting with a letter or digit"
        " (e.g. 'worker-3')."
    )
  return name


def is_valid_name(name: str) -> bool:
  return bool(NAME_PATTERN.fullmatch(name))


_CLAIM = re.compile(r"[1-9][0-9]{0,15}")  # as names.claim writes them
MAX_CLAIM = 2**53


def claim_number(entry: str) -> int | None:
  """The number of the claim ``entry`` of a ``learners/<name>.claims`` folder, or None
  for anything else there (planted: no join writes it, no reader counts it)."""
  return int(entry) if _CLAIM.fullmatch(entry) and int(entry) < MAX_CLAIM else None


def heartbeat(name: str) -> str:
  return f"learners/{name}.json"


def round_dir(round_: int) -> str:
  return f"rounds/{round_}"


def contribution(round_: int, name: str) -> str:
  return f"rounds/{round_}/{name}{CONTRIBUTION_SUFFIX}"


def fragment_dir(fragment: int) -> str:
  return f"fragments/{fragment}"


def state_dir(fragment: int, version: int, nonce: str) -> str:
  return f"fragments/{fragment}/{version}-{nonce}"


def update_file(fragment: int, version: int, nonce: str) -> str:
  return f"fragments/{fragment}/{version}-{nonce}.update.safetensors"


def theta_file(fragment: int, version: int, nonce: str) -> str:
  """Θ of a saved state, beside Orbax's files in the state's directory (not among the
  checkpoint's ``state_files``): one entry per saved state, removed with it."""
  return f"{state_dir(fragment, version, nonce)}/theta.safetensors"


def commit(fragment: int, version: int) -> str:
  return f"fragments/{fragment}/{version}.commit.json"


def commit_version(entry: str) -> int | None:
  """The version a ``<v>.commit.json`` entry names, or None for other entries."""
  match = _COMMIT.fullmatch(entry)
  return int(match.group(1)) if match else None


def commit_slot(fragment: int, version: int, slot: int) -> str:
  """Slot 0 is the commit; slot ``k > 0`` is created only once slots ``< k`` are damaged."""
  if slot == 0:
    return commit(fragment, version)
  return f"fragments/{fragment}/{version}.commit-{slot}.json"


def slot_version(entry: str) -> int | None:
  """The version a commit or superseding record names, or None for other entries."""
  match = _COMMIT.fullmatch(entry) or _SUPERSEDING.fullmatch(entry)
  return int(match.group(1)) if match else None


def state_version(entry: str) -> int | None:
  """The version of a ``<v>-<nonce>`` state directory or update file entry, else None."""
  head, sep, _ = entry.partition("-")
  return int(head) if sep and head.isdigit() and "commit" not in entry else None
