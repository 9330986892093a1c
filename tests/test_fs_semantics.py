"""POSIX semantics of a real tierfs mount, exercised the way an unmodified RocketMQ broker does it
(rocketmq-store-format.md §3, §8, §16): real processes, real syscalls, through the kernel's FUSE client.

Every test gets its own fresh mount (the `mounted` / `mount_store` fixtures), so a test that wedges or kills
the daemon cannot leak into the next. Where a result could come from the kernel page cache instead of the
daemon, the test evicts that one file (`evict`, POSIX_FADV_DONTNEED) or also checks the hot dir directly.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from mountutil import (allocated_bytes, evict, is_root, pid_alive, read_line, requires_fuse, run,
                       run_python, spawn_python, stop_process, wait_for)

pytestmark = [requires_fuse, pytest.mark.timeout(120)]

GiB = 1 << 30
MiB = 1 << 20
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _errno_of(fn, *args) -> int:
    with pytest.raises(OSError) as ei:
        fn(*args)
    return ei.value.errno


def hot_names(m) -> set[str]:
    return set(os.listdir(m.hot)) - {".tierfs"}


# ------------------------------------------------------------------------------------------ sizes and data


def test_ftruncate_growth_to_1gib_is_sparse_and_reads_zeros(mounted):
    """The broker creates every segment with open(O_RDWR|O_CREAT, 0666) + ftruncate(fileSize) (§3.1)."""
    p = mounted.path("00000000000000000000")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        os.ftruncate(fd, GiB)
        assert os.fstat(fd).st_size == GiB
        assert os.pwrite(fd, b"MAGIC", 512 * MiB) == 5
        os.fsync(fd)
        assert os.stat(p).st_size == GiB
        assert mounted.hot_path(p.name).stat().st_size == GiB
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the reads below must come from the daemon
        for off in (0, 4096, 512 * MiB - PAGE, 700 * MiB + 3, GiB - PAGE):
            assert os.pread(fd, PAGE, off) == bytes(PAGE), off
        assert os.pread(fd, 8, 512 * MiB - 3) == b"\0\0\0MAGIC"
        assert os.pread(fd, 4096, GiB - 10) == bytes(10)  # short read at EOF
        assert os.pread(fd, 4096, GiB) == b""
    finally:
        os.close(fd)
    # still sparse in the hot dir: a few pages allocated, not a gibibyte
    assert allocated_bytes(mounted.hot_path(p.name)) < 4 * MiB
    assert os.stat(p).st_blocks * 512 < 4 * MiB


MMAP_WRITER = r"""
import mmap, os, sys
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, size)
m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
for off in range(0, size, 65536 + 17):
    rec = b"rec@%012d;" % off
    m[off:off + len(rec)] = rec
m[size - 5:size] = b"LAST!"
print("written", flush=True)
sys.stdin.readline()          # the parent reads through another process while the pages are still dirty
m.flush()                     # msync(MS_SYNC) over the whole mapping, like MappedByteBuffer.force()
print("synced", flush=True)
sys.stdin.readline()
m.close(); os.close(fd)
"""

READER = r"""
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
bad = []
for off in range(0, size, 65536 + 17):
    rec = b"rec@%012d;" % off
    got = os.pread(fd, len(rec), off)
    if got != rec:
        bad.append((off, got))
if os.pread(fd, 5, size - 5) != b"LAST!":
    bad.append(("last", os.pread(fd, 5, size - 5)))
