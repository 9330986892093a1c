"""The virtual, read-only `/.tierfs/` control directory: inspection with nothing but `ls` and `cat`.

Each file is a provider that renders its text when it is opened (a consistent snapshot per open) or stat'ed
(so `ls -l` shows a real size). Inode numbers live far above any real st_ino so they can never collide.

A view that lists every segment is added with `add_snapshot`: on the trio loop it only copies what it needs, in
steps between which the loop serves other requests; the text is made from that copy in a worker thread
(`render_async`, `attrs_async`). With 100,000 segments a render on the loop stopped every FUSE request for 1.5 s.
"""

from __future__ import annotations

import gc
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, NamedTuple

import pyfuse3
import trio

NAME = ".tierfs"
DIR_INODE = 1 << 62
_FIRST_FILE_INODE = DIR_INODE + 1

Provider = Callable[[], str]
# a snapshot taken on the loop: a generator that yields where the loop may run other tasks, and returns the copy
Snapshotter = Callable[[], Generator[None, None, Any]]
REUSE_SECONDS = 0.5


@dataclass(frozen=True)
class _View:
    make: Callable[..., str | list[str]]  # () -> text, or (snapshot) -> text or its pieces, in a worker thread
    take: Snapshotter | None = None


def _encoded(text: str | list[str]) -> bytes:
    """The text as bytes; pieces are encoded one by one and joined once (a whole 27 MiB text copied, concatenated
    and encoded in single C calls held the GIL ~0.1 s)."""
    return text.encode() if isinstance(text, str) else b"".join([p.encode() for p in text])


class _Done(NamedTuple):
    copy: Any


def _steps(take: Snapshotter) -> Iterator[_Done | None]:
    """take()'s steps (None), then _Done with its copy."""
    copy = yield from take()
    yield _Done(copy)


def _take_now(take: Snapshotter) -> Any:
    """The whole snapshot at once (a caller that cannot await)."""
    return next(s for s in _steps(take) if s is not None).copy


async def _take_paced(take: Snapshotter) -> Any:
    """The snapshot, letting the loop run other tasks at each step."""
    for s in _steps(take):
        if s is not None:
            return s.copy
        await trio.lowlevel.checkpoint()
    raise AssertionError("unreachable: _steps ends with _Done")


class ControlDir:
    def __init__(self, uid: int, gid: int) -> None:
        self._views: dict[str, _View] = {}
        self._inodes: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._uid, self._gid = uid, gid
        self._mounted_ns = time.time_ns()
        self._rendered: dict[int, tuple[float, bytes]] = {}
        self._off_loop = trio.Lock()  # one render in a thread at a time: a queue of `cat`s holds one snapshot

    def add(self, name: str, provider: Provider) -> None:
        """A small view, rendered on the loop."""
        self._add(name, _View(provider))

    def add_snapshot(self, name: str, take: Snapshotter, render: Callable[[Any], str | list[str]]) -> None:
        """A large view: `take()` copies what it needs on the loop (no live object may be in the copy: the loop
        changes them while the thread renders), `render(copy)` makes the text, or its pieces, in a worker
        thread."""
        self._add(name, _View(render, take))

    def _add(self, name: str, view: _View) -> None:
        ino = _FIRST_FILE_INODE + len(self._inodes)
        self._views[name] = view
        self._inodes[name] = ino
        self._names[ino] = name

    @staticmethod
    def owns(inode: int) -> bool:
        return inode >= DIR_INODE

    def names(self) -> list[str]:
        return sorted(self._views)

    def inode_of(self, name: str) -> int | None:
        return self._inodes.get(name)

    def _reusable(self, inode: int, reuse: bool) -> bytes | None:
        hit = self._rendered.get(inode)
        if reuse and hit is not None and time.monotonic() - hit[0] < REUSE_SECONDS:
            return hit[1]
        return None

    def _keep(self, inode: int, text: bytes | Exception) -> bytes:
        if isinstance(text, Exception):  # an inspection bug must never take the mount down
            text = f"error rendering {self._names[inode]}: {type(text).__name__}: {text}\n".encode()
        self._rendered[inode] = (time.monotonic(), text)  # from the end of the render: slow renders still count
        return text

    def render(self, inode: int, reuse: bool = False) -> bytes:
        """The file's text, rendered on the loop. A `cat` asks for it at lookup (a path walk: always rendered
        afresh), then getattr and open, which reuse that render if it finished less than REUSE_SECONDS ago: a
        store with 100,000 segments is walked once per `cat`, not three times, and content is never older than
        the path walk that found it."""
        hit = self._reusable(inode, reuse)
        if hit is not None:
            return hit
        v = self._views[self._names[inode]]
        try:
            text: bytes | Exception = _encoded(v.make(_take_now(v.take)) if v.take else v.make())
        except Exception as e:  # noqa: BLE001 - shown as the file's text
            text = e
        return self._keep(inode, text)

    async def render_async(self, inode: int, reuse: bool = False) -> bytes:
        """render(), with a view added by add_snapshot made in a worker thread from a copy taken on the loop in
        steps: the loop keeps serving requests meanwhile."""
        v = self._views[self._names[inode]]
        if v.take is None:
            return self.render(inode, reuse)
        async with self._off_loop:
            hit = self._reusable(inode, reuse)  # rendered while this one waited
            if hit is not None:
                return hit
            # The cyclic garbage collector waits meanwhile: the copy and the render make a few container objects
            # per row, all freed by reference counting, which with the collector on set off full collections of
            # the daemon's whole heap, the GIL held throughout (0.1-0.6 s at 100,000 rows, measured).
            collecting = gc.isenabled()
            gc.disable()
            try:
                snap = await _take_paced(v.take)
                text: bytes | Exception = await trio.to_thread.run_sync(lambda: _encoded(v.make(snap)))
            except Exception as e:  # noqa: BLE001 - shown as the file's text
                text = e
            finally:
                if collecting:
                    gc.enable()
            return self._keep(inode, text)

    async def attrs_async(self, inode: int, fresh: bool = False) -> pyfuse3.EntryAttributes:
        """attrs(), its size from render_async."""
        if inode == DIR_INODE:
            return self.attrs(inode)
        return self.attrs(inode, size=len(await self.render_async(inode, reuse=not fresh)))

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
