"""Continuous tiering of active files (tiering.rpo_seconds) and the writable takeover of a lost writer's store.

A writer mounts with rpo_seconds=2, the example producer writes a store through it without ever waiting for a
segment to seal; the consumer counts what is written at a moment T; once a round that started after T has
finished, the daemon is killed with SIGKILL and its whole hot dir removed. `tierfs mount --takeover` on a new,
empty hot dir (refused while the lease lives, then with --force naming the holder) brings the store up, and the
consumer reads at least every message written before T, each one byte-identical (it checks every body, CRC and
queue offset). The old writer, stopped while the takeover happens and then resumed, is fenced: it says so and
never moves the snapshot pointer again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import struct
import sys
import time
from pathlib import Path

import pytest
from mountutil import Mount, helper_children, pid_alive, wait_for
from test_store_mount import CONSUMER, PRODUCER, SMALL, consume
from test_tiering import TIER_OPTS, copy_in, reference_store  # noqa: F401 (a fixture)

from tierfs.objectstore import open_store
from tierfs.objectstore.base import ObjectStoreError
from tierfs.store.commitlog import sealed_commitlog_end
from tierfs.tier import snapshot as snap

RPO = 2.0


class TakeoverMount(Mount):
    """`tierfs mount --takeover --from URL [--force HOLDER] HOT MNT`."""

    def __init__(self, url: str, hot: Path, mnt: Path, options=(), force: str | None = None):
        super().__init__(hot, mnt, options=options)
        self.url, self.force = url, force

    def mount_args(self) -> list[str]:
        cmd = ["mount", "--takeover", "--from", self.url, str(self.hot), str(self.mnt)]
        if self.force:
            cmd += ["--force", self.force]
        for o in self.options:
            cmd += ["-o", o]
        return cmd


class FollowMount(Mount):
    """`tierfs mount --read-only --follow --from URL --cache-dir CACHE MNT`."""

    def __init__(self, url: str, cache: Path, mnt: Path, options=(), env=None):
        super().__init__(Path(cache) / "tree", mnt, options=options, env=env)
        self.url, self.cache = url, Path(cache)

    def mount_args(self) -> list[str]:
        cmd = ["mount", "--read-only", "--follow", "--from", self.url, "--cache-dir", str(self.cache), str(self.mnt)]
        for o in self.options:
            cmd += ["-o", o]
        return cmd


def status(m: Mount) -> dict:
    return json.loads((m.mnt / ".tierfs" / "status.json").read_text())


def start_producer(store: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PRODUCER), str(store), *SMALL, "--messages", "0", "--topics", "2",
                             "--queues", "2", "--rate", "1500", "--body-min", "100", "--body-max", "900"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def written_now(m: Mount) -> tuple[int, float]:
    """(messages in the store through the mount now, a time after all of them were written): what must survive
    once a round that started later ends. The time is taken after the count: taken before it, the messages the
    producer wrote while a slow count ran (500 under CI load) were counted but not owed to that round."""
    n = consume(m.mnt, "--redispatch", "--check-keys", "0")["messages"]
    return n, time.time()


def wait_round_after(m: Mount, t: float, timeout: float = 60) -> None:
    """Wait (by condition) until a continuous-tiering round that started after t has published a point holding
    everything written before t. A round can succeed and still leave files behind for the next one (a CommitLog
    segment tiered while the round read it, or one whose end was not yet written back, holds the later segments
    of its log: `files_behind`); its point then does not hold all that, so it does not count (a CI run took over
    from such a point and found 6,316 of 18,736 messages missing)."""
    def done() -> bool:
        last = status(m)["rpo"].get("last_round") or {}
        return last.get("time", 0) > t and last.get("files_behind") == 0
    wait_for(done, timeout=timeout, interval=0.2, what=f"a continuous-tiering round after {t} leaving no file behind")


def takeover(tmp_path: Path, url: str, opts: list[str], name: str) -> tuple[TakeoverMount, str]:
    """Takeover refused while the old lease lives (the refusal names the holder), then forced. Returns the mount
    and the holder it overrode."""
    hot, mnt = tmp_path / f"{name}-hot", tmp_path / f"{name}-mnt"
    hot.mkdir()
    mnt.mkdir()
    m = TakeoverMount(url, hot, mnt, options=opts)
    res = m._cli_mount()
    assert res.returncode != 0, res.stdout
    found = re.search(r"--force '([^']+)'", res.stderr)
    assert found and "held by another writable tierfs mount" in res.stderr, res.stderr
    shutil.rmtree(hot / ".tierfs", ignore_errors=True)  # the refused daemon's log: the hot dir must be empty
    m.force = found.group(1)
    m.mount()
    return m, found.group(1)


@pytest.fixture
def cleanup_list():
    made: list = []
    yield made
    for x in reversed(made):
        if isinstance(x, subprocess.Popen):
            if x.poll() is None:
                x.kill()
            x.wait(timeout=30)
        else:
            x.cleanup()


def test_takeover_after_kill9_and_lost_hot_dir(tmp_path, mount_store, cleanup_list):
    """kill -9 of the daemon and removal of its whole hot dir while the producer runs; takeover on a new hot
    dir; every message written before a finished round is there, byte-identical; a broker-style abnormal
    recovery (abort present) works and the store takes new writes."""
    objects = tmp_path / "objects"
    objects.mkdir()
    opts = [TIER_OPTS, f"objectstore.url=file://{objects},store.id=rpo1,tiering.rpo_seconds={RPO},"
                       f"lease.ttl_seconds=60"]
    a = mount_store(options=opts)
    prod = start_producer(a.mnt)
    cleanup_list.append(prod)
    wait_for(lambda: len(list((a.mnt / "commitlog").glob("0*"))) >= 4, timeout=60, what="4 CommitLog segments")
    n1, t1 = written_now(a)
    assert n1 > 1000
    wait_round_after(a, t1)
    st = status(a)["rpo"]
    assert st["append_puts"] > 0 and st["rounds"] >= 1, st
    assert st["lag_max_s"] < 60 and set(st["lag_s"]) <= {"commitlog", "consumequeue", "index", "mutable"}, st
    text = a.cli("status", str(a.mnt)).stdout
    assert "achieved RPO" in text, text
    metrics = (a.ctl / "metrics").read_text()
    assert re.search(r'^tierfs_rpo_lag_seconds\{kind="commitlog"\} [0-9.e+-]+$', metrics, re.M), metrics[-3000:]
    assert re.search(r"^tierfs_append_objects_total [1-9]", metrics, re.M)
    a.kill(signal.SIGKILL)
    prod.kill()
    prod.wait(timeout=30)
    shutil.rmtree(a.hot)

    b, holder = takeover(tmp_path, f"file://{objects}/rpo1", opts, "b")
    cleanup_list.append(b)
    assert holder.endswith(str(a.hot))
    # a point of the hot dir taken while the producer ran: ConsumeQueues may lag the CommitLog by what was written
    # after the round's flush (the broker re-dispatches those at abnormal recovery); everything written before
    # t1 was flushed before the round read it, so it is there in full: records and their CQ units
    got = consume(b.mnt, "--redispatch", "--check-keys", "200")
    assert got["ok"] and got["abort_present"] and got["messages"] >= n1 and got["cq_units"] >= n1, (got, n1)
    info = status(b)["takeover"]
    assert info["done"] and info["overrode"] == holder and info["files_tiered"] > 0, info
    assert "took over store id rpo1" in b.log_text()
    # the new writer resumes from the point's upload offsets: its first round does not upload the active files
    # again (old code: all of them, about bytes_local)
    wait_round_after(b, time.time())
    assert status(b)["rpo"]["append_bytes"] < info["bytes_local"] / 10, (status(b)["rpo"], info)
    # the takeover is a writable store like any other: the producer resumes on it (a broker's own recovery
    # would truncate the torn tail first; the example producer starts a new store dir instead)
    more = subprocess.run([sys.executable, str(PRODUCER), str(b.mnt / "again"), *SMALL, "--messages", "500"],
                          capture_output=True, text=True, timeout=120)
    assert more.returncode == 0, more.stderr[-2000:]
    assert consume(b.mnt / "again", "--expect-messages", "500")["messages"] == 500


def _cq_file(path: Path, units: int, tag: int) -> None:
    """A ConsumeQueue file the broker's way: preallocated (sparse) to 6,000 units, `units` of them written."""
    with open(path, "wb") as f:
        f.truncate(6000 * 20)
        f.write(b"".join(struct.pack(">qiq", i * 100, 100, tag) for i in range(units)))