print("ok" if not bad else "BAD %r" % bad[:3], os.fstat(fd).st_size)
"""


def expected_records(size: int) -> dict[int, bytes]:
    out = {off: b"rec@%012d;" % off for off in range(0, size, 65536 + 17)}
    out[size - 5] = b"LAST!"
    return out


@pytest.mark.parametrize("options", [[], ["mount.writeback_cache=false"]], ids=["writeback", "no-writeback"])
def test_shared_mmap_writes_in_one_process_seen_by_another_and_in_hot_dir(mount_store, options):
    """CommitLog/CQ/index writes are ByteBuffer.put into a MAP_SHARED mapping plus msync (§3.3, §3.4)."""
    mounted = mount_store(options=options)
    size = 8 * MiB
    p = mounted.path("commitlog", "00000000000000000000")
    p.parent.mkdir()
    w = spawn_python(MMAP_WRITER, p, size)
    try:
        assert read_line(w) == "written"
        # a second process sees the dirty, not yet msync'ed pages (one page cache for the mount)
        r = run_python(READER, p, size)
        assert r.stdout.split() == ["ok", str(size)], r.stdout
        w.stdin.write("\n")
        w.stdin.flush()
        assert read_line(w) == "synced"
        # after msync the bytes are in the hot file, while the writer still holds its mapping
        hot = mounted.hot_path("commitlog", p.name).read_bytes()
        assert len(hot) == size
        for off, rec in expected_records(size).items():
            assert hot[off:off + len(rec)] == rec, off
    finally:
        assert stop_process(w) == 0, w.stderr.read()
    # and a reader that must go to the daemon (cache of that file dropped) gets the same bytes
    evict(p)
    r = run_python(READER, p, size)
    assert r.stdout.split() == ["ok", str(size)], r.stdout


def test_pread_pwrite_unaligned_and_across_pages(mounted):
    p = mounted.path("f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        chunks = {0: b"a" * 10, PAGE - 3: b"straddle", 3 * PAGE + 1: os.urandom(3 * PAGE + 5), 20: b"z" * 20}
        for off, data in chunks.items():
            assert os.pwrite(fd, data, off) == len(data)
        size = max(off + len(d) for off, d in chunks.items())
        assert os.fstat(fd).st_size == size
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for off, data in chunks.items():
            assert os.pread(fd, len(data), off) == data, off
        # the gap between 20+20 and PAGE-3 was never written: zeros
        assert os.pread(fd, PAGE - 43, 40) == bytes(PAGE - 43)
        # pwrite far past EOF extends with a hole
        assert os.pwrite(fd, b"end", 10 * MiB) == 3
        assert os.fstat(fd).st_size == 10 * MiB + 3
        assert os.pread(fd, 6, 10 * MiB - 3) == b"\0\0\0end"
    finally:
        os.close(fd)
    hot = mounted.hot_path("f").read_bytes()
    assert len(hot) == 10 * MiB + 3
    for off, data in chunks.items():
        assert hot[off:off + len(data)] == data


def test_fsync_and_fdatasync_reach_the_hot_file_without_close(mounted):
    """The lock file and the CQ (5.3.1+) use write + fsync/fdatasync (§3.3, §8.2)."""
    p = mounted.path("lock")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"lock")
        assert os.fsync(fd) is None
        assert mounted.hot_path("lock").read_bytes() == b"lock"
        os.pwrite(fd, b"x" * 20, 4)
        assert os.fdatasync(fd) is None
        assert mounted.hot_path("lock").read_bytes() == b"lock" + b"x" * 20
    finally:
        os.close(fd)
    dfd = os.open(mounted.mnt, os.O_RDONLY | os.O_DIRECTORY)  # fsync of a directory (fsyncdir)
    try:
        assert os.fsync(dfd) is None
    finally:
        os.close(dfd)


def test_stat_sizes_exact_via_mount_and_hot_dir(mounted):
    sizes = {"empty": 0, "one": 1, "page-1": PAGE - 1, "page": PAGE, "page+1": PAGE + 1, "mib+3": MiB + 3}
    for name, n in sizes.items():
        with open(mounted.path(name), "wb") as f:
            f.write(os.urandom(n))
    for name, n in sizes.items():
        assert os.stat(mounted.path(name)).st_size == n, name
        assert mounted.hot_path(name).stat().st_size == n, name
    os.truncate(mounted.path("mib+3"), 100)  # shrink through the mount
    assert os.stat(mounted.path("mib+3")).st_size == 100
    assert mounted.hot_path("mib+3").stat().st_size == 100
    assert {e.name: e.stat().st_size for e in os.scandir(mounted.mnt) if e.name != ".tierfs"} == \
        {**sizes, "mib+3": 100}


def test_o_direct_aligned_write_and_read(mounted):
    p = mounted.path("direct")
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    src = mmap.mmap(-1, MiB)  # page-aligned buffers
    dst = mmap.mmap(-1, MiB)
    try:
        src.write(os.urandom(MiB))
        assert os.pwrite(fd, src, 0) == MiB
        assert os.pwrite(fd, src[:PAGE], MiB) == PAGE
        assert os.preadv(fd, [dst], 0) == MiB
        assert dst[:] == src[:]
        assert os.fstat(fd).st_size == MiB + PAGE
    finally:
        os.close(fd)
        src_bytes = src[:]
        src.close()
        dst.close()
    assert mounted.hot_path("direct").read_bytes() == src_bytes + src_bytes[:PAGE]


# ------------------------------------------------------------------------------------------ locks


HOLD_LOCK = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)   # fcntl(F_SETLK, {F_WRLCK, SEEK_SET, 0, 1})
os.pwrite(fd, b"lock", 0)
os.fsync(fd)
print("locked", os.getpid(), flush=True)
sys.stdin.read()
"""

TRY_LOCK = r"""
import errno, fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
    print("granted")
except OSError as e:
    fl = struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 1, 0)
    l_type, _, _, _, l_pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, fl))
    print("refused", errno.errorcode[e.errno], l_pid)
"""


def test_fcntl_byte_range_lock_refuses_second_process_until_holder_exits(mounted):
    """The broker's `lock` file: tryLock(0, 1, false) = F_SETLK {F_WRLCK, 0, 1}; failure = already started."""
    p = mounted.path("lock")
    holder = spawn_python(HOLD_LOCK, p)
    try:
        word, pid = read_line(holder).split()
        assert word == "locked"
        r = run_python(TRY_LOCK, p)
        verdict, code, holder_pid = r.stdout.split()
        assert (verdict, code) in (("refused", "EAGAIN"), ("refused", "EACCES")), r.stdout
        assert int(holder_pid) == int(pid) == holder.pid  # F_GETLK names the holder
        # a lock on another byte range does not conflict
        r = run_python("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                       "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 1); print('granted')", p)
        assert r.stdout.strip() == "granted"
    finally:
        assert stop_process(holder) == 0, holder.stderr.read()
    r = run_python(TRY_LOCK, p)
    assert r.stdout.strip() == "granted"
    assert mounted.hot_path("lock").read_bytes() == b"lock"


# ------------------------------------------------------------------------------------------ namespace


def test_rename_and_rename_over_existing_with_open_reader(mounted):
    """config/*.json on 4.9.x: write <name>.tmp, rename over <name> (§8.3)."""
    cfg = mounted.path("config")
    cfg.mkdir()
    (cfg / "a.json").write_bytes(b"A" * 100)
    os.rename(cfg / "a.json", cfg / "b.json")
    assert not (cfg / "a.json").exists()
    assert (cfg / "b.json").read_bytes() == b"A" * 100
    assert sorted(os.listdir(mounted.hot_path("config"))) == ["b.json"]

    (cfg / "topics.json").write_bytes(b"old-content")
    (cfg / "topics.json.tmp").write_bytes(b"new!")
    fd_old = os.open(cfg / "topics.json", os.O_RDWR)
    try:
        os.rename(cfg / "topics.json.tmp", cfg / "topics.json")
        # the replaced file lives on through the open fd, uncached reads included
        os.posix_fadvise(fd_old, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd_old, 100, 0) == b"old-content"
        st = os.fstat(fd_old)
        assert (st.st_size, st.st_nlink) == (11, 0)
        os.pwrite(fd_old, b"OLD", 0)  # writes to the orphan do not leak into the new file
        os.fsync(fd_old)
        assert os.pread(fd_old, 100, 0) == b"OLD-content"
        assert (cfg / "topics.json").read_bytes() == b"new!"
    finally:
        os.close(fd_old)
    assert not (cfg / "topics.json.tmp").exists()
    assert (cfg / "topics.json").read_bytes() == b"new!"
    assert os.stat(cfg / "topics.json").st_size == 4
    assert mounted.hot_path("config", "topics.json").read_bytes() == b"new!"
    assert sorted(os.listdir(cfg)) == sorted(os.listdir(mounted.hot_path("config"))) == ["b.json", "topics.json"]


