"""A file's identity travels with its hot inode: its file id in an extended attribute (DESIGN §5).

Why an xattr: it belongs to the inode, so it survives every namespace operation (rename of the file or of any
directory above it, hard links, RENAME_EXCHANGE) and a crash between any two steps, with no bookkeeping of ours;
and a file deleted and created again gets a new inode without it, so a reused st_ino is never taken for the old
file. The st_ino alone could not tell the two apart after a remount; the path alone could not follow a rename the
daemon did not see finish. The attribute is written (and fsync'd) before the catalog commit that first names the
file: a committed row whose inode lacks it is another file.

Reads of the mount never see it: the FUSE front implements no getxattr (field notes: every write would pay for
it), and the broker never asks. A hot dir on a file system without user xattrs falls back to st_ino plus the
row's size checks (logged once).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("tierfs.tier")

XATTR = "user.tierfs.fid"
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP)
_warned = False


def _unsupported(err: OSError) -> bool:
    global _warned
    if err.errno not in _UNSUPPORTED:
        return False
    if not _warned:
        _warned = True
        log.warning("the hot dir's file system has no user xattrs (%s): file identity falls back to the hot "
                    "inode number and the catalog's size checks", err)
    return True


def read(fd_or_path: int | str | os.PathLike) -> int | None:
    """The file id stamped on a hot file, or None (none stamped, or no xattrs here). Blocking."""
    try:
        raw = os.getxattr(fd_or_path, XATTR, follow_symlinks=False) if not isinstance(fd_or_path, int) \
            else os.getxattr(fd_or_path, XATTR)
    except OSError as err:
        if err.errno == errno.ENODATA or _unsupported(err):
            return None
        raise
    try:
        return int(raw)
    except ValueError:
        return None


def stamp_all(paths: Iterable[tuple[str | os.PathLike, int, int]]) -> list[tuple[str | os.PathLike, int]]:
    """Blocking: stamp each (path, expected st_ino, file id), then make the stamps durable, before the catalog
    commit that names them. Two passes: every attribute first, then an fsync each, of which (on a journalling file
    system) the first commits them all and the rest find nothing left to do. Returns those that could not be
    stamped (gone, or another inode has the name now), which the caller must not commit."""
    failed: list[tuple[str | os.PathLike, int]] = []
    fds: list[int] = []
    try:
        for path, ino, file_id in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                failed.append((path, file_id))
                continue
            fds.append(fd)
            try:
                if os.fstat(fd).st_ino != ino:
                    failed.append((path, file_id))
                    continue
                os.setxattr(fd, XATTR, str(file_id).encode())
            except OSError as err:
                if not _unsupported(err):
                    log.warning("could not record the identity of %s (%s); it stays hot", path, err)
                    failed.append((path, file_id))
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return failed


def matches(st_ino: int, stamped: int | None, row_ino: int, file_id: int) -> bool:
    """Is the hot inode (st_ino, with `stamped` read from it) the file of a row (row_ino, file_id) of a catalog
    whose files are all stamped? The stamp decides; an unstamped inode is the row's only by its inode number,
    and only on a hot dir without xattrs (where no stamp can exist)."""
    if stamped is not None:
        return stamped == file_id
    return _warned and bool(row_ino) and st_ino == row_ino


def paths_of(hot: Path, state_dir: Path, inos: set[int]) -> dict[int, list[str]]:
    """Blocking: every path of the hot dir (but the state dir) whose inode number is in `inos`, found by one
    walk (scandir gives the number without a stat): where files renamed behind the catalog's back are now."""
    out: dict[int, list[str]] = {}
    stack = [""]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(hot / d if d else hot)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        with it:
            for de in it:
                rel = f"{d}/{de.name}" if d else de.name
                if not d and hot / de.name == state_dir:
                    continue
                try:
                    if de.is_dir(follow_symlinks=False):
                        stack.append(rel)
                    elif de.inode() in inos:
                        out.setdefault(de.inode(), []).append(rel)
                except OSError:
                    continue
    return out