def test_a_file_made_again_at_a_freed_inode_gets_a_tail_of_its_own(tmp_path, mount_store, cleanup_list):
    """A ConsumeQueue deleted and made again (a topic deleted and created again) gets the st_ino the old one
    freed, at the same name. The continuous uploads' tail of the old file was kept by st_ino and became the new
    file's: the first round after uploaded only the new writes over the old file's objects, and a takeover
    served the old file's units past the new file's end."""
    objects = tmp_path / "objects"
    objects.mkdir()
    opts = [TIER_OPTS, f"objectstore.url=file://{objects},store.id=rpo5,tiering.rpo_seconds={RPO},"
                       f"lease.ttl_seconds=60"]
    a = mount_store(options=opts)
    rel = "consumequeue/TopicR/0/00000000000000000000"
    (a.mnt / rel).parent.mkdir(parents=True)
    _cq_file(a.mnt / rel, 3000, 1)
    wait_round_after(a, time.time())
    old_ino = os.stat(a.hot / rel).st_ino
    os.unlink(a.mnt / rel)
    pinned = a.hot / ".tierfs" / "unlinked"
    wait_for(lambda: not os.listdir(pinned), timeout=30, what="the kernel to forget the deleted file")
    _cq_file(a.mnt / rel, 1000, 2)
    reused = os.stat(a.hot / rel).st_ino == old_ino  # ext4 gives the freed st_ino to the next file
    want = (a.hot / rel).read_bytes()
    assert len(want) == 6000 * 20 and want[20000:] == bytes(len(want) - 20000)
    wait_round_after(a, time.time())
    a.kill(signal.SIGKILL)
    shutil.rmtree(a.hot)
    b, _ = takeover(tmp_path, f"file://{objects}/rpo5", opts, "b")
    cleanup_list.append(b)
    got = _read_uncached(b.mnt / rel)
    assert got == want, (f"st_ino reused: {reused}; {sum(x != y for x, y in zip(got, want))} bytes differ, "
                         f"first at {next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)}")


def test_a_hard_linked_active_file_is_uploaded_once(tmp_path, mount_store):
    """An active ConsumeQueue with a second name (a hard link into another queue dir): each round walked both
    names, and the tail, kept by inode but replaced whenever the name differed, went back and forth between
    them, so every round uploaded the whole file again under new keys. One tail per file now: nothing new is
    written, nothing is uploaded again."""
    objects = tmp_path / "objects"
    objects.mkdir()
    m = mount_store(options=[TIER_OPTS, f"objectstore.url=file://{objects},store.id=rpo6,"
                                        f"tiering.rpo_seconds={RPO}"])
    rel, other = "consumequeue/TopicL/0/00000000000000000000", "consumequeue/TopicL/1/00000000000000000000"
    for r in (rel, other):
        (m.mnt / r).parent.mkdir(parents=True)
    _cq_file(m.mnt / rel, 3000, 1)
    os.link(m.mnt / rel, m.mnt / other)
    wait_round_after(m, time.time())
    before = status(m)["rpo"]["append_bytes"]
    for _ in range(3):
        wait_round_after(m, time.time())
    again = status(m)["rpo"]["append_bytes"] - before
    assert again == 0, f"{again} bytes uploaded again in 3 rounds with nothing written"
    assert (m.mnt / other).read_bytes() == (m.mnt / rel).read_bytes()


def test_old_writer_fenced_after_takeover(tmp_path, mount_store, cleanup_list):
    """The old writer, paused while a takeover overrides its lease and then resumed, is fenced: its pointer
    writes, uploads and deletes are refused by the lease epoch in the store, and it logs so."""
    objects = tmp_path / "objects"
    objects.mkdir()
    opts = [TIER_OPTS, f"objectstore.url=file://{objects},store.id=rpo2,tiering.rpo_seconds={RPO},"
                       f"lease.ttl_seconds=60"]
    a = mount_store(options=opts)
    subprocess.run([sys.executable, str(PRODUCER), str(a.mnt), *SMALL, "--messages", "3000"], check=True,
                   capture_output=True, timeout=120)
    n1, t1 = written_now(a)
    wait_round_after(a, t1)
    a_pid = a.pid
    assert a_pid is not None
    os.kill(a_pid, signal.SIGSTOP)
    try:
        b, holder = takeover(tmp_path, f"file://{objects}/rpo2", opts, "b")
        cleanup_list.append(b)
        wait_for(lambda: status(b)["snapshot"].get("seq"), timeout=30, what="a snapshot by the new writer")
    finally:
        os.kill(a_pid, signal.SIGCONT)
    wait_for(lambda: "FENCED" in a.log_text(), timeout=60, what="the old writer to notice it is fenced")
    store = open_store(f"file://{objects}")
    b_writer = snap.read_pointer(store, "rpo2").writer
    assert b_writer.endswith(str(b.hot)), b_writer
    assert a.status()["lease"]["held"] is False
    assert snap.read_pointer(store, "rpo2").writer == b_writer
    assert consume(b.mnt, "--redispatch", "--check-keys", "100")["messages"] >= n1
    assert "refused" in a.log_text() or a.status()["rpo"]["last_error"]


def test_following_reader_sees_new_messages_within_the_rpo(tmp_path, mount_store, cleanup_list):
    """A `--read-only --follow` mount, made before the producer starts, sees every message the writer has within
    a bounded time after it was written (the writer's round plus the follower's refresh), and keeps serving the
    sealed, tiered and evicted segments; it refreshes incrementally (only new append objects are applied)."""
    objects = tmp_path / "objects"
    objects.mkdir()
    opts = [TIER_OPTS, f"objectstore.url=file://{objects},store.id=rpo4,tiering.rpo_seconds={RPO}"]
    a = mount_store(options=opts)
    (a.mnt / "config").mkdir()
    (a.mnt / "config" / "topics.json").write_text("{}")
    wait_round_after(a, time.time())
    r = FollowMount(f"file://{objects}/rpo4", tmp_path / "cache", tmp_path / "romnt",
                    options=[f"tiering.rpo_seconds={RPO}"])
    (tmp_path / "romnt").mkdir()
    cleanup_list.append(r)
    r.mount()
    assert (r.mnt / "config" / "topics.json").read_text() == "{}"
    subprocess.run([sys.executable, str(PRODUCER), str(a.mnt), *SMALL, "--messages", "4000", "--topics", "2",
                    "--rate", "800"], check=True, capture_output=True, timeout=120)  # segments tailed, then sealed
    done = time.monotonic()
    # each refresh shows a point taken while the writer ran: the ConsumeQueues may lag the CommitLog (even by a
    # file created after the round's walk), which the broker's abnormal recovery re-dispatches
    last: list[str] = []

    def sees_all() -> bool:
        """A refresh may be applying the next point while the consumer reads (once in CI: 'data after the end of
        the valid commitlog'): a failed read is "not yet", the last one is kept for the timeout's message."""
        if not (r.mnt / "checkpoint").exists():
            return False
        try:
            return consume(r.mnt, "--redispatch", "--check-keys", "0")["messages"] == 4000
        except AssertionError as e:
            last[:] = [str(e)[-600:]]
            return False

    try:
        wait_for(sees_all, timeout=60, interval=0.5, what="the follower to see all 4000 messages")
    except AssertionError as e:
        raise AssertionError(f"{e}; last failed read: {last}") from None
    seen_after = time.monotonic() - done
    print(f"follower saw all messages {seen_after:.1f} s after the producer finished (rpo {RPO} s)")
    assert seen_after < 4 * RPO + 20
    # and once the writer's next round has the ConsumeQueues and IndexFiles caught up, all of it checks strictly

    def strict() -> bool:
        try:
            got = consume(r.mnt, "--expect-messages", "4000", "--check-keys", "200")
        except AssertionError:
            return False
        return got["ok"] and got["messages"] == 4000
    wait_for(strict, timeout=60, interval=0.5, what="the follower's store to check strictly")
    st = status(r)
    assert st["follow"]["refreshes"] >= 1 and st["read_only"], st["follow"]
    # the seal replaces append objects: once segments are tiered, theirs go (grace 0 here) when no kept
    # snapshot names them any more
    wait_for(lambda: status(a)["rpo"]["append_objects_deleted"] > 0, timeout=60, interval=0.5,
             what="append objects of tiered segments deleted")
    # sealing adopted the append objects (tierfs.tier.sealcopy): chunks composed in the store, not sent again;
    # the follower read every message byte-identical from those chunks above
    eng = status(a)["totals"]["engine"]
    assert 0 < eng["upload_copied_bytes"] <= eng["upload_bytes"], eng


