"""Bad input on real mounts (posix object store): the daemon neither crashes nor is misled.

* garbage, truncated and all-zero CommitLog, ConsumeQueue and IndexFile contents under segment names stay hot
  (never sealed, so never tiered) with a log line saying why, while their valid neighbours are tiered;
* odd names (unicode, 255 bytes, spaces, newlines, bytes that are not UTF-8) work for create, write, rename, ls,
  cat and unlink in the store dirs and in segment dirs, including odd topic directory names;
* 10,000 files open at once through the mount (the daemon raises its own open-file limit);
* the hot dir's file system filling up: ENOSPC reaches the writer, reads and ls keep working, and writes work
  again once space is freed.

A second daemon on the same hot dir is refused: tests/test_fs_semantics.py::test_second_daemon_on_same_hot_dir_is_refused.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import struct
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mountutil import evict, fd_targets, run, tmpfs, wait_for
from test_store_mount import PRODUCER, SMALL
from test_tiering import TIER_OPTS, copy_in, segments, status

from tierfs.store import commitlog as cl
from tierfs.store import indexfile
from tierfs.store.paths import Kind, classify
from tierfs.store.seal import SealParams, is_sealed

MAX_SLOTS, MAX_ITEMS = 500, 2000  # as in TIER_OPTS and SMALL
PARAMS = SealParams(MAX_ITEMS, MAX_SLOTS)
CL_SIZE, CQ_SIZE = 1 << 20, 6000
INDEX_SIZE = indexfile.index_file_size(MAX_SLOTS, MAX_ITEMS)


@pytest.fixture(scope="module")
def reference_store(tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("bad-input-ref")
    run([sys.executable, PRODUCER, ref, *SMALL, "--messages", "3000", "--topics", "1", "--queues", "2"],
        timeout=120, check=True)
    return ref


def sealed_in(root: Path) -> list[str]:
    return [r for r in segments(root) if is_sealed(classify(r), (root / r).read_bytes(), (root / r).stat().st_size,
                                                   PARAMS)[0]]


# ------------------------------------------------------------------------------------------ garbage contents


def garbage(ref: Path) -> dict[str, bytes]:
    """Files with segment names and contents the broker never writes, each next to valid neighbours."""
    rng = random.Random(6)
    good_cl = (ref / sealed_in(ref)[0]).read_bytes()
    blank_at = cl.sealed_commitlog_end(good_cl, CL_SIZE)
    bad_blank = bytearray(good_cl)
    struct.pack_into(">i", bad_blank, blank_at, CL_SIZE - blank_at - 8)  # BLANK size that misses the end
    bad_magic = bytearray(good_cl)
    bad_magic[4:8] = b"\x12\x34\x56\x78"

    def cq(last_valid: bool) -> bytes:
        b = bytearray(rng.randbytes(CQ_SIZE))
        struct.pack_into(">qi", b, CQ_SIZE - 20, 12345 if last_valid else -1, 77 if last_valid else 0)
        return bytes(b)

    good_cq = bytearray((ref / next(r for r in sealed_in(ref) if r.startswith("consumequeue/"))).read_bytes())
    struct.pack_into(">qi", good_cq, 20 * 100, 5, -1)  # one unit in the middle broken
    good_idx = (ref / next(r for r in sealed_in(ref) if r.startswith("index/"))).read_bytes()

    def idx(**fields: int) -> bytes:
        h = indexfile.decode_header(good_idx, raw=True)
        for k, v in fields.items():
            setattr(h, k, v)
        return h.encode() + good_idx[indexfile.HEADER_SIZE:]

    def cl_name(i: int) -> str:
        return f"commitlog/{(100 + i) * CL_SIZE:020d}"

    def cq_name(q: int, i: int) -> str:
        return f"consumequeue/TopicBad/{q}/{i * CQ_SIZE:020d}"

    return {
        cl_name(0): rng.randbytes(CL_SIZE),
        cl_name(1): bytes(CL_SIZE),
        cl_name(2): good_cl[:600_000],  # truncated mid-record: no BLANK
        cl_name(3): bytes(bad_blank),
        cl_name(4): bytes(bad_magic),
        cq_name(0, 0): cq(last_valid=False),
        cq_name(0, 1): cq(last_valid=True),  # only the whole file tells it is garbage
        cq_name(0, 2): bytes(CQ_SIZE),
        cq_name(0, 3): cq(True)[:CQ_SIZE - 10],
        cq_name(1, 0): bytes(good_cq),
        "index/20990101000000001": idx(index_count=0x7FFFFFFF),
        "index/20990101000000002": idx(hash_slot_count=-5),
        "index/20990101000000003": idx(begin_phy_offset=10, end_phy_offset=5),
        "index/20990101000000004": rng.randbytes(INDEX_SIZE),
        "index/20990101000000005": bytes(INDEX_SIZE),
        "index/20990101000000006": good_idx[:-1000],
    }


def write_through(mnt: Path, rel: str, data: bytes) -> None:
    p = mnt / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def test_garbage_segments_stay_hot_and_neighbours_are_tiered(mount_store, reference_store):
    m = mount_store(options=[TIER_OPTS + ",mount.log_level=debug,compaction.enabled=false"])
    bad = garbage(reference_store)
    for rel, data in bad.items():
        assert not is_sealed(classify(rel), data, len(data), PARAMS)[0], f"the seal rule accepts garbage {rel}"
    copy_in(reference_store, m.mnt)
    for rel, data in bad.items():
        write_through(m.mnt, rel, data)
    good = sealed_in(reference_store)
    wait_for(lambda: all(f["state"] == "tiered" for f in status(m)["files"] if f["path"] in good)
             and len(status(m)["files"]) >= len(good), timeout=60, what="valid neighbours tiered")
    # every garbage file was looked at (after its fsync and the quiet period) and refused, with the reason
    wait_for(lambda: all(f"{rel} not sealed" in m.log_text() for rel in bad), timeout=30,
             what="a 'not sealed' log line for every garbage file")
    log = m.log_text()
    reasons = {rel: next(ln.split(" not sealed: ", 1)[1] for ln in log.splitlines() if f"{rel} not sealed: " in ln)
               for rel in bad}
    print("\n" + "\n".join(f"  {rel}: {why}" for rel, why in reasons.items()))
    st = status(m)
    cataloged = {f["path"] for f in st["files"]}
    assert not cataloged & set(bad), f"garbage was sealed: {cataloged & set(bad)}"
    per_kind = st["totals"]["per_kind"]
    assert per_kind["commitlog"]["hot"] >= 5 and per_kind["consumequeue"]["hot"] >= 5, per_kind
    assert per_kind["index"]["hot"] >= 6, per_kind
    assert m.alive()
    for rel, data in bad.items():  # garbage reads back as written
        evict(m.mnt / rel)
        assert (m.mnt / rel).read_bytes() == data, rel
    for rel in good:
        evict(m.mnt / rel)
        assert (m.mnt / rel).read_bytes() == (reference_store / rel).read_bytes(), rel


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from([Kind.COMMITLOG, Kind.CONSUMEQUEUE, Kind.INDEX]), seed=st.integers(0, 2**32),
       valid_tail=st.booleans())
def test_random_bytes_never_seal(kind, seed, valid_tail):
    """Full-size random contents, with or without a valid-looking last CQ unit, never satisfy a seal rule."""
    rng = random.Random(seed)
    size = {Kind.COMMITLOG: CL_SIZE, Kind.CONSUMEQUEUE: CQ_SIZE, Kind.INDEX: INDEX_SIZE}[kind]
    buf = bytearray(rng.randbytes(size))
    if kind is Kind.CONSUMEQUEUE and valid_tail:
        struct.pack_into(">qi", buf, size - 20, rng.randrange(1 << 40), rng.randrange(1, 1 << 20))
    if kind is Kind.INDEX and valid_tail:
        struct.pack_into(">i", buf, 36, MAX_ITEMS)
    sealed, why = is_sealed(kind, buf, size, PARAMS)
    assert not sealed, why


# ------------------------------------------------------------------------------------------ odd names

ODD_NAMES = [
    "ünïcødé 名前 😀",
    "x" * 255,
    "é" * 127 + "x",  # 255 bytes of UTF-8
    "with  two spaces ",
    " leading space",
    "new\nline",
    "tab\there",
    "-rf",
    "back\\slash",
    "quote'\"",
    "%LMQ%odd",
    ".hidden",
    "glob*?[x]",
]
ODD_BYTES = [b"not-utf8-\xff\xfe", b"\xc3(latin1-ish", b"\x01ctrl"]  # Linux names are bytes
DIRS = ["", "config", "commitlog", "consumequeue/TopicOdd/0", "index"]


def renamed(name: bytes) -> bytes:
    return b"r" + name[1:] if len(name) >= 255 else name + b" (renamed)"


def test_odd_names_in_store_and_segment_dirs(mounted):
    m = mounted
    names = [n.encode() for n in ODD_NAMES] + ODD_BYTES
    for d in DIRS:
        base = os.path.join(os.fsencode(m.mnt), d.encode()) if d else os.fsencode(m.mnt)
        os.makedirs(base, exist_ok=True)
        for name in names:
            p = os.path.join(base, name)
            data = b"content of " + name
            with open(p, "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
            assert name in os.listdir(base), (d, name)
            assert run(["cat", p], text=False, check=True).stdout == data
            q = os.path.join(base, renamed(name))
            os.rename(p, q)
            assert os.stat(q).st_size == len(data)
            assert name not in os.listdir(base) and renamed(name) in os.listdir(base)
            evict(q)
            with open(q, "rb") as f:
                assert f.read() == data
            os.unlink(q)
            assert renamed(name) not in os.listdir(base)
        with pytest.raises(OSError) as ei, open(os.path.join(base, b"y" * 256), "wb"):
            pass
        assert ei.value.errno == errno.ENAMETOOLONG
    assert run(["ls", "-laR", m.mnt], check=True).returncode == 0
    assert m.alive()


def test_odd_segment_paths_never_stop_tiering(mount_store, reference_store):
    """A ConsumeQueue file is a segment whatever its topic dir is called, and a CommitLog name is 20 digits: odd
    names must neither stop the sealer or the uploader nor make object keys the store refuses. Names an object
    key cannot carry (control characters, bytes that are not UTF-8) keep the file local; the others tier."""
    m = mount_store(options=[TIER_OPTS + ",compaction.enabled=false"])
    cq = next(r for r in sealed_in(reference_store) if r.startswith("consumequeue/"))
    cl_seg = next(r for r in sealed_in(reference_store) if r.startswith("commitlog/"))
    tiers = {b"consumequeue/top ic \xe2\x9c\x93/0/" + b"%020d" % 0: cq,
             b"consumequeue/%RETRY%group/1/" + b"%020d" % 0: cq}
    # a 255-byte topic name (5.x allows topics longer than 127 chars) is a fine S3 key, but longer than the
    # posix store's key segment limit: tiered, or kept local with an error line, and nothing else breaks
    either = {b"consumequeue/" + b"t" * 255 + b"/0/" + b"%020d" % 0: cq}
    stays_local = {b"consumequeue/new\nline/0/" + b"%020d" % 0: cq,
                   b"consumequeue/not-utf8-\xff/0/" + b"%020d" % 0: cq,
                   b"commitlog/" + b"%020d" % (200 * CL_SIZE) + b"\n": cl_seg,
                   "commitlog/" + "\u0660" * 20: cl_seg}  # Arabic-Indic digits
    for rel, src in {**tiers, **stays_local, **either}.items():
        p = os.path.join(os.fsencode(m.mnt), os.fsencode(rel))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write((reference_store / src).read_bytes())
            os.fsync(f.fileno())
    copy_in(reference_store, m.mnt)  # neighbours: proof that the sealer and the uploader kept running
    want = sealed_in(reference_store) + [os.fsdecode(r) for r in tiers]
    wait_for(lambda: not m.alive() or all(status(m)["files"] and {f["path"]: f["state"] for f in status(m)["files"]}
                                          .get(r) == "tiered" for r in want), timeout=60, what="tiering")
    assert m.alive(), m.log_tail()
    states = {f["path"]: f["state"] for f in status(m)["files"]}
    assert not set(states) & {os.fsdecode(r) for r in stays_local}
    long_topic = os.fsdecode(next(iter(either)))

    def long_topic_state() -> str | None:
        return {f["path"]: f["state"] for f in status(m)["files"]}.get(long_topic)
    wait_for(lambda: long_topic_state() == "tiered" or "cannot be tiered" in m.log_text(), timeout=30,
             what="the 255-byte topic's segment tiered or refused")
    print(f"\n255-byte topic dir on the posix store: {long_topic_state() or 'kept local'}")
    for rel, src in {**tiers, **stays_local, **either}.items():
        p = os.path.join(os.fsencode(m.mnt), os.fsencode(rel))
        evict(p)
        with open(p, "rb") as f:
            assert f.read() == (reference_store / src).read_bytes(), rel
    assert m.alive(), m.log_tail()


# ------------------------------------------------------------------------------------------ 10,000 open files

N_OPEN = 10_000


def daemon_nofile(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no 'Max open files' in /proc/PID/limits")


def test_10000_files_open_at_once(mount_store):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = N_OPEN + 200
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"hard RLIMIT_NOFILE is {hard}; this test needs {need}")
    # the daemon starts with a soft limit of 1024, as under most init systems, and must raise it itself
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        m = mount_store()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        d_soft, d_hard = daemon_nofile(m.pid)
        assert d_soft == d_hard and d_soft >= need, f"daemon open-file limit {d_soft} (hard {d_hard})"
        fds = []
        try:
            for i in range(N_OPEN):
                sub = m.mnt / f"d{i % 20}"
                if i < 20:
                    sub.mkdir()
                fd = os.open(sub / f"f{i}", os.O_RDWR | os.O_CREAT, 0o644)
                fds.append(fd)
                os.write(fd, b"%d\n" % i)
            assert m.status()["open_files"] >= N_OPEN
            for i, fd in enumerate(fds):
                assert os.pread(fd, 32, 0) == b"%d\n" % i
        finally:
            for fd in fds:
                os.close(fd)
        wait_for(lambda: m.status()["open_files"] < 10, timeout=30, what="handles released")
        assert sum(len(os.listdir(m.mnt / f"d{k}")) for k in range(20)) == N_OPEN
        assert m.alive()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------------------------------------------ hot dir full


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 32 MiB tmpfs to hold the hot dir, unmounted after the mount on it is gone (request it before
    mount_store, so it is torn down after it)."""
    with tmpfs(tmp_path / "tmpfs", "32m") as mp:
        yield mp