def test_config_overwrite_in_place_with_o_trunc(mounted):
    """config/*.json on 5.1.0+: copy to <name>.bak, then overwrite <name> in place with O_TRUNC (§8.3)."""
    cfg = mounted.path("config")
    cfg.mkdir()
    name = cfg / "consumerOffset.json"
    long, short = b'{"offsetTable":{' + b"x" * 5000 + b"}}", b'{"offsetTable":{}}'
    name.write_bytes(long)
    for content in (short, long, short):
        old = name.read_bytes()
        fd = os.open(cfg / "consumerOffset.json.bak", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, old)
        os.close(fd)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, content)
        os.close(fd)
        assert os.stat(name).st_size == len(content)
        assert name.read_bytes() == content
        assert run_python("import sys; sys.stdout.write(open(sys.argv[1], 'rb').read().decode())", name).stdout \
            == content.decode()
        evict(name)
        assert name.read_bytes() == content
        assert mounted.hot_path("config", "consumerOffset.json").read_bytes() == content
        assert (cfg / "consumerOffset.json.bak").read_bytes() == old


def _renameat2(old: Path, new: Path, flags: int) -> int:
    if _libc.renameat2(-100, os.fsencode(old), -100, os.fsencode(new), flags) == 0:  # AT_FDCWD
        return 0
    return ctypes.get_errno()


def test_rename_noreplace_and_exchange(mounted):
    a, b = mounted.path("a"), mounted.path("b")
    a.write_bytes(b"AAAA")
    b.write_bytes(b"BB")
    assert _renameat2(a, b, 1) == errno.EEXIST  # RENAME_NOREPLACE
    assert _renameat2(a, b, 2) == 0  # RENAME_EXCHANGE
    assert (a.read_bytes(), b.read_bytes()) == (b"BB", b"AAAA")
    assert (os.stat(a).st_size, os.stat(b).st_size) == (2, 4)
    # path-based operations afterwards reach the file now at that name
    os.chmod(a, 0o600)
    os.truncate(b, 1)
    assert stat.S_IMODE(mounted.hot_path("a").stat().st_mode) == 0o600
    assert stat.S_IMODE(mounted.hot_path("b").stat().st_mode) == 0o644
    assert (mounted.hot_path("a").read_bytes(), mounted.hot_path("b").read_bytes()) == (b"BB", b"A")
    # directories, with subtrees the kernel already knows
    mounted.path("d1", "x").mkdir(parents=True)
    mounted.path("d2", "y").mkdir(parents=True)
    mounted.path("d1", "x", "f").write_bytes(b"1")
    mounted.path("d2", "y", "g").write_bytes(b"2")
    assert _renameat2(mounted.path("d1"), mounted.path("d2"), 2) == 0
    assert (os.listdir(mounted.path("d1")), os.listdir(mounted.path("d2"))) == (["y"], ["x"])
    os.chmod(mounted.path("d1", "y", "g"), 0o600)
    os.chmod(mounted.path("d2", "x", "f"), 0o640)
    assert stat.S_IMODE(mounted.hot_path("d1", "y", "g").stat().st_mode) == 0o600
    assert stat.S_IMODE(mounted.hot_path("d2", "x", "f").stat().st_mode) == 0o640
    assert mounted.path("d2", "x", "f").read_bytes() == b"1"


def test_hard_links_and_symlinks(mounted):
    b = mounted.path("b")
    b.write_bytes(b"data")
    os.link(b, mounted.path("h"))
    assert os.stat(b).st_nlink == 2 and os.stat(b).st_ino == os.stat(mounted.path("h")).st_ino
    os.unlink(b)
    assert os.stat(mounted.path("h")).st_nlink == 1
    assert mounted.path("h").read_bytes() == b"data"
    os.chmod(mounted.path("h"), 0o604)  # the inode is still reachable by its remaining name
    assert stat.S_IMODE(mounted.hot_path("h").stat().st_mode) == 0o604
    os.symlink("h", mounted.path("s"))
    assert os.readlink(mounted.path("s")) == "h" == os.readlink(mounted.hot_path("s"))
    assert stat.S_ISLNK(os.lstat(mounted.path("s")).st_mode) and os.lstat(mounted.path("s")).st_size == 1
    assert mounted.path("s").read_bytes() == b"data"
    os.symlink("/nowhere", mounted.path("dangling"))
    assert _errno_of(os.stat, mounted.path("dangling")) == errno.ENOENT


def test_o_append_from_two_fds_never_overwrites(mounted):
    p = mounted.path("appendlog")
    fd1 = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    fd2 = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        for _ in range(100):
            os.write(fd1, b"1" * 10)
            os.write(fd2, b"2" * 7)
    finally:
        os.close(fd1)
        os.close(fd2)
    data = p.read_bytes()
    assert len(data) == 1700 and data.count(b"1") == 1000 and data.count(b"2") == 700
    assert data == (b"1" * 10 + b"2" * 7) * 100
    assert mounted.hot_path("appendlog").read_bytes() == data