def _read_uncached(p: Path) -> bytes:
    """The file's bytes as a new reader gets them now: a fresh open, the kernel's pages dropped after."""
    with open(p, "rb") as f:
        data = f.read()
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return data


def test_a_refresh_swaps_each_file_in_whole(tmp_path, mount_store, cleanup_list, reference_store):
    """A follower's refresh that replaces a file (an active tail that sealed, now served from its segment
    objects) swaps it in whole: every reader that opens it meanwhile gets the old bytes or the new ones. The refresh
    is held in the middle of the swap (failpoint follow.swap) while the test reads. Before the fix the new, empty
    sparse copy was in place before its entry was, and readers in that window got zeros; and the staged copy
    was listed under a dot name beside the file."""
    rel = "commitlog/00000000000000000000"
    data = (reference_store / rel).read_bytes()
    end = sealed_commitlog_end(data, len(data))
    assert end is not None and end > 0
    old = data[:end] + bytes(len(data) - end)  # the tail the follower starts from: every record, no BLANK
    objects = tmp_path / "objects"
    objects.mkdir()
    a = mount_store(options=[TIER_OPTS, f"objectstore.url=file://{objects},store.id=swap1,tiering.rpo_seconds=1"])
    (a.mnt / "commitlog").mkdir()
    fd = os.open(a.mnt / rel, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, len(data))
        os.pwrite(fd, data[:end], 0)
        os.fsync(fd)
        wait_round_after(a, time.time())
        r = FollowMount(f"file://{objects}/swap1", tmp_path / "cache", tmp_path / "romnt",
                        options=["tiering.rpo_seconds=1"], env={"TIERFS_FAILPOINTS": "follow.swap=sleep:6"})
        (tmp_path / "romnt").mkdir()
        cleanup_list.append(r)
        r.mount()
        assert _read_uncached(r.mnt / rel) == old
        os.pwrite(fd, data[end:], end)  # the BLANK: the segment seals, is uploaded and tiered
        os.fsync(fd)
    finally:
        os.close(fd)

    def swapped() -> bool:
        """Read it, whatever the follower is doing: done once it serves the sealed segment from its objects."""
        tiered = any(f["path"] == rel and f["state"] == "tiered" for f in status(r)["files"])
        assert os.listdir(r.mnt / "commitlog") == [rel.split("/")[1]]  # nothing staged shows in a listing
        got = _read_uncached(r.mnt / rel)
        assert got in (old, data), f"a reader got neither the old nor the new bytes ({got.count(0)} zero bytes)"
        return tiered and got == data
    wait_for(swapped, timeout=90, interval=0.1, what="the follower to serve the sealed segment from its objects")
    assert status(r)["follow"]["refreshes"] >= 1


def test_a_reader_holding_a_rewritten_segment_keeps_its_bytes(tmp_path, mount_store, cleanup_list,
                                                              reference_store):
    """A follower's reader that holds a tiered segment open while the writer rewrites it (a new generation, new
    objects) keeps reading the bytes it opened, evicted parts included, as after a rename over an open file; a new
    reader gets the new bytes. Before the fix the old entry was dropped at the refresh and the held reader got
    zeros for every block not fetched yet."""
    rel = "commitlog/00000000000000000000"
    data = (reference_store / rel).read_bytes()
    end = sealed_commitlog_end(data, len(data))
    changed = bytearray(data)
    changed[end - 1] ^= 0xFF  # a byte of the last record's body: still sealed by content, a new generation
    objects = tmp_path / "objects"
    objects.mkdir()
    a = mount_store(options=[TIER_OPTS, f"objectstore.url=file://{objects},store.id=swap2,tiering.rpo_seconds=1"])
    (a.mnt / "commitlog").mkdir()
    (a.mnt / rel).write_bytes(data)

    def tiered(m: Mount) -> bool:
        return any(f["path"] == rel and f["state"] == "tiered" for f in status(m)["files"])
    wait_for(lambda: tiered(a), timeout=60, interval=0.2, what="the segment tiered on the writer")
    wait_round_after(a, time.time())
    r = FollowMount(f"file://{objects}/swap2", tmp_path / "cache", tmp_path / "romnt", options=["tiering.rpo_seconds=1"])
    (tmp_path / "romnt").mkdir()
    cleanup_list.append(r)
    r.mount()
    assert tiered(r)
    held = os.open(r.mnt / rel, os.O_RDONLY)
    try:
        # nothing read yet: every block of it is still only in the bucket (a read now would read ahead)
        fd = os.open(a.mnt / rel, os.O_WRONLY)
        try:
            os.pwrite(fd, changed[end - 1:end], end - 1)
            os.fsync(fd)
        finally:
            os.close(fd)

        def objects(m: Mount) -> list[str]:
            return next((f["objects"] for f in status(m)["files"] if f["path"] == rel and f["state"] == "tiered"), [])
        first = objects(r)
        wait_for(lambda: objects(r) not in ([], first), timeout=90, interval=0.2,
                 what="the follower to serve the rewritten segment's objects")  # without reading the old ones
        os.posix_fadvise(held, 0, 0, os.POSIX_FADV_DONTNEED)
        got = os.pread(held, len(data), 0)
        assert got == data, f"the held reader got other bytes ({got.count(0)} zero bytes)"
    finally:
        os.close(held)
    assert _read_uncached(r.mnt / rel) == changed


# ---------------------------------------------------------------------------------------------- S3 (Ceph RGW)


def test_s3_store_failing_midstream_then_takeover(tmp_path, mount_store, cleanup_list, rgw, fault_proxy):
    """The object store fails and recovers while the producer runs (503s, then resets after the server acted on a
    PUT: an append object that landed while its writer thinks it failed): rounds fail without blocking the next,
    and a takeover sees no gap and no duplicate (the consumer checks consecutive message numbers, queue offsets
    and physical offsets of every record)."""
    bucket = "tier-rpo"
    rgw.make_bucket(bucket)
    creds = (f"objectstore.access_key_id={rgw.access_key},objectstore.secret_access_key={rgw.secret_key},"
             f"objectstore.addressing=path,objectstore.max_attempts=1,objectstore.read_timeout_seconds=3")
    opts = [TIER_OPTS, f"objectstore.url=s3://{bucket}/stores,store.id=rpo3,tiering.rpo_seconds={RPO},"
                       f"lease.ttl_seconds=60,upload.retry_max_seconds=2,compaction.enabled=false,{creds},"
                       f"objectstore.endpoint_url={fault_proxy.endpoint_url}"]
    a = mount_store(options=opts)
    prod = start_producer(a.mnt)
    cleanup_list.append(prod)
    wait_for(lambda: status(a)["rpo"]["rounds"] >= 2, timeout=60, what="two rounds")
    for mode, kw in (("error", {"status": 503, "code": "SlowDown"}), ("reset", {"phase": "response"})):
        before = status(a)["rpo"]["failed_rounds"]
        fault_proxy.set(mode, methods=["PUT"], probability=0.5, count=1000, **kw)
        wait_for(lambda: status(a)["rpo"]["failed_rounds"] >= before + 2, timeout=90, what=f"rounds failing ({mode})")
        fault_proxy.set("pass")
    n1, t1 = written_now(a)
    wait_round_after(a, t1, timeout=90)
    a.kill(signal.SIGKILL)
    prod.kill()
    prod.wait(timeout=30)
    shutil.rmtree(a.hot)
    direct = [o.replace(fault_proxy.endpoint_url, rgw.endpoint_url) for o in opts]
    b, _ = takeover(tmp_path, f"s3://{bucket}/stores/rpo3", direct, "b")
    cleanup_list.append(b)
    got = consume(b.mnt, "--redispatch", "--check-keys", "200")
    assert got["ok"] and got["messages"] >= n1 and got["cq_units"] >= n1, (got, n1)