def fill(path: Path, limit: int) -> tuple[int, str]:
    """Write 1 MiB pieces until an error (or `limit` bytes); return (bytes written, where ENOSPC surfaced)."""
    buf = b"\xab" * (1 << 20)
    where = "nowhere"
    n = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while n < limit:
            try:
                n += os.write(fd, buf)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                where = "write"
                break
        if where == "nowhere":
            try:
                os.fsync(fd)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                where = "fsync"
    finally:
        try:
            os.close(fd)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            where = "close" if where == "nowhere" else where
    return n, where


def test_hot_dir_full_gives_enospc_and_nothing_else_breaks(small_tmpfs, mount_store, reference_store, tmp_path):
    """The broker's active CommitLog fills the hot dir while older segments come up for sealing (the catalog
    lives on the same full file system): ENOSPC reaches the writer, nothing else breaks, space freed ends it."""
    hot = small_tmpfs / "hot"
    objects = tmp_path / "objects"
    objects.mkdir()
    opts = TIER_OPTS.replace("seal.quiet_seconds=0.5", "seal.quiet_seconds=3")
    m = mount_store(hot=hot, options=[f"{opts},objectstore.url=file://{objects},compaction.enabled=false"])
    keep = os.urandom(1 << 20)
    (m.mnt / "config").mkdir()
    (m.mnt / "config" / "keep.json").write_bytes(keep)
    old = [r for r in sealed_in(reference_store) if r.startswith("commitlog/")][:2]
    for rel in old:  # complete segments, sealed only after their quiet period: while the disk is full
        write_through(m.mnt, rel, (reference_store / rel).read_bytes())
    t_written = time.monotonic()
    active = m.mnt / f"commitlog/{50 * CL_SIZE:020d}"
    n, where = fill(active, 64 << 20)
    print(f"\nENOSPC after {n >> 20} MiB, reported by {where}")
    assert where != "nowhere", f"{n} bytes written to a 32 MiB file system without an error"
    wait_for(lambda: time.monotonic() - t_written > 5 or not m.alive(), timeout=10, what="the seal attempts")
    assert m.alive(), "the daemon died with its hot dir full"
    # everything else still works: ls, stat, reads, statfs, the control dir
    assert set(os.listdir(m.mnt)) == {"config", "commitlog", ".tierfs"}
    assert set(os.listdir(m.mnt / "commitlog")) == {p.rsplit("/", 1)[1] for p in old} | {active.name}
    evict(m.mnt / "config" / "keep.json")
    assert (m.mnt / "config" / "keep.json").read_bytes() == keep
    assert os.statvfs(m.mnt).f_bavail * os.statvfs(m.mnt).f_frsize < 1 << 20
    assert m.status()["hot_dir_bytes_free"] < 1 << 20
    # freeing space ends it: the space is free when unlink returns, writes work again, and the waiting
    # segments are sealed and tiered
    held = str(m.hot_path("commitlog", active.name))
    wait_for(lambda: held not in fd_targets(m.pid), timeout=30, what="the daemon to answer the writer's close")
    os.unlink(active)
    free = os.statvfs(m.mnt).f_bavail * os.statvfs(m.mnt).f_frsize
    assert free > 16 << 20, f"{free} bytes free once unlink returned: the unlinked file's blocks are still held"
    write_through(m.mnt, "after.dat", keep * 4)
    evict(m.mnt / "after.dat")
    assert (m.mnt / "after.dat").read_bytes() == keep * 4
    wait_for(lambda: all({f["path"]: f["state"] for f in status(m)["files"]}.get(r) == "tiered" for r in old),
             timeout=30, what="the old segments tiered once there is space")
    for rel in old:
        evict(m.mnt / rel)
        assert (m.mnt / rel).read_bytes() == (reference_store / rel).read_bytes()
    assert m.alive()