def test_unlink_of_open_and_mapped_file_keeps_mapping_and_fd_working(mounted):
    """Segments are unlinked after munmap+close, but a reader may still hold a mapping (§3.5)."""
    p = mounted.path("00000000001073741824")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, MiB)
    mm = mmap.mmap(fd, MiB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    fd2 = None
    try:
        mm[0:5] = b"hello"
        mm.flush()
        os.unlink(p)
        # the name is gone, everywhere
        assert _errno_of(os.stat, p) == errno.ENOENT
        assert p.name not in os.listdir(mounted.mnt)
        assert hot_names(mounted) == set()
        # the mapping keeps working for writes, reads and msync
        mm[PAGE:PAGE + 5] = b"world"
        mm.flush()
        assert mm[0:5] == b"hello" and mm[PAGE:PAGE + 5] == b"world"
        # so does the fd, and fstat answers for the orphan
        st = os.fstat(fd)
        assert (st.st_size, st.st_nlink) == (MiB, 0)
        assert os.pwrite(fd, b"xyz", 3 * PAGE) == 3
        os.fsync(fd)
        # a second open of the orphan (through /proc) reads what the daemon has, not just the page cache
        fd2 = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        os.posix_fadvise(fd2, 0, 0, os.POSIX_FADV_DONTNEED)  # drops the unmapped page at 3*PAGE
        assert os.pread(fd2, 3, 3 * PAGE) == b"xyz"
        assert os.pread(fd2, 5, PAGE) == b"world"
        assert os.pread(fd2, PAGE, 5 * PAGE) == bytes(PAGE)
        os.ftruncate(fd, 2 * MiB)  # setattr on an inode that has no name left
        assert os.fstat(fd2).st_size == 2 * MiB
    finally:
        mm.close()
        os.close(fd)
        if fd2 is not None:
            os.close(fd2)
    assert _errno_of(os.stat, p) == errno.ENOENT
    wait_for(lambda: mounted.status()["open_files"] == 0, 10, what="the orphan's handles to be released")


def _syncfs(path: Path) -> int:
    """syncfs(2) on the filesystem of `path`; 0 or the errno."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return 0 if _libc.syncfs(fd) == 0 else ctypes.get_errno()
    finally:
        os.close(fd)


def test_syncfs_succeeds(mounted):
    mounted.path("f").write_bytes(b"x")
    fd = os.open(mounted.path("f"), os.O_RDWR)
    try:
        os.pwrite(fd, b"dirty", 0)
        assert _syncfs(mounted.mnt) == 0
        assert mounted.hot_path("f").read_bytes() == b"dirty"
    finally:
        os.close(fd)


def test_syncfs_after_unlink_of_closed_file(mounted):
    """The broker deletes segments by plain unlink after close (§3.5). The kernel then flushes the unlinked
    inode's ctime with a SETATTR that has no file handle; answering it ENOENT would be recorded as a writeback
    error of the whole mount and fail the next syncfs()."""
    for name in ("00000000000000000000", "lock"):
        mounted.path(name).write_bytes(b"segment")
        os.unlink(mounted.path(name))
        assert errno.errorcode.get(_syncfs(mounted.mnt), "OK") == "OK"
    mounted.path("keep").write_bytes(b"k")  # a hard-linked inode keeps its other name
    os.link(mounted.path("keep"), mounted.path("alias"))
    os.unlink(mounted.path("keep"))
    assert errno.errorcode.get(_syncfs(mounted.mnt), "OK") == "OK"
    assert mounted.path("alias").read_bytes() == b"k"


def test_a_new_file_never_gets_the_inode_of_one_the_kernel_still_holds(mounted):
    """ext4 gives a freed inode number to the next file it creates. While the kernel still holds the unlinked
    inode (here through an O_PATH fd, which sends no OPEN; a close's RELEASE does the same for a while), a new
    file with that number as its FUSE node id was merged into the old kernel inode: its size and page cache were
    the old file's, and a directory made after an rmdir was dead (ENOENT inside it)."""
    old, new = mounted.path("00000000000000000000"), mounted.path("00000000000000001000")
    old.write_bytes(b"a" * 5000)
    assert old.read_bytes() == b"a" * 5000  # in the kernel's page cache now
    held = os.open(old, os.O_PATH)
    d_held = None
    try:
        os.unlink(old)
        new.write_bytes(b"b" * 3000)
        assert os.stat(new).st_ino != os.fstat(held).st_ino
        assert new.read_bytes() == b"b" * 3000
        assert os.fstat(held).st_nlink == 0
        # the same for a directory (a topic deleted and made again)
        d_old, d_new = mounted.path("TopicA"), mounted.path("TopicB")
        d_old.mkdir()
        d_held = os.open(d_old, os.O_PATH)
        d_old.rmdir()
        d_new.mkdir()
        assert os.stat(d_new).st_ino != os.fstat(d_held).st_ino
        (d_new / "0").write_bytes(b"q")
        assert os.listdir(d_new) == ["0"]
    finally:
        os.close(held)
        if d_held is not None:
            os.close(d_held)
    # a rename over a last name (a config file's .tmp renamed over it; an empty directory) pins the one replaced
    conf, tmp = mounted.path("topics.json"), mounted.path("topics.json.tmp")
    conf.write_bytes(b"old")
    held = os.open(conf, os.O_PATH)
    d_held = None
    try:
        tmp.write_bytes(b"new!")
        os.rename(tmp, conf)
        assert conf.read_bytes() == b"new!" and os.fstat(held).st_nlink == 0
        other = mounted.path("other")
        other.write_bytes(b"x")
        assert os.stat(other).st_ino != os.fstat(held).st_ino
        d_old, d_new = mounted.path("TopicC"), mounted.path("TopicD")
        d_old.mkdir()
        d_new.mkdir()
        (d_new / "1").write_bytes(b"r")
        d_held = os.open(d_old, os.O_PATH)
        assert _errno_of(os.rename, d_old, d_new) == errno.ENOTEMPTY
        os.rename(d_new, d_old)
        assert os.listdir(d_old) == ["1"] and not d_new.exists()
        mounted.path("TopicE").mkdir()
        assert os.stat(mounted.path("TopicE")).st_ino != os.fstat(d_held).st_ino
    finally:
        os.close(held)
        if d_held is not None:
            os.close(d_held)
    # the pins go once the kernel has forgotten the inodes
    pinned = mounted.hot / ".tierfs" / "unlinked"
    wait_for(lambda: not os.listdir(pinned), 30, what="pinned inodes to be released after the kernel forgot them")
    assert hot_names(mounted) == {"00000000000000001000", "TopicB", "topics.json", "other", "TopicC", "TopicE"}


def test_unlinked_file_gives_its_blocks_back_once_no_fd_can_read_it(mounted):
    """The pin of an unlinked inode stays until the kernel FORGETs it, which may come after the caller's next
    write; it held the file's blocks till then, and a writer that deleted a file to make room got ENOSPC on a
    full hot dir (CI). An O_PATH fd keeps the kernel from forgetting the inode here, for as long as we look."""
    pinned = mounted.hot / ".tierfs" / "unlinked"
    data = os.urandom(8 * MiB)
    closed, still_open = mounted.path("00000000000000000000"), mounted.path("00000000000008388608")
    closed.write_bytes(data)
    fd = os.open(still_open, os.O_RDWR | os.O_CREAT, 0o644)
    held = []
    try:
        assert os.write(fd, data) == len(data)
        os.fsync(fd)  # in the hot file, not only in the kernel's writeback cache
        held = [os.open(closed, os.O_PATH), os.open(still_open, os.O_PATH)]
        pins = [pinned / str(os.fstat(h).st_ino) for h in held]
        wait_for(lambda: mounted.status()["open_files"] == 1, 30, what="the writer's close to be answered")
        os.unlink(closed)  # no fd holds it: its blocks are free when unlink returns
        assert os.stat(pins[0]).st_blocks == 0, "an unlinked file that no fd holds kept its blocks"
        os.unlink(still_open)  # an fd still reads it
        assert os.stat(pins[1]).st_blocks * 512 >= len(data)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, len(data), 0) == data
        os.close(fd)
        fd = -1
        wait_for(lambda: os.stat(pins[1]).st_blocks == 0, 30, what="the blocks to go at the last close")
    finally:
        if fd >= 0:
            os.close(fd)
        for h in held:
            os.close(h)
    wait_for(lambda: not os.listdir(pinned), 30, what="the pins to go once the kernel forgot the inodes")


def test_directory_with_10000_entries(mounted):
    """readdir over many batches (a busy consumequeue/ or index/ dir), exact names and sizes, rmdir rules.
    1,000 entries are created through the mount; 9,000 more are made directly in the hot dir to keep the test
    fast (creation through the mount at scale is what the stress-ng `dir`/`dirmany` runs cover)."""
    d = mounted.path("many")
    os.mkdir(d, 0o755)
    n, via_mount = 10_000, 1_000
    names = [f"{i * 6000:020d}" for i in range(n)]  # CQ-style names
    sizes = {names[i]: i % 5000 + 1 for i in range(0, n, 97)}
    hot_d = mounted.hot_path("many")
    for name in names[via_mount:]:
        fd = os.open(hot_d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        if name in sizes:
            os.ftruncate(fd, sizes[name])
        os.close(fd)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in names[:via_mount]:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
            if name in sizes:
                os.write(fd, b"q" * sizes[name])
            os.close(fd)
        r = run(["ls", "-1", "-A", str(d)], timeout=60, check=True)
        assert r.stdout.splitlines() == names  # ls sorts; exactly these, no extras
        assert len(run(["ls", "-f", str(d)], timeout=60, check=True).stdout.splitlines()) == n + 2  # with . and ..
        with os.scandir(d) as it:
            seen = {e.name: e.stat(follow_symlinks=False).st_size for e in it}
        assert len(seen) == n
        assert seen == {name: sizes.get(name, 0) for name in names}
        assert all(os.stat(name, dir_fd=dfd).st_size == size for name, size in sizes.items())
        assert _errno_of(os.rmdir, d) == errno.ENOTEMPTY
        for name in names:
            os.unlink(name, dir_fd=dfd)
        assert os.listdir(d) == []
    finally:
        os.close(dfd)
    os.rmdir(d)
    assert not d.exists() and not hot_d.exists()
    assert hot_names(mounted) == set()


def test_nested_directory_rename_keeps_open_files_and_paths(mounted):
    base = mounted.path("a", "b", "c")
    base.mkdir(parents=True)
    (base / "f").write_bytes(b"before")
    (base / "g").write_bytes(b"gee")
    fd = os.open(base / "f", os.O_RDWR)
    try:
        mounted.path("x").mkdir()
        os.rename(mounted.path("a", "b"), mounted.path("x", "y"))  # across parents, with a subtree
        assert not mounted.path("a", "b").exists()
        assert os.listdir(mounted.path("a")) == []
        moved = mounted.path("x", "y", "c")
        assert sorted(os.listdir(moved)) == ["f", "g"]
        # the open fd follows the file; writes through it land under the new path
        os.pwrite(fd, b"AFTER!", 0)
        os.fsync(fd)
        assert (moved / "f").read_bytes() == b"AFTER!"
        assert mounted.hot_path("x", "y", "c", "f").read_bytes() == b"AFTER!"
        # path-based operations on children the kernel already knew go to the new place
        os.chmod(moved / "g", 0o600)
        assert stat.S_IMODE(mounted.hot_path("x", "y", "c", "g").stat().st_mode) == 0o600
        os.truncate(moved / "g", 1)
        assert mounted.hot_path("x", "y", "c", "g").read_bytes() == b"g"
        (moved / "new").write_bytes(b"n")
        assert mounted.hot_path("x", "y", "c", "new").read_bytes() == b"n"
        os.rename(moved, mounted.path("a", "c2"))  # and back up again
        assert (mounted.path("a", "c2", "f")).read_bytes() == b"AFTER!"
    finally:
        os.close(fd)
    assert sorted(os.listdir(mounted.hot_path("a", "c2"))) == ["f", "g", "new"]
    assert not mounted.hot_path("x", "y", "c").exists()


# ------------------------------------------------------------------------------------------ attributes


def test_mtime_is_time_of_last_data_write_not_of_reads(mounted):
    """Retention compares segment mtimes (§16.4): reads (pread, mmap, reopen) must not move them."""
    slack = 50_000_000  # the kernel stamps with its coarse clock (a jiffy or so behind time.time_ns)
    p = mounted.path("seg")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    time.sleep(0.05)  # first write in a later clock tick than the create (see the xfail test below)
    try:
        t0 = time.time_ns()
        os.pwrite(fd, b"x" * 100, 0)
        t1 = time.time_ns()
        m1 = os.fstat(fd).st_mtime_ns
        assert t0 - slack <= m1 <= t1 + slack
        time.sleep(0.3)
        os.pread(fd, 100, 0)
        mm = mmap.mmap(fd, 100, prot=mmap.PROT_READ)
        assert mm[:3] == b"xxx"
        mm.close()
        assert os.fstat(fd).st_mtime_ns == m1
    finally:
        os.close(fd)
    assert p.read_bytes()[:1] == b"x"
    time.sleep(1.1)  # past the attribute timeout: the next stat asks the daemon
    assert os.stat(p).st_mtime_ns == m1
    assert mounted.hot_path("seg").stat().st_mtime_ns == m1
    fd = os.open(p, os.O_RDWR)
    try:
        t2 = time.time_ns()
        os.pwrite(fd, b"y", 50)
        t3 = time.time_ns()
    finally:
        os.close(fd)
    m2 = os.stat(p).st_mtime_ns
    assert m2 > m1 and t2 - slack <= m2 <= t3 + slack
    assert mounted.hot_path("seg").stat().st_mtime_ns == m2


def test_hot_mtime_matches_kernel_mtime_when_write_follows_create(mounted):
    """What the broker sees after a remount (the kernel forgot the inode) is the hot file's mtime; it must be
    the mtime the kernel showed before, i.e. the time of the data write, not the time of the writeback. With
    the writeback cache the kernel owns mtime and sends SETATTR(mtime) only when its own changed (not for a
    write in the same clock tick as the create), so the daemon's WRITE must leave the hot file's mtime alone."""
    names = [f"cfg{i}.json" for i in range(20)]
    for name in names:
        fd = os.open(mounted.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"{}")
        time.sleep(0.01)  # writeback happens later than the write (here: at close)
        os.close(fd)
    kernel = {n: os.stat(mounted.path(n)).st_mtime_ns for n in names}
    hot = {n: mounted.hot_path(n).stat().st_mtime_ns for n in names}
    assert hot == kernel


def test_utimens_ns_round_trip(mounted):
    p = mounted.path("t")
    p.write_bytes(b"t")
    atime, mtime = 1_600_000_000_123_456_789, 1_700_000_000_987_654_321
    os.utime(p, ns=(atime, mtime))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime)
    hst = mounted.hot_path("t").stat()
    assert (hst.st_atime_ns, hst.st_mtime_ns) == (atime, mtime)
    fd = os.open(p, os.O_RDONLY)  # futimens on an fd too
    try:
        os.utime(fd, ns=(atime + 1, mtime + 1))
        assert os.fstat(fd).st_mtime_ns == mtime + 1
    finally:
        os.close(fd)
    assert mounted.hot_path("t").stat().st_mtime_ns == mtime + 1
    d = mounted.path("dir")
    d.mkdir()
    os.utime(d, ns=(atime, mtime))
    assert os.stat(d).st_mtime_ns == mtime == mounted.hot_path("dir").stat().st_mtime_ns


def test_chmod(mounted):
    p = mounted.path("m")
    p.write_bytes(b"m")
    for mode in (0o600, 0o644, 0o4755, 0o2750, 0o1777, 0o000):
        os.chmod(p, mode)
        assert stat.S_IMODE(os.stat(p).st_mode) == mode, oct(mode)
        assert stat.S_IMODE(mounted.hot_path("m").stat().st_mode) == mode, oct(mode)
    d = mounted.path("d")
    d.mkdir()
    os.chmod(d, 0o700)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(mounted.hot_path("d").stat().st_mode) == 0o700


@pytest.mark.skipif(not is_root(), reason="chown to another uid needs root")
def test_chown_to_other_ids_and_clears_setuid(mounted):
    p = mounted.path("owned")
    p.write_bytes(b"#!/bin/sh\n")
    os.chmod(p, 0o6755)  # setuid + setgid + group-exec
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o6755
    os.chown(p, 1234, 2345)
    for st in (os.stat(p), mounted.hot_path("owned").stat()):
        assert (st.st_uid, st.st_gid) == (1234, 2345)
        assert stat.S_IMODE(st.st_mode) == 0o755, oct(st.st_mode)  # both set-id bits cleared by chown
    os.chown(p, -1, 3456)  # group only
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 3456)
    d = mounted.path("dd")
    d.mkdir()
    os.chown(d, 4321, 5432)
    assert (mounted.hot_path("dd").stat().st_uid, mounted.hot_path("dd").stat().st_gid) == (4321, 5432)