def _point_tails(objects: Path, sid: str, tmp: Path) -> dict[str, bytes]:
    """The active files of the store's newest point (a file:// bucket), each as its append objects make it."""
    store = open_store(f"file://{objects}")
    ptr = snap.read_pointer(store, sid)
    db = tmp / f"point-{ptr.seq}.db"
    db.write_bytes(store.get(ptr.key))
    out = {}
    for row in snap.load_tails(db, sid, ".tierfs", set()):
        buf = bytearray(row.size)
        for o in row.objects:
            buf[o.start:o.end] = store.get(o.key)
        out[row.path] = bytes(buf)
    return out


def _commitlog_records(base: int, first: int, count: int, at: int = 0) -> bytes:
    """`count` whole CommitLog records (messages first .. first+count-1) from segment position `at`."""
    from tierfs.store import commitlog as cl

    out = bytearray()
    for i in range(first, first + count):
        out += cl.encode_message(cl.Message(topic="TopicGap", body=b"m%06d" % i * 100,
                                            physical_offset=base + at + len(out), store_timestamp=1000 + i,
                                            properties={"KEYS": f"k-{i}"}))
    return bytes(out)


def rounds_done(m: Mount) -> int:
    rpo = status(m)["rpo"]
    return rpo["rounds"] + rpo["failed_rounds"]


def _one_segment_store(tmp_path: Path, mount_store, sid: str, hold: float, seal_quiet: float = 0.5
                       ) -> tuple[Mount, Path, bytes]:
    """A mount whose rounds wait `hold` seconds between their flush and their uploads, holding CommitLog segment
    0 (1 MiB) with 20 records in the newest point: (mount, its file:// bucket, those records). The sealer flushes
    a segment quiet for `seal_quiet` seconds through the mount (its dirty mapped pages reach the daemon then)."""
    objects = tmp_path / "objects"
    objects.mkdir()
    m = mount_store(options=[TIER_OPTS, f"objectstore.url=file://{objects},store.id={sid},tiering.rpo_seconds=1,"
                                        f"lease.ttl_seconds=60,seal.quiet_seconds={seal_quiet}"],
                    env={"TIERFS_FAILPOINTS": f"appendlog.upload=sleep:{hold}"})
    head = _commitlog_records(0, 0, 20)
    (m.mnt / "commitlog").mkdir()
    with open(m.mnt / f"commitlog/{0:020d}", "wb") as f:
        f.truncate(1 << 20)
        f.write(head)
        os.fsync(f.fileno())
    wait_round_after(m, time.time())
    assert _point_tails(objects, sid, tmp_path)[f"commitlog/{0:020d}"].rstrip(b"\0") == head
    return m, objects, head


def _held_round(m: Mount) -> int:
    """Wait until a round is held after its walk and flush (the failpoint); the rounds done so far."""
    pause = "failpoint appendlog.upload: pausing"
    waiting = m.log_text().count(pause) + 1
    wait_for(lambda: m.log_text().count(pause) >= waiting, timeout=60, what="a round held after its flush")
    return rounds_done(m)


def test_a_point_holds_a_prefix_of_the_commitlog(tmp_path, mount_store):
    """A point names the segments of the CommitLog as one log: never a record of segment N+1 while N's objects
    stop before its terminal BLANK (a reader, and the broker's recovery, stop at that gap and lose what follows).
    The failpoint holds a round between its flush and its uploads; meanwhile the broker rolls over: it writes the
    BLANK into N through its mapping (the page stays dirty in the kernel) and the first record of N+1, which
    reaches the daemon. Old code (test_s3_store_failing_midstream_then_takeover under load, the consumer after
    the takeover: "data after the end of the valid commitlog"): the round read N without its BLANK and N+1 with
    its record, and the point named both, whatever order the walk gave them. Now N+1 waits a round, until N's
    objects reach its BLANK."""
    import mmap

    from tierfs.store import commitlog as cl

    # the sealer must not flush the BLANK's dirty page through the mount during the held round (it did, on a
    # busy machine: segment 0 was sealed, tiered and left the point's tails)
    m, objects, head = _one_segment_store(tmp_path, mount_store, "gap", 3, seal_quiet=3600)
    size = 1 << 20
    n0, n1 = f"commitlog/{0:020d}", f"commitlog/{size:020d}"
    with open(m.mnt / n1, "wb") as f:  # the broker makes the next segment ahead of time
        f.truncate(size)
    fd = os.open(m.mnt / n0, os.O_RDWR)
    try:
        with mmap.mmap(fd, size, mmap.MAP_SHARED) as mm:
            inside = _held_round(m)
            mm[len(head):len(head) + cl.BLANK_SIZE] = cl.encode_blank(size - len(head))  # dirty in the kernel
            first = _commitlog_records(size, 20, 1)
            with open(m.mnt / n1, "r+b") as f:
                f.write(first)
                os.fsync(f.fileno())  # in the hot file before the round reads it
            assert rounds_done(m) == inside, "the roll-over did not land inside the held round: lengthen the failpoint"
            seen: list[dict] = []
            wait_for(lambda: seen.append(status(m)["rpo"]) or seen[-1]["rounds"] + seen[-1]["failed_rounds"] > inside,
                     timeout=60, what="the held round")
            held = seen[-1]
            assert held["rounds"] + held["failed_rounds"] == inside + 1, "the next round ended too: lengthen the failpoint"
            # the round succeeded, and says it left N+1 behind: its point does not hold what was written before it
            assert held["last_round"].get("files_behind") == 1, held["last_round"]
            point = _point_tails(objects, "gap", tmp_path)
            assert point[n0].rstrip(b"\0") == head, "the BLANK's page reached the daemon early: no race to test"
            assert not point[n1].strip(b"\0"), \
                f"the point names the first record of {n1} while {n0} ends at {len(head)} without its BLANK"
            mm.flush()  # the BLANK reaches the daemon: the next round takes both
        wait_round_after(m, time.time())
        point = _point_tails(objects, "gap", tmp_path)
        assert point[n1].rstrip(b"\0") == first, "the next segment never went up once the one before was whole"
        assert n0 not in point or point[n0].rstrip(b"\0") == head + cl.encode_blank(size - len(head)).rstrip(b"\0")
    finally:
        os.close(fd)


def by_path(m: Mount) -> dict[str, dict]:
    return {f["path"]: f for f in status(m)["files"]}


def test_a_point_names_a_segment_tiered_during_its_round_by_its_objects(tmp_path, mount_store):
    """A segment sealed, tiered and evicted between a round's walk and its upload: the round read its hot file
    with the evicted bytes as holes. Old code (test_s3_store_failing_midstream_then_takeover, the writer's log:
    the round uploaded the first page of a tiered IndexFile, or of a CommitLog segment whose earlier uploads had
    failed, and the point named that tail instead of the segment's objects): the point named the tail's objects
    up to where the last good upload stopped, so the records written since were lost to a takeover. Now the
    round leaves a file that is TIERED by then (and drops what it read from one that became TIERED while it read
    it), and a point names a TIERED file by its segment objects, whatever its tail holds."""
    from tierfs.store import commitlog as cl

    m, objects, head = _one_segment_store(tmp_path, mount_store, "punch", 8)
    size, rel = 1 << 20, f"commitlog/{0:020d}"

    def evicted() -> bool:  # all but the first page (DESIGN §4)
        if by_path(m).get(rel, {}).get("state") != "tiered":
            return False
        assert m.cli("evict", m.mnt).returncode == 0
        return by_path(m)[rel]["resident_bytes"] <= 4096
    inside = _held_round(m)
    rest = _commitlog_records(0, 20, 40, at=len(head))  # past the first page, then the BLANK: sealed
    with open(m.mnt / rel, "r+b") as f:
        f.seek(len(head))
        f.write(rest + cl.encode_blank(size - len(head) - len(rest)))
        os.fsync(f.fileno())
    wait_for(evicted, timeout=60, interval=0.3, what=f"{rel} sealed, tiered and evicted")
    assert rounds_done(m) == inside, "the segment was not tiered inside the held round: lengthen the failpoint"
    wait_for(lambda: rounds_done(m) > inside, timeout=60, what="the held round")
    point = _point_tails(objects, "punch", tmp_path)
    assert rel not in point, (f"the point names {rel} by a tail of {len(point[rel].rstrip(bytes(1)))} bytes, not "
                              f"by the objects of the tiered segment ({len(head) + len(rest)} bytes of records)")


