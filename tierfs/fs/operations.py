"""pyfuse3 Operations: the store as the broker sees it, backed 1:1 by the hot dir.

Every handler is wrapped by `_handler`, which times it into FsStats and turns failures into errno replies:
an OSError becomes its own errno, anything else is logged with the path and answered EIO, so a bug in one
request can never kill the daemon. Local file I/O runs inline on the trio loop (a thread hop costs more than a
page-cache pread); a large read of an untiered file answers holes as zeros and leaves the loop only for what is
not cached (tierfs.fs.localread); fsync and directory scans, which can take milliseconds, go to worker threads of
their own. No request on a hot file awaits the network: only reads of evicted bytes and writes or truncates of a
tiered segment that must fetch first wait on the object store, and the engine lets at most mount.max_store_waiters
of them do so (tierfs.tier.storewait), so mount.max_tasks workers always stay free for the rest.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import stat
import time
from types import MappingProxyType
from typing import Any, Awaitable, Callable, Mapping

import pyfuse3
import trio

from tierfs import failpoints
from tierfs.config import Config
from tierfs.fs import control
from tierfs.fs.control import ControlDir
from tierfs.fs.hotdir import PINNED_DIR, HotDir, pin_path, set_size
from tierfs.fs.inodes import ROOT, InodeTable
from tierfs.fs.localread import LARGE as LARGE_READ, LocalReader
from tierfs.fs.stats import FsStats
from tierfs.store.paths import classify
from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.fs")

STATE_DIR_NAME = ".tierfs"  # inside the hot dir: catalog, lock, log. Shadowed by the control dir in the mount.
_CONTROL_FH_BASE = 1 << 40
PRIME_GAP_SECONDS = 1.0  # a writer filling a page a second or faster (4 KiB/s, 200 ConsumeQueue units/s) is primed
_EXPECTED_ERRNOS = frozenset((errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EAGAIN))
# answered EROFS on a read-only mount (the kernel's `ro` refuses most of them first; this is the backstop)
_MODIFYING = frozenset(("setattr", "mknod", "mkdir", "symlink", "link", "unlink", "rmdir", "rename", "create",
                        "write", "setxattr", "removexattr", "fallocate"))

DAEMON_UMASK = 0o077  # the daemon's own files (state, log, jobs, posix object store) are private to its user


def _handler(name: str) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    def deco(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def wrapper(self: "TierOperations", *args: Any) -> Any:
            t0 = time.perf_counter_ns()
            failed = False
            try:
                if failpoints.enabled():
                    failpoints.hit("fs." + name)
                if self.read_only and name in _MODIFYING:
                    raise pyfuse3.FUSEError(errno.EROFS)
                return await fn(self, *args)
            except pyfuse3.FUSEError as e:
                failed = e.errno not in _EXPECTED_ERRNOS
                raise
            except OSError as e:
                failed = e.errno not in _EXPECTED_ERRNOS
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
            except (trio.Cancelled, KeyboardInterrupt):
                raise
            except BaseException:
                failed = True
                log.exception("%s failed (%s); answered EIO", name, self.describe(args))
                raise pyfuse3.FUSEError(errno.EIO) from None
            finally:
                self.stats.record(name, time.perf_counter_ns() - t0, failed)

        return wrapper

    return deco


# Directories up to this st_size are listed on the loop: a listdir of a few hundred names takes microseconds, a
# worker-thread hop ~100 us, and a store with 100,000 ConsumeQueue files has tens of thousands of small dirs.
_INLINE_LISTDIR_BYTES = 32 << 10


class _DirHandle:
    __slots__ = ("inode", "path", "names", "small")

    def __init__(self, inode: int, path: str, small: bool = False):
        self.inode = inode
        self.path = path
        self.names: list[str] | None = None
        self.small = small


class TierOperations(pyfuse3.Operations):
    enable_writeback_cache = True

    def __init__(self, hot_dir: str, config: Config, stats: FsStats | None = None, engine: Engine | None = None):
        super().__init__()
        self.hot = os.path.abspath(hot_dir)
        self.hotdir = HotDir(self.hot)  # every hot-dir syscall is relative to its fd (no PATH_MAX overflow)
        self.config = config
        self.enable_writeback_cache = bool(config["mount.writeback_cache"])
        self.timeout = float(config["mount.attr_timeout"])
        self.stats = stats or FsStats()
        self.local = LocalReader()
        # worker threads of hot-file requests (fsync, large directory listings): their own, never queued behind
        # the object store calls that other parts of the daemon run in trio's default thread pool
        self.threads = trio.CapacityLimiter(int(config["mount.max_tasks"]))
        self.inodes = InodeTable(os.lstat(self.hot).st_ino, self._unpin)
        self._clear_pins()
        self.control = ControlDir(os.getuid(), os.getgid())
        self._fh_inode: dict[int, int] = {}
        self._dirs: dict[int, _DirHandle] = {}
        self._control_fh: dict[int, bytes] = {}
        self._next_handle = 1
        self._is_root = os.geteuid() == 0
        self.engine = engine
        self.read_only = bool(getattr(engine, "read_only", False))  # a mount from a bucket snapshot
        # the engine's TIERED index by st_ino, read-only here: one dict lookup per read and write decides whether
        # the engine must see it, and a method call per request would cost every local read
        self._tiered: Mapping[int, Any] = MappingProxyType(engine.tiered if engine is not None else {})
        self._flusher_fh: set[int] = set()  # opened by our own flusher: its fsync needs no fsync of the hot file
        # writable handles of files a writer may fill page by page: where the next small READ of a sequential
        # writer is due, and when the last one came (tierfs.tier.primer; -1 until its first one)
        self._prime_next: dict[int, tuple[int, float]] = {}
        self._primer = engine.primer if engine is not None and engine.primer.window and not self.read_only else None

    # ---------------------------------------------------------------- helpers

    def _clear_pins(self) -> None:
        """A new mount: no kernel holds any inode yet, so what a previous daemon pinned can go."""
        pinned = os.path.join(self.hot, PINNED_DIR)  # files that lost their last name (inodes.py)
        os.makedirs(pinned, mode=0o700, exist_ok=True)
        for name in os.listdir(pinned):
            self._remove_pin(f"{PINNED_DIR}/{name}")

    def _unpin(self, inode: int, pin: str) -> None:
        """The kernel and every fd are done with an inode that has no name: what the engine keeps by its st_ino
        goes first, then the pin, after which the file system may give that st_ino to a new file."""
        if self.engine is not None:
            self.engine.inode_freed(inode)
        self._remove_pin(pin)

    def _remove_pin(self, pin: str) -> None:
        try:
            try:
                self.hotdir.unlink(pin)
            except IsADirectoryError:
                self.hotdir.rmdir(pin)
        except FileNotFoundError:
            pass
        except OSError as e:  # bookkeeping of a FORGET or RELEASE: logged, never a failed request
            log.warning("could not remove %s/%s: %s", self.hot, pin, e)


    def describe(self, args: tuple) -> str:
        """Best-effort path of a request's inode or handle, for log lines."""
        if not args:
            return "-"
        first = args[0]
        if isinstance(first, int):
            ino = self._fh_inode.get(first, first)
            p = self.inodes.path(ino)
            if p is not None:
                return "/" + p
            return f"inode {first}"
        return repr(first)

    def _rel(self, inode: int) -> str:
        p = self.inodes.path(inode)
        if p is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return p

    def _child(self, parent: int, name: bytes) -> str:
        if parent == ROOT and name == control.NAME.encode():
            raise pyfuse3.FUSEError(errno.EPERM)  # the control dir's name is reserved
        if control.ControlDir.owns(parent):
            raise pyfuse3.FUSEError(errno.EROFS)
        p = self._rel(parent)
        n = os.fsdecode(name)
        return p + "/" + n if p else n

    def _attrs(self, st: os.stat_result, inode: int) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = inode
        e.generation = 0
        e.entry_timeout = self.timeout
        e.attr_timeout = self.timeout
        e.st_mode = st.st_mode
        # a pinned inode's one link is its pin, which is no name of it (a stale one's attributes are another file's)
        e.st_nlink = 0 if inode in self.inodes.pins and inode not in self.inodes.stale else st.st_nlink
        e.st_uid = st.st_uid
        e.st_gid = st.st_gid
        e.st_rdev = st.st_rdev
        e.st_size = st.st_size
        e.st_atime_ns = st.st_atime_ns
        t = self._tiered.get(inode)
        # fetches and evictions touch the hot file; the broker's retention must see the last *data* write
        e.st_mtime_ns = t.mtime_ns if t is not None else st.st_mtime_ns
        e.st_ctime_ns = st.st_ctime_ns
        e.st_blksize = st.st_blksize
        e.st_blocks = st.st_blocks
        return e

    def _entry(self, rel: str) -> pyfuse3.EntryAttributes:
        """lstat a path, register it, and answer with one new lookup reference."""
        st = self.hotdir.lstat(rel)
        ino = self.inodes.ino_of(st)
        self.inodes.remember(ino, rel)
        return self._attrs(st, ino)

    def _stat_inode(self, inode: int) -> os.stat_result:
        rel = self.inodes.path(inode)
        if rel is not None:
            try:
                return self.hotdir.lstat(rel)
            except FileNotFoundError:
                pass
        fd = self.inodes.any_fd(inode)
        if fd is not None:
            return os.fstat(fd)  # unlinked but still open or mapped
        stale = self.inodes.stale.get(inode)
        if stale is not None:  # its name went to a newer file behind the kernel's back: that file's attributes
            return self.hotdir.lstat(stale)
        pin = self.inodes.pins.get(inode)
        if pin is not None:  # unlinked and closed, but the kernel still holds it (e.g. to flush its ctime)
            return self.hotdir.lstat(pin)
        raise pyfuse3.FUSEError(errno.ENOENT)

    def _chown_new(self, rel: str, ctx: pyfuse3.RequestContext, fd: int | None = None) -> None:
        if not self._is_root or (ctx.uid == os.geteuid() and ctx.gid == os.getegid()):
            return  # already owned by the caller: skip the syscall (a third of a create's cost)
        if fd is not None:
            os.fchown(fd, ctx.uid, ctx.gid)
        else:
            self.hotdir.lchown(rel, ctx.uid, ctx.gid)

    def _exact_mode(self, target: str | int, want: int, is_dir: bool = False) -> None:
        """Give a new file exactly `want` (the caller's mode minus the caller's umask): the daemon's own umask
        (DAEMON_UMASK, for its private files) must not apply to the broker's. A no-op when it took nothing away;
        a setgid bit the new directory inherited from its parent stays."""
        if not want & DAEMON_UMASK:
            return
        if isinstance(target, int):
            os.fchmod(target, want)
            return
        if is_dir:
            want |= self.hotdir.lstat(target).st_mode & stat.S_ISGID
        self.hotdir.chmod(target, want)

    @staticmethod
    def _backing_flags(flags: int) -> int:
        """Flags for the backing fd. O_DIRECT is stripped (the page cache is the kernel's job here); with the
        writeback cache the kernel may read to fill partial pages and implements O_APPEND itself."""
        flags &= ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL | os.O_NOCTTY)
        if flags & os.O_ACCMODE == os.O_WRONLY:
            flags = (flags & ~os.O_ACCMODE) | os.O_RDWR
        return flags & ~os.O_APPEND

    # ---------------------------------------------------------------- names and attributes

    @_handler("lookup")
    async def lookup(self, parent: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if control.ControlDir.owns(parent):
            if name == b"..":
                return await self.getattr(ROOT, ctx)
            ino = self.control.inode_of(os.fsdecode(name))
            if ino is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return await self.control.attrs_async(ino, fresh=True)
        if parent == ROOT and name == control.NAME.encode():
            return self.control.attrs(control.DIR_INODE)
        if name == b".":
            return self._entry(self._rel(parent))
        if name == b"..":
            p = self._rel(parent)
            return self._entry(p.rpartition("/")[0])
        p = self._rel(parent)
        n = os.fsdecode(name)
        return self._entry(p + "/" + n if p else n)

    @_handler("forget")
    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for inode, n in inode_list:
            if not control.ControlDir.owns(inode):
                self.inodes.forget(inode, n)

    @_handler("getattr")
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if control.ControlDir.owns(inode):
            return await self.control.attrs_async(inode)
        return self._attrs(self._stat_inode(inode), inode)

    @_handler("setattr")
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if control.ControlDir.owns(inode):
            raise pyfuse3.FUSEError(errno.EROFS)
        fd = fh if fh is not None and fh in self._fh_inode else None
        rel = self.inodes.path(inode)
        if rel is None:
            rel = self.inodes.pins.get(inode)  # unlinked: its pin is the same inode
        if fd is None and rel is None:
            fd = self.inodes.any_fd(inode)
        if fd is None and rel is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if fields.update_size:
            if self.engine is not None:
                await self.engine.truncate_barrier(inode)
                t = self._tiered.get(inode)
                if t is not None:
                    await self.engine.before_truncate(t, inode, attr.st_size)
                self.engine.note_write(inode)  # a truncate voids a seal or upload in flight, as a write does
            if self.engine is not None and self.engine.appendlog is not None:
                self.engine.appendlog.note_truncate(inode, attr.st_size)
            reserve = self._reserves(rel)
            if fd is not None:
                set_size(fd, attr.st_size, reserve)
            else:
                self.hotdir.truncate(rel, attr.st_size, reserve)
        if fields.update_mode:
            st = self._stat_inode(inode)
            if not stat.S_ISLNK(st.st_mode):
                if fd is not None:
                    os.fchmod(fd, stat.S_IMODE(attr.st_mode))
                else:
                    self.hotdir.chmod(rel, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            if fd is not None:
                os.fchown(fd, uid, gid)
            else:
                self.hotdir.lchown(rel, uid, gid)
        if fields.update_atime or fields.update_mtime:
            st = self._stat_inode(inode)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            if fd is not None:
                os.utime(fd, ns=(atime, mtime))
            else:
                self.hotdir.utime(rel, (atime, mtime))
        return self._attrs(self._stat_inode(inode), inode)

    def _reserves(self, rel: str | None) -> bool:
        """Whether a truncate growing the file at `rel` allocates the range first (mount.reserve_on_truncate):
        by default the store's segments only, the files a broker sizes with ftruncate and fills through a shared
        mapping; other files stay sparse as on a native disk. Classified by path (the kind of file, not its
        identity); an unlinked file (no name) is not reserved for."""
        mode = self.config["mount.reserve_on_truncate"]
        if mode == "segments":
            return rel is not None and classify(rel).is_segment
        return mode == "all"

    @_handler("readlink")
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return os.fsencode(self.hotdir.readlink(self._rel(inode)))

    @_handler("statfs")
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        sv = os.statvfs(self.hot)
        out = pyfuse3.StatvfsData()
        out.f_bsize = sv.f_bsize
        out.f_frsize = sv.f_frsize
        out.f_blocks, out.f_bfree, out.f_bavail = self.capacity_blocks(sv, self.remote_only_bytes())
        out.f_files = sv.f_files
        out.f_ffree = sv.f_ffree
        out.f_favail = sv.f_favail
        out.f_namemax = sv.f_namemax
        return out

    def open_inodes(self) -> set[int]:
        """Inodes open through the mount now (their pages may be dirty in the kernel)."""
        return set(self._fh_inode.values())

    def remote_only_bytes(self) -> int:
        """Bytes of tiered segments that are not on the local disk (the store's size beyond the hot dir)."""
        if self.engine is None:
            return 0
        return self.engine.remote_bytes()

    def capacity_blocks(self, sv: os.statvfs_result, remote_bytes: int = 0) -> tuple[int, int, int]:
        """(blocks, free, available) the broker plans against (DESIGN §9). The broker acts on one number,
        used / (used + available) with used = blocks - free (format §11: > 75 % deletes, > 85 % deletes
        regardless of age, > 90 % rejects writes), so that ratio is what this sets.

        capacity 0: the hot dir's own numbers. Remote-only bytes count nowhere: tiering frees local space and
        retention follows time, as the store may outgrow the local disk.
        capacity C: the total is C, and the ratio is the larger of the store's logical use (local use plus
        remote-only bytes) over C and the hot dir's own ratio, so retention follows the configured capacity
        and real local pressure from unsealed data still shows through. Available never exceeds what the hot
        dir really has; used is scaled to give the ratio (df's Use% is the same ratio)."""
        cap = int(self.config["statfs.capacity_bytes"])
        if not cap:
            return sv.f_blocks, sv.f_bfree, sv.f_bavail
        blocks = max(cap // sv.f_frsize, 1)
        local_used = sv.f_blocks - sv.f_bfree
        local = local_used / (local_used + sv.f_bavail) if local_used + sv.f_bavail else 1.0
        logical = (local_used + remote_bytes // sv.f_frsize) / blocks
        ratio = min(max(local, logical), 1.0)
        avail = min(sv.f_bavail, int(blocks * (1.0 - ratio)))
        used = blocks - avail if avail == 0 else min(math.ceil(ratio * avail / (1.0 - ratio)), blocks - avail)
        return blocks, blocks - used, avail

    # ---------------------------------------------------------------- namespace changes

    @_handler("mknod")
    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        rel = self._child(parent, name)
        self.hotdir.mknod(rel, mode & ~ctx.umask, rdev)
        self._chown_new(rel, ctx)
        self._exact_mode(rel, mode & ~ctx.umask & 0o7777)
        return self._entry(rel)

    @_handler("mkdir")
    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        rel = self._child(parent, name)
        self.hotdir.mkdir(rel, mode & ~ctx.umask & 0o7777)
        self._chown_new(rel, ctx)
        self._exact_mode(rel, mode & ~ctx.umask & 0o7777, is_dir=True)
        return self._entry(rel)

    @_handler("symlink")
    async def symlink(self, parent: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        rel = self._child(parent, name)
        self.hotdir.symlink(os.fsdecode(target), rel)
        self._chown_new(rel, ctx)
        return self._entry(rel)

    @_handler("link")
    async def link(self, inode: int, new_parent: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if control.ControlDir.owns(inode):
            raise pyfuse3.FUSEError(errno.EROFS)
        rel = self._child(new_parent, new_name)
        src = self.inodes.path(inode)
        if src is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        self.hotdir.link(src, rel)
        return self._entry(rel)

    @_handler("unlink")
    async def unlink(self, parent: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        rel = self._child(parent, name)
        st = self.hotdir.remove_pinned(rel)
        if st is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        ino = self.inodes.ino_of(st)
        self.inodes.unlinked(ino, rel)
        if st.st_nlink <= 1:
            self.inodes.pinned(ino, pin_path(st.st_ino))
        if self.engine is not None:
            await self.engine.namespace.unlinked(rel, ino, st.st_nlink, self.inodes.any_fd(ino),
                                                 self.inodes.path(ino))
        await self._free_blocks_if_unreachable(ino)

    @_handler("rmdir")
    async def rmdir(self, parent: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        rel = self._child(parent, name)
        st = self.hotdir.lstat(rel)
        if not stat.S_ISDIR(st.st_mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if self.hotdir.listdir(rel):
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        self.hotdir.rename(rel, pin_path(st.st_ino))  # nothing else adds names meanwhile: this loop is the writer
        ino = self.inodes.ino_of(st)
        self.inodes.unlinked(ino, rel)
        self.inodes.pinned(ino, pin_path(st.st_ino))

    @_handler("rename")
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, flags: int,
                     ctx: pyfuse3.RequestContext) -> None:
        old = self._child(parent_old, name_old)
        new = self._child(parent_new, name_new)
        old_st = self.hotdir.lstat(old)
        is_dir = stat.S_ISDIR(old_st.st_mode)
        try:
            replaced = self.hotdir.lstat(new)
        except FileNotFoundError:
            replaced = None
        # RENAME_NOREPLACE fails and RENAME_EXCHANGE keeps both: only a plain rename takes a file's last name
        pin = replaced is not None and not flags & 3 and replaced.st_ino != old_st.st_ino \
            and (replaced.st_nlink <= 1 or stat.S_ISDIR(replaced.st_mode))  # a directory has no other name
        if pin:
            self._rename_over(old, new, old_st, replaced)  # type: ignore[arg-type]
        else:
            self.hotdir.rename(old, new, flags)
        if flags & 2:  # RENAME_EXCHANGE: both names stay, swapped
            tmp = "\0exchange"
            self.inodes.renamed(old, tmp, is_dir)
            self.inodes.renamed(new, old, stat.S_ISDIR(self.hotdir.lstat(old).st_mode))
            self.inodes.renamed(tmp, new, is_dir)
        else:
            self.inodes.renamed(old, new, is_dir)
        if pin:
            self.inodes.pinned(self.inodes.ino_of(replaced), pin_path(replaced.st_ino))  # type: ignore[union-attr]
        if self.engine is not None:
            gone = None
            if not flags & 2 and replaced is not None and replaced.st_ino != old_st.st_ino \
                    and not stat.S_ISDIR(replaced.st_mode):
                ino = self.inodes.ino_of(replaced)
                gone = (ino, replaced.st_nlink, self.inodes.any_fd(ino), self.inodes.path(ino))
            await self.engine.namespace.renamed(old, new, flags, is_dir, gone)
        if pin:
            await self._free_blocks_if_unreachable(self.inodes.ino_of(replaced))  # type: ignore[arg-type]

    async def _free_blocks_if_unreachable(self, inode: int) -> None:
        """An unlinked file that no fd holds can never be read again, yet its pin stays until the kernel FORGETs
        the inode, and that may come after the caller's next write. Its blocks go now: space an unlink (or the
        last close of an unlinked file) frees is free when it returns, as on a local disk, so a writer that
        deleted a file to make room does not get ENOSPC."""
        if inode not in self.inodes.pins or self.inodes.any_fd(inode) is not None:
            return  # nothing to free now: no unlink waits on a seal probe for nothing
        if self.engine is not None:
            await self.engine.truncate_barrier(inode)  # a seal probe mapping it finishes first (no SIGBUS)
        pin = self.inodes.pins.get(inode)
        if pin is None or self.inodes.any_fd(inode) is not None:  # re-checked after the await: opened meanwhile
            return
        try:
            self.hotdir.empty_pinned(pin)
        except OSError as e:  # its blocks then go with the pin, at the FORGET
            log.warning("could not free the blocks of unlinked inode %d (%s) before it is forgotten: %s", inode,
                        pin, e)

    def _rename_over(self, old: str, new: str, old_st: os.stat_result, replaced: os.stat_result) -> None:
        """rename(old, new) where `new` is the last name of another file or directory: pin that one first."""
        if not stat.S_ISDIR(replaced.st_mode):
            self.hotdir.replace_pinned(old, new)
            return
        # a directory has no second link: check what rename(2) would, move it to its pin, then rename
        if not stat.S_ISDIR(old_st.st_mode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if self.hotdir.listdir(new):
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        self.hotdir.rename(new, pin_path(replaced.st_ino))
        try:
            self.hotdir.rename(old, new)
        except BaseException:
            self.hotdir.rename(pin_path(replaced.st_ino), new)
            raise

    def name_gone(self, rel: str, old: os.stat_result) -> int | None:
        """The daemon itself removed `rel` or gave it to another file (a following mount's refresh). The inode
        that had the name loses it, as in an unlink or a rename over it (the follower pinned it if that was its
        last name). Returns an fd held open on that inode, through which its readers go on, or None."""
        ino = self.inodes.ino_of(old)
        self.inodes.replaced(ino, rel)
        held = self.inodes.any_fd(ino)
        if old.st_nlink <= 1:
            self.inodes.pinned(ino, pin_path(old.st_ino))
        return held

    # ---------------------------------------------------------------- files

    def _new_file_handle(self, inode: int, fd: int, rel: str | None, flags: int) -> pyfuse3.FileInfo:
        self._fh_inode[fd] = inode
        self.inodes.opened(inode, fd)
        if self._primer is not None and flags & os.O_ACCMODE != os.O_RDONLY:
            self._prime_next[fd] = (-1, 0.0)
        return pyfuse3.FileInfo(fh=fd, keep_cache=True)

    @_handler("open")
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if control.ControlDir.owns(inode):
            if flags & os.O_ACCMODE != os.O_RDONLY or inode == control.DIR_INODE:
                raise pyfuse3.FUSEError(errno.EROFS if inode != control.DIR_INODE else errno.EISDIR)
            fh = _CONTROL_FH_BASE + self._next_handle
            self._next_handle += 1
            self._control_fh[fh] = await self.control.render_async(inode, reuse=True)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        if self.read_only and (flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC):
            raise pyfuse3.FUSEError(errno.EROFS)
        rel = self.inodes.path(inode)
        if rel is None:  # unlinked, but the kernel still holds it (open by handle): reopen through /proc
            fd0 = self.inodes.any_fd(inode)
            stale = self.inodes.stale.get(inode)
            if fd0 is not None:
                fd = os.open(f"/proc/self/fd/{fd0}", self._backing_flags(flags))
            elif stale is not None:  # a name the daemon gave to a newer file: open that one, by its own inode
                fd = self.hotdir.open(stale, self._backing_flags(flags))
                inode, rel = self.inodes.ino_of(os.fstat(fd)), stale
            else:
                raise pyfuse3.FUSEError(errno.ENOENT)
        else:
            await self._before_o_trunc(inode, flags)
            fd = self.hotdir.open(rel, self._backing_flags(flags))
        t = self._tiered.get(inode) if self._tiered else None
        if t is not None:  # a reader of a tiered file: the engine keeps its fetched buffers while it is open
            self.engine.opened(fd, t)  # type: ignore[union-attr]
        if self.engine is not None and ctx.pid in self.engine.flusher_pids:
            self._flusher_fh.add(fd)
        return self._new_file_handle(inode, fd, rel, flags)

    async def _before_o_trunc(self, inode: int, flags: int) -> None:
        """The kernel passes O_TRUNC to open (atomic_o_trunc): a tiered segment must leave the tiered state
        before its hot file is emptied, exactly as for a truncating setattr."""
        if flags & os.O_TRUNC and self.engine is not None:
            await self.engine.truncate_barrier(inode)
            t = self._tiered.get(inode)
            if t is not None:
                await self.engine.before_truncate(t, inode, 0)
            self.engine.note_write(inode)

    @_handler("create")
    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        rel = self._child(parent, name)
        bflags = self._backing_flags(flags)
        try:
            fd = self.hotdir.open(rel, bflags | os.O_CREAT | os.O_EXCL, mode & ~ctx.umask & 0o7777)
            self._chown_new(rel, ctx, fd)
            self._exact_mode(fd, mode & ~ctx.umask & 0o7777)
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
            await self._before_o_trunc(self.hotdir.lstat(rel).st_ino, flags)
            fd = self.hotdir.open(rel, bflags)
        try:
            entry = self._entry(rel)
        except BaseException:
            os.close(fd)
            raise
        return self._new_file_handle(entry.st_ino, fd, rel, flags), entry

    @_handler("read")
    async def read(self, fh: int, off: int, size: int) -> bytes:
        if fh >= _CONTROL_FH_BASE:
            return self._control_fh[fh][off:off + size]
        t = self._tiered.get(self._fh_inode.get(fh, 0)) if self._tiered else None
        if t is not None:
            data = await self.engine.read(t, self._fh_inode[fh], fh, off, size)  # type: ignore[union-attr]
        elif size < LARGE_READ:
            data = os.pread(fh, size, off)
            if fh in self._prime_next:
                self._page_read_by_writer(fh, off, len(data))
        else:  # not tiered, checked with no await before its hole probe: its holes are real holes
            data = await self.local.pread(fh, size, off)
            t = self._tiered.get(self._fh_inode.get(fh, 0)) if self._tiered else None
            if t is not None:  # tiered (and maybe evicted) while a thread read it: the engine answers
                data = await self.engine.read(t, self._fh_inode[fh], fh, off, size)  # type: ignore[union-attr]
        self.stats.bytes_read += len(data)
        return data

    def _page_read_by_writer(self, fh: int, off: int, size: int) -> None:
        """A small READ on a writable handle: the kernel filling a page before a partial write into it. The
        second one in a row, less than PRIME_GAP_SECONDS after the first, asks the primer to read the next window
        ahead, so the writer's next pages are uptodate; the one after that window (where such a writer is next
        seen) asks again. A slower writer pays a READ per page now and then, which costs it nothing that matters,
        and does not fill the page cache with pages it reaches hours later (a broker has thousands of queues)."""
        expect, last = self._prime_next[fh]
        now = time.monotonic()
        end = off + size
        if off == expect and size and now - last < PRIME_GAP_SECONDS:
            rel = self.inodes.path(self._fh_inode[fh])
            if rel is not None:
                self._primer.want(rel, end)  # type: ignore[union-attr]
                end += self._primer.window  # type: ignore[union-attr]
        self._prime_next[fh] = (end, now)

    @_handler("write")
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if fh >= _CONTROL_FH_BASE:
            raise pyfuse3.FUSEError(errno.EROFS)
        if self.engine is not None:  # by the file's inode, whatever name it was opened by (or none now)
            ino = self._fh_inode[fh]
            t = self._tiered.get(ino)
            if t is not None and not await self.engine.before_write(t, ino, off, buf):
                return len(buf)  # identical rewrite of tiered bytes: nothing changes
            self.engine.note_write(ino)
            if self.engine.appendlog is not None:  # continuous tiering: what is new
                self.engine.appendlog.note_write(ino, self.inodes.path(ino), off, len(buf))
        if not self.enable_writeback_cache:
            n = os.pwrite(fh, buf, off)
        else:
            # With the writeback cache the kernel owns mtime: it stamps it at write(2) or page-fault time and
            # sends it as SETATTR(mtime) when it flushes the inode; this WRITE arrives later (writeback, close),
            # so it must not move the backing file's mtime, or the hot file would say "written at writeback time".
            st = os.fstat(fh)
            n = os.pwrite(fh, buf, off)
            try:
                os.utime(fh, ns=(st.st_atime_ns, st.st_mtime_ns))
            except PermissionError:
                pass  # a non-root daemon writing a file it does not own: the writeback time has to do
        self.stats.bytes_written += n
        return n

    @_handler("flush")
    async def flush(self, fh: int) -> None:
        return None

    @_handler("fsync")
    async def fsync(self, fh: int, datasync: bool) -> None:
        if fh >= _CONTROL_FH_BASE:
            return
        # our flusher's FSYNC comes after the kernel wrote back every dirty page, which is all it wants
        if fh not in self._flusher_fh:
            await trio.to_thread.run_sync(os.fdatasync if datasync else os.fsync, fh, limiter=self.threads)
        if self.engine is not None:
            ino = self._fh_inode[fh]
            self.engine.note_fsync(ino, self.inodes.path(ino))

    @_handler("release")
    async def release(self, fh: int) -> None:
        if fh >= _CONTROL_FH_BASE:
            self._control_fh.pop(fh, None)
            return
        inode = self._fh_inode.pop(fh, None)
        self._flusher_fh.discard(fh)
        self._prime_next.pop(fh, None)
        if self.engine is not None:
            self.engine.release_stream(fh)
        os.close(fh)
        if inode is not None:
            self.inodes.closed(inode, fh)
            if self.inodes.any_fd(inode) is None and self.inodes.path(inode) is None:
                if self.engine is not None:
                    await self.engine.on_released(inode)  # an unlinked file's last holder: its objects may go
                await self._free_blocks_if_unreachable(inode)

    # ---------------------------------------------------------------- directories

    @_handler("opendir")
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        small = False
        if not control.ControlDir.owns(inode):
            rel = self._rel(inode)
            st = self.hotdir.lstat(rel)
            if not stat.S_ISDIR(st.st_mode):
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            small = st.st_size <= _INLINE_LISTDIR_BYTES
        else:
            rel = ""
        h = self._next_handle
        self._next_handle += 1
        self._dirs[h] = _DirHandle(inode, rel, small)
        return h

    @_handler("readdir")
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        d = self._dirs[fh]
        if control.ControlDir.owns(d.inode):
            # like every other dir here, '.' and '..' come first (neither pyfuse3 nor the kernel adds them)
            names = [".", ".."] + self.control.names()
            for i in range(start_id, len(names)):
                if i == 0:
                    attrs = self.control.attrs(control.DIR_INODE)
                elif i == 1:
                    attrs = self._attrs(self.hotdir.lstat(""), ROOT)
                else:
                    attrs = await self.control.attrs_async(self.control.inode_of(names[i]))
                if not pyfuse3.readdir_reply(token, names[i].encode(), attrs, i + 1):
                    return
            return
        if d.names is None or start_id == 0:
            d.names = self._list_dir(d.path) if d.small else await trio.to_thread.run_sync(self._list_dir, d.path,
                                                                                           limiter=self.threads)
        names = d.names
        prefix = d.path + "/" if d.path else ""
        for i in range(start_id, len(names)):
            n = names[i]
            if i < 2:  # '.' and '..': the kernel takes no lookup reference for these
                rel = d.path if i == 0 else d.path.rpartition("/")[0]
                st = self.hotdir.lstat(rel)
                if not pyfuse3.readdir_reply(token, n.encode(), self._attrs(st, self.inodes.ino_of(st)), i + 1):
                    return
                continue
            if d.inode == ROOT and n == control.NAME:
                attrs = self.control.attrs(control.DIR_INODE)
                if not pyfuse3.readdir_reply(token, n.encode(), attrs, i + 1):
                    return
                continue
            rel = prefix + n
            try:
                st = self.hotdir.lstat(rel)
            except FileNotFoundError:
                continue
            ino = self.inodes.ino_of(st)
            if not pyfuse3.readdir_reply(token, os.fsencode(n), self._attrs(st, ino), i + 1):
                return
            self.inodes.remember(ino, rel)  # readdirplus: the kernel took a lookup reference

    def _list_dir(self, rel: str) -> list[str]:
        names = [".", ".."] + self.hotdir.listdir(rel)
        if not rel:  # the state dir is never visible; the control dir takes its name
            if STATE_DIR_NAME in names:
                names.remove(STATE_DIR_NAME)
            names.append(control.NAME)
        return names

    @_handler("releasedir")
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @_handler("fsyncdir")
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        d = self._dirs.get(fh)
        if d is None or control.ControlDir.owns(d.inode):
            return
        fd = self.hotdir.open_dir(d.path)
        try:
            await trio.to_thread.run_sync(os.fsync, fd, limiter=self.threads)
        finally:
            os.close(fd)

    @_handler("access")
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return True  # default_permissions: the kernel already checked mode bits