def _as_user(cmd: str, cwd: Path, uid: int = 1234, gid: int = 2345) -> subprocess.CompletedProcess:
    """Run a shell command as another user (chdir happens before the ids drop, so only the mount's own dirs are
    traversed)."""
    return subprocess.run(["sh", "-c", cmd], cwd=cwd, user=uid, group=gid, extra_groups=[], capture_output=True,
                          text=True, timeout=30)


@pytest.mark.skipif(not is_root(), reason="creating as another user needs root")
def test_new_files_belong_to_the_creating_user_with_allow_other(mount_store):
    m = mount_store(options=["mount.allow_other=true"])
    shared = m.path("shared")
    shared.mkdir()
    os.chmod(shared, 0o777)
    run(["sh", "-c", ": > shared/f && mkdir shared/d"], cwd=m.mnt, timeout=30, check=True)
    r = _as_user(": > shared/u && mkdir shared/ud && ls shared", m.mnt)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["d", "f", "u", "ud"]
    for name in ("u", "ud"):
        for st in (os.stat(shared / name), m.hot_path("shared", name).stat()):
            assert (st.st_uid, st.st_gid) == (1234, 2345), name
    for name in ("f", "d"):
        assert (os.stat(shared / name).st_uid, m.hot_path("shared", name).stat().st_uid) == (0, 0)
    # permission checks are the kernel's (default_permissions): 1234 may not write root's 0644 file
    r = _as_user("echo x >> shared/f", m.mnt)
    assert r.returncode != 0 and "Permission denied" in r.stderr


