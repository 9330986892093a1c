"""The virtual, read-only `/.tierfs/` control directory: inspection with nothing but `ls` and `cat`.

Each file is a provider that renders its text when it is opened (a consistent snapshot per open) or stat'ed
(so `ls -l` shows a real size). Inode numbers live far above any real st_ino so they can never collide.
"""

from __future__ import annotations

import stat
import time
from typing import Callable

import pyfuse3

NAME = ".tierfs"
DIR_INODE = 1 << 62
_FIRST_FILE_INODE = DIR_INODE + 1

Provider = Callable[[], str]
REUSE_SECONDS = 0.5


class ControlDir:
    def __init__(self, uid: int, gid: int) -> None:
        self._providers: dict[str, Provider] = {}
        self._inodes: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._uid, self._gid = uid, gid
        self._mounted_ns = time.time_ns()
        self._rendered: dict[int, tuple[float, bytes]] = {}

    def add(self, name: str, provider: Provider) -> None:
        ino = _FIRST_FILE_INODE + len(self._inodes)
        self._providers[name] = provider
        self._inodes[name] = ino
        self._names[ino] = name

    @staticmethod
    def owns(inode: int) -> bool:
        return inode >= DIR_INODE

    def names(self) -> list[str]:
        return sorted(self._providers)

    def inode_of(self, name: str) -> int | None:
        return self._inodes.get(name)

    def render(self, inode: int, reuse: bool = False) -> bytes:
        """The file's text. A `cat` asks for it at lookup (a path walk: always rendered afresh), then getattr and
        open, which reuse that render if it finished less than REUSE_SECONDS ago: a store with 100,000 segments
        is walked once per `cat`, not three times, and content is never older than the path walk that found it."""
        hit = self._rendered.get(inode)
        if reuse and hit is not None and time.monotonic() - hit[0] < REUSE_SECONDS:
            return hit[1]
        name = self._names[inode]
        try:
            text = self._providers[name]().encode()
        except Exception as e:  # an inspection bug must never take the mount down
            text = f"error rendering {name}: {type(e).__name__}: {e}\n".encode()
        self._rendered[inode] = (time.monotonic(), text)  # from the end of the render: slow renders still count
        return text

    def attrs(self, inode: int, size: int | None = None, fresh: bool = False) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.generation = 0
        a.entry_timeout = 0
        a.attr_timeout = 0
        if inode == DIR_INODE:
            a.st_mode = stat.S_IFDIR | 0o555
            a.st_nlink = 2
            a.st_size = 0
        else:
            a.st_mode = stat.S_IFREG | 0o444
            a.st_nlink = 1
            a.st_size = len(self.render(inode, reuse=not fresh)) if size is None else size
        a.st_uid, a.st_gid = self._uid, self._gid
        now = time.time_ns()
        a.st_atime_ns = now
        a.st_mtime_ns = now if inode != DIR_INODE else self._mounted_ns
        a.st_ctime_ns = a.st_mtime_ns
        a.st_blksize = 4096
        a.st_blocks = (a.st_size + 511) // 512
        return a