def test_a_first_upload_stops_when_its_segment_goes_tiered(tmp_path, mount_store):
    """A segment written whole faster than a round uploads it (a restart, a bulk copy, the cold-read bench): the
    round's first upload of it goes in chunk-sized pieces while the sealer tiers it and the evictor punches its
    hot file. Old code read and PUT every remaining piece, holes as zeros, and the round then dropped them all
    (the cold-read bench: 15 % of the daemon's CPU during a read, and ~1 GiB of zeros PUT per 1 GiB segment).
    Now the upload stops at the first piece after the segment is TIERED."""
    from tierfs.store import commitlog as cl

    objects = tmp_path / "objects"
    objects.mkdir()
    size, chunk, rel = 8 << 20, 1 << 20, f"commitlog/{0:020d}"
    m = mount_store(options=[TIER_OPTS, f"objectstore.url=file://{objects},store.id=stop,tiering.rpo_seconds=1,"
                                        f"objectstore.chunk_bytes={chunk},seal.quiet_seconds=3"],
                    env={"TIERFS_FAILPOINTS": "appendlog.piece=sleep:4"})
    records = _commitlog_records(0, 0, 6000)
    assert len(records) < size - cl.BLANK_SIZE
    (m.mnt / "commitlog").mkdir()
    before = status(m)["rpo"]["append_bytes"]
    with open(m.mnt / rel, "wb") as f:
        f.truncate(size)
        f.write(records + cl.encode_blank(size - len(records)))
        os.fsync(f.fileno())
    hold = "failpoint appendlog.piece: holding"
    wait_for(lambda: hold in m.log_text(), timeout=60, what="the round's first upload of the segment")
    inside = rounds_done(m)

    def evicted() -> bool:
        if by_path(m).get(rel, {}).get("state") != "tiered":
            return False
        assert m.cli("evict", m.mnt).returncode == 0
        return by_path(m)[rel]["resident_bytes"] <= 4096
    wait_for(evicted, timeout=60, interval=0.3, what=f"{rel} sealed, tiered and evicted")
    assert m.log_text().count(hold) < size // chunk, "the segment was not tiered during its upload: lengthen the " \
                                                     "failpoint"
    wait_for(lambda: rounds_done(m) > inside, timeout=120, what="the round uploading the segment")
    put = status(m)["rpo"]["append_bytes"] - before
    assert put < len(records), f"the round PUT {put} bytes of a segment tiered and evicted during its upload"
    assert (m.mnt / rel).read_bytes()[:len(records)] == records