@pytest.mark.skipif(not is_root(), reason="needs another user")
def test_other_users_are_refused_without_allow_other(mounted):
    mounted.path("pub").mkdir(mode=0o777)
    os.chmod(mounted.path("pub"), 0o777)
    r = _as_user("ls pub", mounted.mnt)
    assert r.returncode != 0 and "Permission denied" in r.stderr


UMASK_CREATE = r"""
import os, stat, sys
os.umask(int(sys.argv[1], 8))
os.close(os.open("file", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o666))
os.mkdir("dir", 0o777)
os.mknod("node", 0o666 | stat.S_IFREG)
"""


def test_umask_applied_exactly_once(mounted):
    """The caller's umask is applied once (not twice), and the daemon's own umask (077) never."""
    for umask, fmode, dmode in (("027", 0o640, 0o750), ("000", 0o666, 0o777), ("077", 0o600, 0o700),
                                ("002", 0o664, 0o775)):
        d = mounted.path(f"umask{umask}")
        d.mkdir()
        run_python(UMASK_CREATE, umask, cwd=d)
        for name, mode in (("file", fmode), ("dir", dmode), ("node", fmode)):
            assert stat.S_IMODE(os.stat(d / name).st_mode) == mode, (umask, name)
            assert stat.S_IMODE(mounted.hot_path(d.name, name).stat().st_mode) == mode, (umask, name)


