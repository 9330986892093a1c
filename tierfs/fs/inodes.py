"""Inode table: FUSE inode numbers <-> paths in the hot dir, with kernel lookup counts and open fds.

FUSE inode numbers are the hot dir's own st_ino (stable across remounts, so NFS-style handles and the kernel's
caches stay coherent); the hot dir root is ROOT_INODE. An inode keeps every path it is known by (hard links) and
the fds open on it, so a file that was unlinked while open or mapped keeps working through its fds.

An st_ino is a FUSE node id only while no other file can have it: the hot dir's file system hands a freed st_ino
to the next file it creates, and the kernel still holds the old inode until it FORGETs it (a close returns before
its RELEASE; the inode stays cached until that RELEASE is answered). A new file given the same node id would be
merged with the old inode, its page cache and size included, and the daemon would serve it from the old file's
state. So a file or directory that loses its last name while the kernel or an fd may still hold it is *pinned*:
its last link moves to hotdir.PINNED_DIR/<st_ino>, and the link goes only when the kernel has forgotten it and the
last fd is closed (`_drop_inode`). A pinned file's blocks go earlier, as soon as no fd holds it (nothing can read
it then; TierOperations._free_blocks_if_unreachable), so an unlink frees space when it returns. Pins left by a
daemon that died are cleared at the next mount.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pyfuse3

ROOT = pyfuse3.ROOT_INODE


class InodeTable:
    def __init__(self, root_ino: int, unpin: Callable[[int, str], None]):
        self._root_ino = root_ino
        self._unpin = unpin  # (inode, pin): frees a dropped inode's st_ino (removes the pin, its last link)
        self.paths: dict[int, set[str]] = {ROOT: {""}}
        self.by_path: dict[str, int] = {"": ROOT}
        self.lookups: dict[int, int] = {ROOT: 1}
        self.fds: dict[int, set[int]] = {}
        # inodes whose name the daemon gave to another file (a following mount's refresh) while the kernel may
        # still resolve the name to them: an open by that stale inode gets the file that has the name now
        self.stale: dict[int, str] = {}
        self.pins: dict[int, str] = {}  # inodes without a name whose st_ino must stay taken: pin path by inode

    def ino_of(self, st: os.stat_result) -> int:
        return ROOT if st.st_ino == self._root_ino else st.st_ino

    def path(self, inode: int) -> str | None:
        """Any current path of the inode ('' for the root), or None if it has none left (unlinked)."""
        ps = self.paths.get(inode)
        if not ps:
            return None
        return next(iter(ps))

    def remember(self, inode: int, path: str, count: int = 1) -> None:
        """The kernel now knows `inode` by `path`; take `count` lookup references on it."""
        old = self.by_path.get(path)
        if old is not None and old != inode:
            self.paths.get(old, set()).discard(path)
        self.by_path[path] = inode
        self.paths.setdefault(inode, set()).add(path)
        self.lookups[inode] = self.lookups.get(inode, 0) + count

    def forget(self, inode: int, n: int) -> None:
        left = self.lookups.get(inode, 0) - n
        if left > 0:
            self.lookups[inode] = left
            return
        self.lookups.pop(inode, None)
        if inode != ROOT and not self.fds.get(inode):
            self._drop_inode(inode)

    def _drop_inode(self, inode: int) -> None:
        self.stale.pop(inode, None)
        for p in self.paths.pop(inode, ()):
            if self.by_path.get(p) == inode:
                del self.by_path[p]
        pin = self.pins.pop(inode, None)
        if pin is not None:
            self._unpin(inode, pin)  # only now may the file system give its st_ino to another file

    def pinned(self, inode: int, pin: str) -> None:
        """`inode` lost its last name and its last link is `pin` now: kept until it is dropped (at once if
        neither the kernel nor an fd holds it)."""
        self.pins[inode] = pin
        if inode not in self.lookups and not self.fds.get(inode):
            self._drop_inode(inode)

    def unlinked(self, inode: int, path: str) -> None:
        ps = self.paths.get(inode)
        if ps is not None:
            ps.discard(path)
        if self.by_path.get(path) == inode:
            del self.by_path[path]

    def replaced(self, inode: int, path: str) -> None:
        """The daemon removed `path` or put another file there: `inode` loses the name (as after an unlink or a
        rename over it), and a kernel that still resolves the name to it is sent to whatever has it now."""
        self.unlinked(inode, path)
        if inode in self.lookups or inode in self.fds:
            self.stale[inode] = path

    def renamed(self, old: str, new: str, is_dir: bool) -> None:
        """Rewrite every known path under `old` (a file, or a directory and all below it) to live under `new`.

        Only a directory rename walks the table; the broker never renames directories, so the common
        case (config `.tmp` -> name) stays O(1)."""
        self.drop_path(new)
        moved = [old] if old in self.by_path else []
        if is_dir:
            prefix = old + "/"
            moved += [p for p in self.by_path if p.startswith(prefix)]
        for p in moved:
            inode = self.by_path.pop(p)
            q = new + p[len(old):]
            ps = self.paths.setdefault(inode, set())
            ps.discard(p)
            ps.add(q)
            self.by_path[q] = inode

    def drop_path(self, path: str) -> None:
        """A path was replaced (rename over it): whichever inode held it no longer does."""
        inode = self.by_path.pop(path, None)
        if inode is not None:
            self.paths.get(inode, set()).discard(path)

    def opened(self, inode: int, fd: int) -> None:
        self.fds.setdefault(inode, set()).add(fd)

    def closed(self, inode: int, fd: int) -> None:
        s = self.fds.get(inode)
        if s is not None:
            s.discard(fd)
            if not s:
                del self.fds[inode]
                if inode not in self.lookups:
                    self._drop_inode(inode)

    def any_fd(self, inode: int) -> int | None:
        s = self.fds.get(inode)
        return next(iter(s)) if s else None