def _read_pages(p: Path, off: int, size: int) -> bytes:
    """One pread of [off, off+size) by a new reader: its kernel pages dropped first, and no read-ahead (random
    advice), so the daemon is asked for these pages and nothing around them."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", ["file", "rgw"])
def test_takeover_serves_pinned_pages_from_the_store(tmp_path, mount_store, cleanup_list, backend, request):
    """Issue 27, finding 4: a takeover builds its tiered segments as sparse files with nothing local, yet the block
    cache took the pinned pages (the first page of every segment, the last of every ConsumeQueue: DESIGN §4) as
    local on every writable mount. A pread of just those pages, which a broker's recovery and cleaning make,
    returned zeros, and the kernel kept them. Now the hot file decides: the pages are fetched on their first read,
    kept in the hot file, and stay there through an eviction."""
    ref = tmp_path / "ref"
    r = subprocess.run([sys.executable, str(PRODUCER), str(ref), "--commitlog-size", str(1 << 20), "--cq-size",
                        "100000", "--index-slots", "500", "--index-items", "2000", "--messages", "12000",
                        "--topics", "1", "--queues", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    extra = ""
    if backend == "rgw":
        rgw = request.getfixturevalue("rgw")
        bucket = rgw.make_bucket("tier-pins")
        url, src = f"s3://{bucket}/stores", f"s3://{bucket}/stores/pins"
        extra = (f",objectstore.endpoint_url={rgw.endpoint_url},objectstore.access_key_id={rgw.access_key},"
                 f"objectstore.secret_access_key={rgw.secret_key},objectstore.addressing=path")
    else:
        (tmp_path / "objects").mkdir()
        url = src = f"file://{tmp_path / 'objects'}"
        src += "/pins"
    opts = [TIER_OPTS, f"objectstore.url={url},store.id=pins,tiering.rpo_seconds={RPO},lease.ttl_seconds=60,"
                       f"compaction.enabled=false{extra}"]
    a = mount_store(options=opts)
    copy_in(ref, a.mnt)
    cqs = [f"consumequeue/TopicTest/0/{n:020d}" for n in (0, 100000)]  # full (sealed): 2 blocks of 64 KiB each
    segs = cqs + ["commitlog/00000000000000000000"]

    def tiered() -> bool:
        files = {f["path"]: f for f in status(a)["files"]}
        return all(files.get(rel, {}).get("state") == "tiered" for rel in segs)
    wait_for(tiered, timeout=90, what=f"{segs} tiered")
    wait_round_after(a, time.time())  # a point that names them tiered
    a.kill(signal.SIGKILL)
    shutil.rmtree(a.hot)

    b, _ = takeover(tmp_path, src, opts, "b")
    cleanup_list.append(b)
    files = {f["path"]: f for f in status(b)["files"]}
    assert all(files[rel]["state"] == "tiered" and files[rel]["resident_bytes"] == 0 for rel in segs), files
    pages = []  # (segment, offset, length) of every pinned page
    for rel in segs:
        size = (ref / rel).stat().st_size
        pages.append((rel, 0, 4096))
        if rel in cqs:
            last = (size - 1) // 4096 * 4096
            pages.append((rel, last, size - last))
    wrong = []
    for rel, off, n in pages:
        got = _read_pages(b.mnt / rel, off, n)
        if got != (ref / rel).read_bytes()[off:off + n]:
            wrong.append(f"{rel} [{off}, {off + n}): {'zeros' if not got.strip(bytes(1)) else 'wrong bytes'}")
    assert not wrong, f"pinned pages read through the takeover: {wrong}"

    def held_locally() -> bool:  # the first read kept each page in the hot file (installed in the background)
        for rel, off, n in pages:
            with open(b.hot / rel, "rb") as f:
                if os.pread(f.fileno(), n, off) != (ref / rel).read_bytes()[off:off + n]:
                    return False
        return True
    wait_for(held_locally, timeout=30, what="the pinned pages kept in the hot files")

    def evicted() -> bool:  # a segment read in the last second is left alone: then ask again
        res = b.cli("evict", b.mnt)
        assert res.returncode == 0, res.stderr
        return all(f["resident_bytes"] == 0 for f in status(b)["files"] if f["path"] in segs)
    wait_for(evicted, timeout=60, interval=0.5, what="the segments evicted on request")
    fetches = status(b)["totals"]["engine"]["fetches"]
    for rel, off, n in pages:
        assert _read_pages(b.mnt / rel, off, n) == (ref / rel).read_bytes()[off:off + n], (rel, off)
    assert status(b)["totals"]["engine"]["fetches"] == fetches, "pinned pages were fetched again after an eviction"


def test_rpo_config_is_documented():
    from tierfs.config import schema_markdown

    assert "tiering.rpo_seconds" in schema_markdown()
    assert CONSUMER.exists()


def test_force_names_the_holder_and_fencing_is_final(tmp_path):
    """In process: --force must name the holder in force; the writer taken over is fenced by the store's word
    (verify), says so, and never takes the lease again in its life, not even once the new one is released."""
    from tierfs.tier.lease import LeaseHeld, WriterLease

    store = open_store(f"file://{tmp_path}")
    old = WriterLease(store, "sid", tmp_path / "hot-a", tmp_path / "mnt-a", ttl=60, host="a")
    new = WriterLease(store, "sid", tmp_path / "hot-b", tmp_path / "mnt-b", ttl=60, host="b")
    old.acquire()
    with pytest.raises(LeaseHeld, match=r"--force 'a:/nowhere' does not name the holder in force"):
        new.acquire(force="a:/nowhere")
    new.acquire(force=old.id)
    assert new.epoch == old.epoch + 1 and old.held()  # the old writer's own clock still says held...
    with pytest.raises(ObjectStoreError, match="fenced"):
        old.verify()  # ...the store says otherwise
    assert old.fenced and not old.held()
    new.release()
    with pytest.raises(LeaseHeld):
        old.acquire()  # a released lease is free for anyone but a writer that was taken over


def test_append_ranges_merge_and_cover():
    from tierfs.tier.appendlog import TailObject, coalesce, covered_by

    assert coalesce([(100, 200), (0, 10), (150, 300), (9000, 9100)], 9050, gap=1000) == [(0, 300), (9000, 9050)]
    assert coalesce([(0, 10), (20, 30)], 100, gap=0) == [(0, 10), (20, 30)]
    merged = coalesce([(0, 4096), (4096, 8192)], 1 << 20, 0)
    assert covered_by(TailObject("k", 100, 5000, 0), merged)
    assert not covered_by(TailObject("k", 8000, 500, 0), merged)


def test_append_objects_never_cross_a_chunk_boundary():
    """A round cuts its ranges at chunk boundaries (and at MAX_OBJECT): a chunk one round wrote whole is then one
    whole append object, which the seal turns into the chunk without copying it (fails on 6378e32: no `pieces`,
    and a round's 25 MiB went up as one object across two chunks)."""
    from tierfs.tier.appendlog import MAX_OBJECT, pieces

    chunk = 16 << 20
    got = list(pieces([(5 << 20, 30 << 20), (100 << 20, 100 << 20), (200 << 20, 300 << 20)], chunk))
    assert got[:2] == [(5 << 20, 11 << 20), (16 << 20, 14 << 20)]
    assert all(off // chunk == (off + n - 1) // chunk and 0 < n <= MAX_OBJECT for off, n in got)
    covered = [(off, off + n) for off, n in got]
    assert covered == sorted(covered) and sum(n for _, n in got) == (25 << 20) + (100 << 20)
    assert list(pieces([(0, 3 * MAX_OBJECT)], 0)) == [(i * MAX_OBJECT, MAX_OBJECT) for i in range(3)]


def _segment_with_torn_record(tmp_path: Path, base: int = 1 << 20) -> tuple[Path, list[int]]:
    """A 1 MiB CommitLog segment holding 40 whole records, then one whose properties' last page is still zeros
    (its body, lengths and crc are there): what a copy of an mmap'd segment can hold mid-write."""
    from tierfs.store import commitlog as cl

    seg = tmp_path / "store" / "commitlog" / f"{base:020d}"
    seg.parent.mkdir(parents=True)
    buf = bytearray(1 << 20)
    ends, pos = [], 0
    for i in range(41):
        props = {"seq": str(i), "KEYS": f"K{i}", "pad": "x" * (3000 if i == 40 else 10)}
        rec = cl.encode_message(cl.Message(topic="TO", body=b"m%06d" % i * 50, physical_offset=base + pos,
                                           store_timestamp=1, properties=props))
        buf[pos:pos + len(rec)] = rec
        pos += len(rec)
        ends.append(pos)
    torn_from = ends[-2] + 200 + 4096 - (ends[-2] + 200) % 4096  # the torn record's second page: not yet written
    buf[torn_from:ends[-1]] = bytes(ends[-1] - torn_from)
    assert torn_from < ends[-1] - 100 and cl.decode_record(buf, ends[-2], check_crc=True) is not None, \
        "the torn record passes the broker's own recovery checks"
    seg.write_bytes(bytes(buf))
    return seg, ends


def test_commitlog_walk_stops_before_a_torn_record(tmp_path):
    from tierfs.store import commitlog as cl

    seg, ends = _segment_with_torn_record(tmp_path)
    buf = seg.read_bytes()
    whole = dict(buf_offset=0, file_start=1 << 20, file_size=len(buf))
    assert cl.complete_records_end(buf, 0, trusted_end=0, **whole) == (ends[-2], False)
    # records up to the last byte written before the flush need only their lengths
    assert cl.complete_records_end(buf, 0, trusted_end=len(buf), **whole) == (ends[-1], False)
    # a window ending inside a record asks for more; a wrong PHYSICALOFFSET is not a whole record
    assert cl.complete_records_end(buf[:ends[3] + 10], 0, trusted_end=0, **whole) == (ends[3], True)
    assert cl.complete_records_end(buf[ends[1]:], ends[1], buf_offset=ends[1], file_start=1 << 21,
                                   file_size=len(buf), trusted_end=0) == (ends[1], False)
    # a terminal BLANK ends the segment
    sealed = bytearray(buf)
    sealed[ends[-2]:] = cl.encode_blank(len(buf) - ends[-2]) + bytes(len(buf) - ends[-2] - 8)
    assert cl.complete_records_end(sealed, 0, trusted_end=0, **whole) == (ends[-2] + 8, False)


def test_continuous_upload_never_copies_a_torn_commitlog_record(tmp_path, mount_store):
    """Fails on 7786e4a: a round copied the active CommitLog up to its last non-zero byte, so a point could hold
    a record whose last page was still zeros while its ConsumeQueue unit named it; the broker's recovery accepts
    such a record (lengths and body crc are right) and a takeover served it without its properties. Through a
    mount: the segment reaches the daemon with the last record's second page not written yet (as a page of the
    broker's mapping the kernel has not written back); the round's point stops before that record, and once the
    page is written the next round's point holds it."""
    from tierfs.store import commitlog as cl

    seg, ends = _segment_with_torn_record(tmp_path / "src", base=0)
    torn = seg.read_bytes()
    whole = bytearray(torn)
    whole[ends[-2]:ends[-1]] = cl.encode_message(cl.Message(
        topic="TO", body=b"m%06d" % 40 * 50, physical_offset=ends[-2], store_timestamp=1,
        properties={"seq": "40", "KEYS": "K40", "pad": "x" * 3000}))
    objects = tmp_path / "objects"
    objects.mkdir()
    m = mount_store(options=[TIER_OPTS, f"objectstore.url=file://{objects},store.id=torn,tiering.rpo_seconds=1,"
                                        "lease.ttl_seconds=60"])
    rel = f"commitlog/{0:020d}"
    (m.mnt / "commitlog").mkdir()
    with open(m.mnt / rel, "wb") as f:
        f.truncate(len(torn))
        f.write(torn.rstrip(b"\0"))  # up to the torn record's unwritten page
        os.fsync(f.fileno())
    wait_round_after(m, time.time())
    held = _point_tails(objects, "torn", tmp_path)[rel]
    assert held[:ends[-2]] == torn[:ends[-2]], "the point lacks whole records"
    assert not held[ends[-2]:].strip(b"\0"), \
        f"the point holds {len(held.rstrip(bytes(1))) - ends[-2]} bytes of the torn record at {ends[-2]}"
    with open(m.mnt / rel, "r+b") as f:  # the page arrives: the record is whole
        f.seek(ends[-2])
        f.write(whole[ends[-2]:ends[-1]])
        os.fsync(f.fileno())
    wait_round_after(m, time.time())
    held = _point_tails(objects, "torn", tmp_path)[rel]
    assert held[:ends[-1]] == whole[:ends[-1]] and not held[ends[-1]:].strip(b"\0"), "the whole record never went up"


def test_a_round_flushes_through_the_mount_without_syncing_the_hot_files(tmp_path, mount_store):
    """A round's flush through the mount (so pages still dirty in the kernel reach the daemon) made the daemon
    fsync every active hot file too: a journal commit per file per round on the disk a SYNC_FLUSH broker waits
    on (bench/broker.py: produce 0.51 of native with continuous tiering, 0.83 without). The flusher only needs
    the kernel's writeback, which precedes its FSYNC; the daemon now answers its FSYNCs without a sync. Fails on
    33d7933 (the powerloss journal sees the hot file synced)."""
    import mmap

    import powerloss

    objects = tmp_path / "objects"
    objects.mkdir()
    hot, journal = tmp_path / "hot", tmp_path / "journal"
    m = mount_store(hot=hot, options=[TIER_OPTS, f"objectstore.url=file://{objects},tiering.rpo_seconds=1"],
                    env=powerloss.env(hot, journal))
    rel = "consumequeue/TopicF/0/00000000000000000000"
    (m.mnt / rel).parent.mkdir(parents=True)
    with open(m.mnt / rel, "w+b") as f:
        f.truncate(1 << 20)
        with mmap.mmap(f.fileno(), 1 << 20) as mm:
            mm[:20 * 1000] = b"".join(struct.pack(">qiq", i * 100, 100, 7) for i in range(1000))
            t = time.time()
            wait_round_after(m, t)  # the pages are still dirty in the kernel: only the round's flush sends them
            assert status(m)["rpo"]["append_bytes"] >= 20 * 1000, status(m)["rpo"]
    synced = [f for f in powerloss.lines(journal) if f[0] == "S" and f[2].endswith(rel)]
    assert not synced, f"the round fsynced the hot file {len(synced)} times"


def flusher_children(daemon: int) -> list[int]:
    """Live (not zombie) tierfs.tier.flusher processes whose parent is the daemon."""
    return helper_children(daemon, "tierfs.tier.flusher")


def test_one_flusher_process_serves_every_round_and_goes_with_the_mount(tmp_path, mount_store):
    """Every flush through the mount started a Python interpreter of its own (~0.15 CPU-seconds importing trio).
    Seal scans and rounds flush up to every second: 29 children during one 40,000-message produce of
    bench/broker.py, CPU taken from a SYNC_FLUSH broker on 2 cores. One child now serves the mount's life; one
    killed is replaced at the next flush; the unmount ends it. Fails on 4f2c5b5 (a child per flush, gone after)."""
    import mmap

    objects = tmp_path / "objects"
    objects.mkdir()
    m = mount_store(options=[TIER_OPTS, f"objectstore.url=file://{objects},tiering.rpo_seconds=1"])
    rel = "consumequeue/TopicF/0/00000000000000000000"
    (m.mnt / rel).parent.mkdir(parents=True)
    with open(m.mnt / rel, "w+b") as f:
        f.truncate(1 << 20)
        with mmap.mmap(f.fileno(), 1 << 20) as mm:
            def units(first: int, n: int) -> None:
                mm[first * 20:(first + n) * 20] = b"".join(struct.pack(">qiq", i * 100, 100, 7)
                                                           for i in range(first, first + n))

            units(0, 100)
            wait_for(lambda: flusher_children(m.pid), timeout=60, interval=0.05, what="the flusher process")
            first = flusher_children(m.pid)
            for k in range(1, 4):  # three more rounds, each with pages dirty in the kernel to flush
                units(100 * k, 100)
                wait_round_after(m, time.time())
            assert flusher_children(m.pid) == first, "a flush started another process"
            assert status(m)["rpo"]["append_bytes"] >= 400 * 20

            os.kill(first[0], signal.SIGKILL)
            units(400, 100)
            wait_for(lambda: flusher_children(m.pid) not in ([], first), timeout=60, interval=0.1,
                     what="a new flusher process after the old one was killed")
            wait_round_after(m, time.time())
            st = status(m)
            assert st["rpo"]["append_bytes"] >= 500 * 20, st["rpo"]
            assert st["workers"]["restarts"].get("flusher") == 1, st["workers"]
            second = flusher_children(m.pid)
    m.umount()
    assert not any(pid_alive(p) for p in second), "the flusher outlived the unmount"


# ------------------------------------------------------------------------ IndexFile tails without the slot table


def _index_file(path: Path, slots: int, items: int, keys: int, start: int = 0, buf=None) -> bytearray:
    """An IndexFile written by the broker's put logic (tierfs.store.indexfile), `keys` items from `start` on."""
    from tierfs.store import indexfile as ix

    if buf is None:
        buf = bytearray(ix.index_file_size(slots, items))
    w = ix.IndexWriter(buf, slots, items, load=start > 0)
    for n in range(start, start + keys):
        assert w.put_key(f"TopicTest#key-{n}", n * 1000, 1_700_000_000_000 + n * 10)
    path.write_bytes(buf)
    return buf


def test_index_slot_table_is_rebuilt_from_items(tmp_path, monkeypatch):
    """The hash slots are derived data: replaying the items rebuilds them byte for byte; a file whose size fits
    the broker's 1:4 geometry by chance, but whose items do not, is not taken for one (None: uploaded whole),
    unless the configured geometry says so."""
    from tierfs.store import indexfile as ix
    from tierfs.tier import indextail

    monkeypatch.setattr(indextail, "_BATCH", 333)  # items replayed in batches, as a full 20M-item file is
    buf = _index_file(tmp_path / "a", 700, 2800, 2000)
    fd = os.open(tmp_path / "a", os.O_RDWR)
    try:
        assert indextail.slot_count(fd, len(buf)) == (700, True)
        os.pwrite(fd, b"\xff" * 700 * 4, ix.HEADER_SIZE)  # a stale or absent table
        assert indextail.rebuild_slots(fd, 700) == 2000
        assert os.pread(fd, len(buf), 0) == bytes(buf)
        # a follower's refresh: new header and items over a table built from the first 2000; only those replayed
        buf = _index_file(tmp_path / "b", 700, 2800, 500, start=2000, buf=bytearray(buf))
        base = ix.HEADER_SIZE + 700 * ix.SLOT_SIZE
        os.pwrite(fd, buf[:ix.HEADER_SIZE], 0)
        os.pwrite(fd, buf[base + 2001 * ix.ITEM_SIZE:base + 2501 * ix.ITEM_SIZE], base + 2001 * ix.ITEM_SIZE)
        assert indextail.rebuild_slots(fd, 700, since=2001) == 500
        assert os.pread(fd, len(buf), 0) == bytes(buf)
    finally:
        os.close(fd)
    slots, items = 300, next(i for i in range(1000, 5000) if (4 * 300 + 20 * i) % 84 == 0 and i != 1200)
    buf = _index_file(tmp_path / "b", slots, items, 900)
    fd = os.open(tmp_path / "b", os.O_RDONLY)
    try:
        assert indextail.slot_count(fd, len(buf)) == (None, False)
        assert indextail.slot_count(fd, len(buf), (slots, items)) == (slots, True)  # broker.max_hash_slot_num...
    finally:
        os.close(fd)


def test_index_tail_uploads_header_and_items_only(tmp_path):
    """An active IndexFile goes up as its header and the items appended since the last round, never its hash-slot
    table (rewritten all over by every put); materialised from the append objects, the slots are rebuilt and every
    key resolves. Old code: the first round uploaded the whole slot table (and later rounds all dirty slot pages)."""
    import dataclasses
    import types

    from tierfs.store import indexfile as ix
    from tierfs.tier import appendlog

    hot, objects = tmp_path / "hot", tmp_path / "objects"
    (hot / "index").mkdir(parents=True)
    objects.mkdir()
    slots, items = 50_000, 200_000  # a 200 KB slot table: far apart from the header, as the broker's 20 MB one
    rel = "index/20261125210000000"
    buf = _index_file(hot / rel, slots, items, 1000)
    eng = types.SimpleNamespace(store=open_store(f"file://{objects}"), store_id="ix", hot=hot, entries={}, by_ino={},
                                config={"tiering.rpo_seconds": 5, "delete.grace_seconds": 0,
                                        "broker.max_hash_slot_num": 5_000_000, "broker.max_index_num": 20_000_000},
                                limiter=None, fence=lambda key: None, lease=None, snapshotter=None, chunk=16 << 20)
    eng.limiter = __import__("trio").CapacityLimiter(2)
    log = appendlog.AppendLog(eng)

    def one_round() -> int:
        import trio

        files = [(rel, os.stat(hot / rel))]
        before = log.put_bytes
        _, _, failed, err = trio.run(log._upload_tails, files)
        assert not failed and err is None
        return log.put_bytes - before

    first = one_round()
    assert first <= ix.HEADER_SIZE + 1001 * ix.ITEM_SIZE, first  # header + items 0..1000
    other = tmp_path / "other"  # a following reader: materialised from the first point, then refreshed
    (other / "index").mkdir(parents=True)
    with open(other / rel, "wb") as f:
        f.truncate(len(buf))
    row1 = log.snapshot_rows({rel: os.stat(hot / rel)})[rel]
    appendlog.materialise(eng.store, other, row1)
    # the broker's puts dirty the header, ~1000 slot pages and the new items; the daemon sees those writes
    buf = _index_file(hot / rel, slots, items, 1000, start=1000, buf=buf)
    ino, base = os.stat(hot / rel).st_ino, ix.HEADER_SIZE + slots * ix.SLOT_SIZE
    for off, n in ((0, 4096), (4096, slots * ix.SLOT_SIZE - 4096), (base + 1001 * ix.ITEM_SIZE, 1000 * ix.ITEM_SIZE)):
        log.note_write(ino, rel, off, n)
    second = one_round()
    assert 1000 * ix.ITEM_SIZE <= second <= ix.HEADER_SIZE + 1001 * ix.ITEM_SIZE, second  # (a torn last item)
    row = log.snapshot_rows({rel: os.stat(hot / rel)})[rel]
    assert row.slots == slots
    new = tuple(o for o in row.objects if o not in row1.objects)
    appendlog.materialise(eng.store, other, dataclasses.replace(row, objects=new))
    got = (other / rel).read_bytes()
    assert got == bytes(buf)
    for n in (0, 999, 1000, 1999):
        assert ix.lookup(got, f"TopicTest#key-{n}", 0, 1 << 62, 64, slots, items) == [n * 1000]


def test_round_walks_once_and_a_restart_resumes_from_the_catalog(tmp_path, monkeypatch):
    """In process, a real engine on a posix store: a continuous-tiering round walks the hot dir once (its
    snapshot reuses the walk); the upload offsets are in the catalog, so a restarted daemon uploads only what
    changed, not every active file again (an object whose bytes changed behind its back goes up again); the new
    snapshot still materialises the files byte for byte. Old code: two walks a round, and a restart re-uploaded
    every active file."""
    import trio

    from tierfs.config import Config
    from tierfs.tier import appendlog
    from tierfs.tier.engine import Engine

    objects = tmp_path / "objects"
    objects.mkdir()
    opts = f"objectstore.url=file://{objects},store.id=rs,tiering.rpo_seconds=5,delete.grace_seconds=0"
    files = {"timerlog/00000000000000000000": os.urandom(3 << 20),  # append-only (a CommitLog: whole records)
             "consumequeue/T/0/00000000000000000000": os.urandom(60_000),
             "checkpoint": os.urandom(4096)}

    def start():
        hot = tmp_path / "a-hot"
        (hot / ".tierfs").mkdir(parents=True, exist_ok=True)
        eng = Engine(hot, hot / ".tierfs", Config.load(None, [opts]))
        eng.reconcile()
        return eng

    eng = start()
    for rel, data in files.items():
        (eng.hot / rel).parent.mkdir(parents=True, exist_ok=True)
        (eng.hot / rel).write_bytes(data)
    walks = []
    real_scandir = os.scandir

    def counting(path=".", *a):
        if Path(path) == eng.hot:
            walks.append(path)
        return real_scandir(path, *a)

    monkeypatch.setattr(os, "scandir", counting)
    assert trio.run(eng.appendlog.round, False)
    assert len(walks) == 1, walks
    first = eng.appendlog.put_bytes
    assert first >= (3 << 20) + 60_000
    eng.catalog.close()

    eng = start()  # a restart (or a crash: the offsets were committed with the round)
    cl = eng.hot / "timerlog/00000000000000000000"
    with open(cl, "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(b"new records" * 100)  # appended past the committed offset
        f.seek(1 << 20)
        f.write(b"X" * 10)  # rewritten inside an uploaded object, while no daemon watched
    walks.clear()
    assert trio.run(eng.appendlog.round, False)
    assert len(walks) == 1, walks
    again = eng.appendlog.put_bytes  # the changed object and the appended bytes, no more: not the CQ file
    assert 1100 + 10 <= again <= (3 << 20) + 1100 < first, (again, first)
    cq = next(t for t in eng.appendlog.tails.values() if t.rel.startswith("consumequeue/"))
    assert all(eng.appendlog.incarnation not in o.key for o in cq.objects), cq.objects
    store = open_store(f"file://{objects}")
    ptr = snap.read_pointer(store, "rs")
    db = tmp_path / "snap.db"
    db.write_bytes(store.get(ptr.key))
    out = tmp_path / "out"
    for row in snap.load_tails(db, "rs", ".tierfs", set()):
        (out / row.path).parent.mkdir(parents=True, exist_ok=True)
        with open(out / row.path, "wb") as f:
            f.truncate(row.size)
        appendlog.materialise(store, out, row)
        assert (out / row.path).read_bytes() == (eng.hot / row.path).read_bytes(), row.path
    eng.catalog.close()


def test_seal_plan_lays_append_objects_in_upload_order():
    """A chunk is composed from the append objects that cover it, later ones winning where they overlap; a gap or
    a short range before the last means no plan (the chunk is put)."""
    from tierfs.tier.appendlog import TailObject
    from tierfs.tier.sealcopy import plan

    a, b, c = TailObject("a", 0, 100, 0), TailObject("b", 100, 100, 0), TailObject("c", 50, 20, 0)
    assert plan((a, b), 0, 200, 0) == [(a, 0, 100), (b, 0, 100)]
    assert plan((a, b, c), 0, 200, 0) == [(a, 0, 50), (c, 0, 20), (a, 70, 30), (b, 0, 100)]
    assert plan((a, b), 60, 150, 0) == [(a, 60, 40), (b, 0, 50)]
    assert plan((a, b), 0, 201, 0) is None  # beyond the last object
    assert plan((a, TailObject("d", 120, 80, 0)), 0, 200, 0) is None  # a gap
    assert plan((a, b, c), 0, 200, 40) is None  # c's 20 bytes before the last range
    assert plan((a, b), 0, 200, 100) == [(a, 0, 100), (b, 0, 100)]


def test_bytes_past_a_page_not_written_back_wait_a_round(tmp_path):
    """In process: after a round's flush, a hole amid the new bytes of an append-only segment is a page the kernel
    has not written back yet; the bytes past it wait for the next round instead of going up as torn records. A
    hole still there a round later was never written: then they go. Old code: uploaded past the hole at once."""
    import trio

    from tierfs.config import Config
    from tierfs.tier.engine import Engine

    objects = tmp_path / "objects"
    objects.mkdir()
    hot = tmp_path / "hot"
    (hot / ".tierfs").mkdir(parents=True)
    (hot / "consumequeue/T/0").mkdir(parents=True)
    eng = Engine(hot, hot / ".tierfs", Config.load(None, [f"objectstore.url=file://{objects},store.id=h"]))
    eng.reconcile()
    rel = "consumequeue/T/0/00000000000000000000"  # (a CommitLog goes up in whole records only)
    with open(hot / rel, "wb") as f:
        f.truncate(1 << 20)
    fd = os.open(hot / rel, os.O_WRONLY)
    os.pwrite(fd, b"a" * 8192, 0)
    os.pwrite(fd, b"c" * 4096, 12288)  # [8192, 12288): a hole
    if os.lseek(fd, 0, os.SEEK_HOLE) != 8192:
        pytest.skip("the file system of the temp dir does not keep holes")
    log = eng.appendlog
    log._defer_holes = True

    def upload() -> int:
        before = log.put_bytes
        trio.run(log._upload_tails, [(rel, os.stat(hot / rel))])
        return log.put_bytes - before

    try:
        assert upload() == 8192  # up to the hole
        os.pwrite(fd, b"b" * 4096, 8192)  # written back now
        assert upload() == 8192  # the page and what waited behind it
        os.pwrite(fd, b"e" * 4096, 20480)  # a new hole at [16384, 20480)
        assert upload() == 0
        assert upload() == 8192  # still there a round later: never written, so the bytes past it go
        t = next(iter(log.tails.values()))
        assert t.committed == 24576
    finally:
        os.close(fd)
        eng.catalog.close()