def test_statfs_default_mirrors_hot_dir(mounted):
    sv, hv = os.statvfs(mounted.mnt), os.statvfs(mounted.hot)
    assert sv.f_bsize == hv.f_bsize and sv.f_frsize == hv.f_frsize
    assert sv.f_blocks == hv.f_blocks
    assert abs(sv.f_bavail - hv.f_bavail) * hv.f_frsize < 256 * MiB  # same disk, a moment apart
    assert sv.f_namemax == hv.f_namemax
    assert sv.f_files == hv.f_files


def test_statfs_capacity_option_sets_f_blocks(mount_store):
    m = mount_store(options=["statfs.capacity_bytes=1GiB"])
    sv, hv = os.statvfs(m.mnt), os.statvfs(m.hot)
    assert sv.f_blocks * sv.f_frsize == GiB
    assert sv.f_bavail <= sv.f_bfree <= sv.f_blocks
    assert sv.f_bavail <= hv.f_bavail  # never more free space than the hot dir really has
    r = run(["df", "-B1", "--output=size", str(m.mnt)], timeout=30, check=True)
    assert r.stdout.split()[-1] == str(GiB)
    assert m.status()["statfs_capacity_bytes"] == GiB


# ------------------------------------------------------------------------------------------ unsupported ops


def test_unsupported_ops_give_precise_errnos(mounted):
    p = mounted.path("x")
    p.write_bytes(b"x" * 10)
    # extended attributes: not supported (EOPNOTSUPP, which Linux spells ENOTSUP too)
    assert _errno_of(os.setxattr, p, "user.k", b"v") == errno.EOPNOTSUPP
    assert _errno_of(os.getxattr, p, "user.k") == errno.EOPNOTSUPP
    assert _errno_of(os.listxattr, p) == errno.EOPNOTSUPP
    assert _errno_of(os.removexattr, p, "user.k") == errno.EOPNOTSUPP
    # fallocate(2) itself: EOPNOTSUPP, for allocation and for hole punching (the broker never calls it, §3.1)
    fd = os.open(p, os.O_RDWR)
    try:
        for mode in (0, 1, 3):  # plain, KEEP_SIZE, KEEP_SIZE|PUNCH_HOLE
            assert _libc.fallocate(fd, mode, 0, MiB) == -1
            assert ctypes.get_errno() == errno.EOPNOTSUPP, mode
        assert os.fstat(fd).st_size == 10
        # posix_fallocate succeeds anyway: glibc falls back to writing the blocks itself
        os.posix_fallocate(fd, 0, MiB)
        assert os.fstat(fd).st_size == MiB
        assert os.pread(fd, 20, 0) == b"x" * 10 + bytes(10)
    finally:
        os.close(fd)
    assert mounted.hot_path("x").stat().st_size == MiB


# ------------------------------------------------------------------------------------------ control dir


CONTROL_FILES = {"status", "status.json", "stats", "config"}


