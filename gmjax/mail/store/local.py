"""A run's store on a local (or network-mounted, POSIX) filesystem.

Exclusive create writes a temporary file beside the target, ``fsync``s it and
``os.link``s it to the final name, which fails if the name exists (see
``gmjax.mail.store``). A file where a write needs a folder, and a folder where ``put``
writes its file, were planted (the run's layout never puts one there): the write removes
them and logs a warning. So is a symbolic link anywhere under the root (the store makes
none): a write removes the link itself and makes the folder, a read refuses what lies
under one (``BadObject``), a listing finds nothing there, and a delete removes the link,
never what it points to.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import uuid
from typing import Any

from gmjax.mail.store.base import _CHUNK, BadObject, Store

log = logging.getLogger(__name__)


class LocalStore(Store):
  """A directory on a local (or network-mounted, POSIX) filesystem."""

  def __init__(self, url: str, **kwargs: Any):
    super().__init__(url, **kwargs)
    root = url[len("file://"):] if url.startswith("file://") else url
    self.root = os.path.abspath(os.path.expanduser(root))

  @property
  def local_root(self) -> str:
    return self.root

  def _path(self, path: str) -> str:
    return os.path.join(self.root, *path.strip("/").split("/"))

  def _link_at(self, target: str, last: bool = False) -> str | None:
    """The first symbolic link among ``target``'s folders under the root (and ``target``
    itself with ``last``), or None.

    The store makes no links, so one there was planted; followed, it would take reads,
    writes and deletes (retention's among them) outside the run. The root itself may be
    a link: the user chose it.
    """
    relative = os.path.relpath(target, self.root)
    parts = relative.split(os.sep)
    if parts[0] in (os.curdir, os.pardir):
      return None
    current = self.root
    for part in parts if last else parts[:-1]:
      current = os.path.join(current, part)
      if os.path.islink(current):
        return current
    return None

  def _folder(self, folder: str) -> None:
    """Makes ``folder``, removing files and links planted where it or a folder above it
    (under the root) belongs."""
    if self._link_at(folder, last=True) is None:
      with contextlib.suppress(FileExistsError, NotADirectoryError):  # a file on the way
        os.makedirs(folder, exist_ok=True)
        return
    relative = os.path.relpath(folder, self.root)
    if relative.split(os.sep)[0] in (os.curdir, os.pardir):
      os.makedirs(folder, exist_ok=True)
      return
    current = self.root
    for part in relative.split(os.sep):
      current = os.path.join(current, part)
      if os.path.islink(current) or (os.path.lexists(current)
                                     and not os.path.isdir(current)):
        log.warning("removing a %s planted at %s, where the run's layout keeps a folder",
                    "link" if os.path.islink(current) else "file", current)
        try:
          os.unlink(current)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
          pass  # another writer removed it, and may have made the folder: keep that
    os.makedirs(folder, exist_ok=True)

  def folder(self, path: str) -> str:
    """Makes the run's folder ``path`` (as a write would) and returns its local path."""
    target = self._path(path)
    self._folder(target)
    return target

  def _temporary(self, target: str, data: bytes, durable: bool = True) -> str:
    self._folder(os.path.dirname(target))
    temporary = f"{target}.{uuid.uuid4().hex}.tmp"
    try:
      with open(temporary, "wb") as f:
        f.write(data)
        if durable:
          f.flush()
          os.fsync(f.fileno())
    except BaseException:
      _unlink_quietly(temporary)  # a full disk (ENOSPC) left it half written, for good
      raise
    return temporary

  def _put(self, path: str, data: bytes, durable: bool = True) -> None:
    """Writes ``data`` at ``path``, replacing what is there, all at once."""
    target = self._path(path)
    temporary = self._temporary(target, data, durable)
    try:
      try:
        os.replace(temporary, target)
      except IsADirectoryError:
        log.warning("removing a folder planted at %s, where the run's layout keeps a file",
                    target)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(temporary, target)
    except BaseException:
      _unlink_quietly(temporary)
      raise
    if durable:
      fsync_dir(os.path.dirname(target))

  def _create(self, path: str, data: bytes) -> None:
    target = self._path(path)
    temporary = self._temporary(target, data)
    try:
      os.link(temporary, target)
    finally:
      _unlink_quietly(temporary)
    fsync_dir(os.path.dirname(target))

  def _get(self, path: str) -> bytes:
    target = self._path(path)
    if os.path.isdir(target) and self._link_at(target, last=True) is None:
      raise FileNotFoundError(target)
    with os.fdopen(self._open_regular(target, path), "rb") as f:
      return f.read()

  def _get_hashed(self, path: str, digest: Any) -> bytes:
    target = self._path(path)
    if os.path.isdir(target) and self._link_at(target, last=True) is None:
      raise FileNotFoundError(target)
    chunks = []
    with os.fdopen(self._open_regular(target, path), "rb") as f:
      while chunk := f.read(_CHUNK):
        digest.update(chunk)
        chunks.append(chunk)
    return b"".join(chunks)

  def _open_regular(self, target: str, path: str) -> int:
    """A descriptor of the regular file at ``target``; BadObject for anything else.

    O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: the store writes
    no links, so a link here (to /dev/zero, say) was planted. Every read goes through
    it: a FIFO planted where a checkpoint file or Θ lies would block its reader. A link
    among its folders is refused too.
    """
    if (link := self._link_at(target)) is not None:
      raise BadObject(path, f"lies under a symbolic link, {link}")
    try:
      with _absent_under_a_file(target):
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as error:
      if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
        raise BadObject(path, f"is not a regular file ({error.strerror})") from None
      raise
    try:
      info = os.fstat(fd)
      if not stat.S_ISREG(info.st_mode):
        raise BadObject(path, "is not a regular file"
                        f" (mode {stat.filemode(info.st_mode)})")
    except BaseException:
      os.close(fd)
      raise
    return fd

  def _read(self, path: str, max_bytes: int) -> bytes:
    target = self._path(path)
    fd = self._open_regular(target, path)
    try:
      info = os.fstat(fd)
      if info.st_size > max_bytes:
        raise BadObject(path, f"holds {info.st_size} bytes, more than {max_bytes} bytes")
    except BaseException:
      os.close(fd)
      raise
    with os.fdopen(fd, "rb") as f:
      # A byte past the size fstat gave shows a file that grew (the store replaces files
      # whole, never appends); a read of the bound itself would allocate the bound.
      data = f.read(min(max_bytes, info.st_size) + 1)
    if len(data) > info.st_size:
      raise BadObject(path, "grew while it was read")
    return data

  def _size(self, path: str) -> int:
    target = self._path(path)
    if (link := self._link_at(target)) is not None:
      raise BadObject(path, f"lies under a symbolic link, {link}")
    with _absent_under_a_file(target):
      return os.stat(target).st_size

  def _listed(self, prefix: str) -> str | None:
    """The local folder of ``prefix``; None (nothing is listed) where a link leads to it."""
    folder = self._path(prefix.strip("/"))
    if (link := self._link_at(folder, last=True)) is not None:
      log.warning("not listing %s: %s is a symbolic link, which the store never makes",
                  prefix, link)
      return None
    return folder

  def _list(self, prefix: str) -> list[str]:
    if (folder := self._listed(prefix)) is None:
      return []
    try:
      names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
      return []
    return [n for n in names if not n.endswith(".tmp")]

  def temporaries(self, prefix: str) -> list[str]:
    if (folder := self._listed(prefix)) is None:
      return []
    try:
      names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
      return []
    return sorted(n for n in names if n.endswith(".tmp"))

  def _stats(self, prefix: str) -> dict[str, os.stat_result]:
    """Each entry directly under ``prefix`` (temporary files left out), with its stat."""
    stats = {}
    if (folder := self._listed(prefix)) is None:
      return stats
    try:
      with os.scandir(folder) as entries:
        for entry in entries:
          if entry.name.endswith(".tmp"):
            continue
          try:
            stats[entry.name] = entry.stat(follow_symlinks=False)
          except FileNotFoundError:
            continue  # removed since the listing
    except (FileNotFoundError, NotADirectoryError):
      return {}
    return stats

  def _list_marked(self, prefix: str) -> dict[str, str]:
    # A put replaces the file by another (a new inode), whatever the clock says.
    return {name: f"{info.st_size}:{info.st_ino}:{info.st_mtime_ns}:{info.st_ctime_ns}"
            for name, info in self._stats(prefix).items()}

  def _list_dated(self, prefix: str) -> dict[str, float | None]:
    return {name: None if stat.S_ISDIR(info.st_mode) else info.st_mtime
            for name, info in self._stats(prefix).items()}

  def _delete(self, path: str) -> None:
    target = self._path(path)
    if self._link_at(target) is not None:
      return  # nothing of the run lies under a link
    if os.path.islink(target):
      _unlink_quietly(target)  # the link, not what it points to
    elif os.path.isdir(target):
      shutil.rmtree(target, ignore_errors=True)
    else:
      _unlink_quietly(target)

  def _delete_empty_folder(self, path: str) -> None:
    target = self._path(path)
    if self._link_at(target) is None and not os.path.islink(target):
      # rmdir refuses a folder that is not empty (or gone, or a file): then it stays.
      with contextlib.suppress(OSError):
        os.rmdir(target)


@contextlib.contextmanager
def _absent_under_a_file(target: str):
  """Raises FileNotFoundError where reading ``target`` finds a file among its folders.

  Nothing is stored under a file: a run URL that names one (a config passed as the run)
  holds no run, as a missing folder holds none, and callers that handle a missing
  object (``RunNotFound``: "no run at ...") handle it.
  """
  try:
    yield
  except NotADirectoryError:
    raise FileNotFoundError(errno.ENOENT, "a file is on its path", target) from None


def _unlink_quietly(path: str) -> None:
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass  # already gone: nothing to clean up


def fsync_dir(directory: str) -> None:
  """Flushes ``directory``'s entries to disk, so the names in it survive a crash."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError as error:
    log.debug("cannot open %s to fsync it: %r", directory, error)
    return
  try:
    os.fsync(fd)
  except OSError as error:  # some filesystems refuse fsync on a directory
    log.debug("fsync of directory %s failed: %r", directory, error)
  finally:
    os.close(fd)