def test_control_dir_listed_only_at_root_and_readable_with_cat(mounted):
    root = os.listdir(mounted.mnt)
    assert root.count(".tierfs") == 1
    assert stat.S_ISDIR(os.stat(mounted.ctl).st_mode)
    ctl = set(os.listdir(mounted.ctl))
    assert CONTROL_FILES <= ctl
    mounted.path("sub").mkdir()
    assert os.listdir(mounted.path("sub")) == []
    assert ".tierfs" not in run(["ls", "-A", str(mounted.path("sub"))], check=True).stdout.split()
    for name in sorted(ctl):
        r = run(["cat", str(mounted.ctl / name)], timeout=30)
        assert r.returncode == 0 and r.stdout, (name, r.stderr)
        st = os.stat(mounted.ctl / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444
    status = json.loads(run(["cat", str(mounted.ctl / "status.json")], check=True).stdout)
    assert status["pid"] == mounted.pid and status["mountpoint"] == str(mounted.mnt)
    assert status["hot_dir"] == str(mounted.hot)
    assert "[mount]" in (mounted.ctl / "config").read_text()
    assert run(["cat", str(mounted.ctl / "status")], check=True).stdout.startswith("tierfs status")


def test_control_dir_lists_dot_entries_like_any_dir(mounted):
    mounted.path("sub").mkdir()
    for d in (mounted.mnt, mounted.path("sub"), mounted.ctl):
        names = run(["ls", "-a", "-1", "-U", str(d)], check=True).stdout.split()  # -U: readdir order
        assert names[:2] == [".", ".."], (d, names)
        assert names.count(".") == 1 and names.count("..") == 1, (d, names)
    # readdirplus attributes of '.' and '..' are the dir's and the root's own
    ls = run(["ls", "-a", "-i", "-1", str(mounted.ctl)], check=True).stdout.split("\n")
    inos = {name: int(ino) for ino, name in (line.split() for line in ls if line.strip())}
    assert inos["."] == os.stat(mounted.ctl).st_ino
    assert inos[".."] == os.stat(mounted.mnt).st_ino
    assert CONTROL_FILES <= set(inos)
    assert set(os.listdir(mounted.ctl)) >= CONTROL_FILES and "." not in os.listdir(mounted.ctl)


def test_control_dir_is_read_only(mounted):
    f = mounted.ctl / "status"
    checks = {
        "open O_WRONLY": lambda: os.open(f, os.O_WRONLY),
        "open O_RDWR": lambda: os.open(f, os.O_RDWR),
        "create": lambda: os.open(mounted.ctl / "new", os.O_WRONLY | os.O_CREAT, 0o644),
        "unlink": lambda: os.unlink(f),
        "chmod file": lambda: os.chmod(f, 0o666),
        "chmod dir": lambda: os.chmod(mounted.ctl, 0o777),
        "truncate": lambda: os.truncate(f, 0),
        "utime": lambda: os.utime(f, (1, 1)),
        "mkdir inside": lambda: os.mkdir(mounted.ctl / "d"),
        "rename inside": lambda: os.rename(f, mounted.ctl / "s2"),
        "rename out": lambda: os.rename(f, mounted.path("s2")),
        "link out": lambda: os.link(f, mounted.path("s3")),
        "symlink inside": lambda: os.symlink("x", mounted.ctl / "sym"),
    }
    got = {}
    for what, fn in checks.items():
        try:
            fn()
            got[what] = "succeeded"
        except OSError as e:
            got[what] = errno.errorcode[e.errno]
    assert {k: v for k, v in got.items() if v not in ("EROFS", "EPERM")} == {}, got
    if is_root():
        assert _errno_of(os.chown, f, 1, 1) in (errno.EROFS, errno.EPERM)
    r = run(["sh", "-c", f"echo x > {f}"], timeout=30)
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    # the name itself is reserved at the root: cannot be removed, replaced or created anew
    assert _errno_of(os.rmdir, mounted.ctl) == errno.EPERM
    assert _errno_of(os.rename, mounted.ctl, mounted.path("elsewhere")) == errno.EPERM
    mounted.path("adir").mkdir()
    assert _errno_of(os.rename, mounted.path("adir"), mounted.ctl) == errno.EPERM
    assert _errno_of(os.mkdir, mounted.ctl) == errno.EEXIST
    assert _errno_of(os.open, mounted.ctl, os.O_WRONLY | os.O_CREAT, 0o644) == errno.EISDIR
    assert sorted(os.listdir(mounted.ctl)) == sorted(set(os.listdir(mounted.ctl)))  # unchanged, no strays
    assert not mounted.path("s2").exists() and not mounted.path("elsewhere").exists()
    # a `.tierfs` below the root is an ordinary directory
    mounted.path("sub").mkdir()
    mounted.path("sub", ".tierfs").mkdir()
    (mounted.path("sub", ".tierfs", "f")).write_bytes(b"ok")
    assert mounted.hot_path("sub", ".tierfs", "f").read_bytes() == b"ok"


def test_hot_state_dir_never_appears_in_mount(mounted):
    state = set(os.listdir(mounted.state_dir))
    assert {"daemon.pid", "daemon.lock"} <= state
    ctl = set(os.listdir(mounted.ctl))
    assert not (state & ctl), "state dir files leaked into the control dir"
    for name in state:
        assert _errno_of(os.stat, mounted.ctl / name) == errno.ENOENT, name
    r = run(["find", str(mounted.mnt), "-name", "daemon.*"], timeout=30)
    assert r.stdout.strip() == ""
    mounted.path("d").mkdir()
    assert sorted(os.listdir(mounted.mnt)) == [".tierfs", "d"]


# ------------------------------------------------------------------------------------------ failures and lifecycle


def test_read_failpoint_gives_eio_and_daemon_survives(mount_store, tmp_path):
    hot = tmp_path / "hot"
    hot.mkdir()
    (hot / "data").write_bytes(b"payload" * 100)
    (hot / "dir").mkdir()
    m = mount_store(hot=hot, env={"TIERFS_FAILPOINTS": "fs.read"})
    assert _errno_of(lambda: open(m.path("data"), "rb").read()) == errno.EIO
    r = run(["cat", str(m.path("data"))], timeout=30)
    assert r.returncode != 0 and "Input/output error" in r.stderr
    assert m.alive() and m.is_mounted()
    # everything that is not a read still works
    assert os.stat(m.path("data")).st_size == 700
    assert sorted(run(["ls", "-A", str(m.mnt)], check=True).stdout.split()) == [".tierfs", "data", "dir"]
    m.path("dir", "new").write_bytes(b"w")
    assert m.hot_path("dir", "new").read_bytes() == b"w"
    wait_for(lambda: "/data" in m.log_text(), 10, what="the log to name the failing path")
    line = next(ln for ln in m.log_text().splitlines() if "/data" in ln)
    assert "read" in line and "EIO" in line, line
    m.umount()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_unmounts_cleanly(mounted, sig):
    run_python("import os; fd = os.open('f', os.O_CREAT | os.O_WRONLY, 0o644); os.write(fd, b'kept'); os.close(fd)",
               cwd=mounted.mnt)
    pid = mounted.pid
    os.kill(pid, sig)
    wait_for(lambda: not pid_alive(pid), 30, what=f"daemon {pid} to exit on {sig!r}")
    assert not mounted.is_mounted(any_state=True), "the daemon left its mount behind"
    assert not mounted.pid_file.exists(), "pid file not removed: not a clean exit"
    assert "clean exit" in mounted.log_text()
    assert mounted.hot_path("f").read_bytes() == b"kept"
    mounted.remount()  # the same dirs mount again at once
    assert mounted.path("f").read_bytes() == b"kept"


def test_second_daemon_on_same_hot_dir_is_refused(mount_store, tmp_path):
    m = mount_store()
    mnt2 = tmp_path / "mnt-second"
    mnt2.mkdir()
    stderr_file = m.state_dir / "daemon.stderr"
    before = stderr_file.read_bytes()
    assert b"mounting" in before  # the running daemon's own output
    r = m.cli("mount", m.hot, mnt2, timeout=60)
    assert r.returncode != 0
    assert f"another tierfs daemon (pid {m.pid})" in r.stderr, r.stderr
    # the refused attempt neither clobbered the running daemon's stderr file nor left its own behind
    assert stderr_file.read_bytes().startswith(before)
    assert os.readlink(f"/proc/{m.pid}/fd/2") == str(stderr_file)
    assert sorted(p.name for p in m.state_dir.glob("daemon.stderr*")) == ["daemon.stderr"]
    r = m.cli("mount", m.hot, mnt2, "--foreground", timeout=60)
    assert r.returncode == 2
    assert f"another tierfs daemon (pid {m.pid}) already serves hot dir {m.hot}" in r.stderr, r.stderr
    assert not os.path.ismount(mnt2)
    # the first daemon is untouched
    assert m.alive() and m.pid_file.read_text().strip() == str(m.pid)
    m.path("still").write_bytes(b"ok")
    assert m.path("still").read_bytes() == b"ok"


def test_umount_while_file_open_reports_busy(mounted):
    fd = os.open(mounted.path("open"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"busy")
        r = mounted.cli("umount", mounted.mnt, timeout=60)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "could not unmount" in r.stderr and "busy" in r.stderr, r.stderr
        assert mounted.is_mounted() and mounted.alive()
        assert os.pread(fd, 4, 0) == b"busy"
    finally:
        os.close(fd)
    mounted.umount()
    assert mounted.hot_path("open").read_bytes() == b"busy"
