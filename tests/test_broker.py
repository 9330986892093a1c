"""A real Apache RocketMQ broker (4.9.7 and 5.5.0, from Maven Central) with its store on a tierfs mount.

One name server, one broker and one mount per version (module-scoped, the tests below run in order on it):
the broker takes 200,000 messages over 4 topics x 4 queues with small segments (CommitLog 4 MiB, ConsumeQueue
6,000 units, IndexFile 20,000 entries), tierfs keeps an 8 MiB local budget for tiered bytes, so most CommitLog,
ConsumeQueue and IndexFile segments are evicted before anything reads them. The Java client
(tests/broker/BrokerClient.java) checks every body and property a consumer gets against what was sent.

The broker runs with flushDiskType=SYNC_FLUSH: that is what makes "acknowledged" mean "on the hot disk", which
scenario 3 checks. (Sealing no longer depends on it: the daemon flushes quiet segments itself, issue 10 finding
3, tested with a writer that never fsyncs in test_engine_core.py.)
The hot dir is a tmpfs of its own (as on a broker host whose store disk is dedicated), so the disk ratio the
broker reads through statfs is the store's alone; the object store (posix) is on the ordinary disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

import brokerutil as B
from mountutil import Mount, files_under, pid_alive, requires_fuse, run, wait_for

pytestmark = requires_fuse

TOPICS = "TA,TB,TC,TD"
QUEUES = 4
N = 200_000
BODY = 100
CACHE_BYTES = 8 << 20
# cache.low_watermark 0.2: an eviction pass goes down to a fifth of the budget, so most ConsumeQueue files are
# evicted too; with the default (0.75) a pass stops as soon as some 4 MiB CommitLog blocks went, and whether half
# of the small ConsumeQueue files were evicted as well depended on their LRU order (15 of 32 once in CI)
TIER_OPTS = (f"tiering.enabled=true,cache.max_bytes={CACHE_BYTES},cache.low_watermark=0.2,"
             "cache.block_bytes=256KiB,objectstore.chunk_bytes=1MiB,seal.quiet_seconds=0.5,"
             f"seal.scan_interval_seconds=0.5,broker.max_hash_slot_num={B.HASH_SLOTS},"
             f"broker.max_index_num={B.INDEX_NUM},delete.grace_seconds=2,"
             "compaction.enabled=false,snapshot.interval_seconds=3")
KINDS = ("commitlog", "consumequeue", "index")
SIDE_TOPICS = ("TK", "TR", "TF", "TT")  # daemon kill, recreated topic, filler, timer messages (2 queues each)


class Env:
    """One version's name server + broker on a tierfs mount, and what the producer got acknowledged."""

    def __init__(self, version: str, base: Path):
        self.version, self.base = version, base
        self.hot, self.mnt, self.objects = base / "hot", base / "mnt", base / "objects"
        for d in (self.hot, self.mnt, self.objects):
            d.mkdir()
        run(["mount", "-t", "tmpfs", "-o", "size=1g,mode=0755", "tierfs-broker-hot", self.hot], check=True)
        self.mount = Mount(self.hot, self.mnt, options=(TIER_OPTS, f"objectstore.url=file://{self.objects}"))
        self.rmq: B.RocketMQ | None = None
        self.acked = base / "acked-main"

    def conf(self, **overrides: object) -> dict[str, str]:
        assert self.rmq is not None
        return self.rmq.broker_conf(self.mnt, **overrides)

    def client(self, *args: object, timeout: float = 300) -> dict:
        assert self.rmq is not None
        return self.rmq.client(*args, timeout=timeout)

    def consume(self, group: str, topics: str = TOPICS, queues: int = QUEUES, start: int = 0, count: int = N,
                acked: Path | str = "-", wait: float = 0) -> dict:
        assert self.rmq is not None
        return self.client("consume", self.rmq.ns_addr, B.BROKER_NAME, topics, queues, start, count, BODY, group,
                           acked, wait)

    def produce(self, topics: str, queues: int, start: int, count: int, acked: Path, threads: int = 64,
                deliver_at: int = 0) -> dict:
        assert self.rmq is not None
        extra = [deliver_at] if deliver_at else []
        return self.client("produce", self.rmq.ns_addr, B.BROKER_NAME, topics, queues, start, count, BODY,
                           threads, acked, *extra)

    def status(self) -> dict:
        return json.loads((self.mnt / ".tierfs" / "status.json").read_text())

    def close(self) -> None:
        try:
            if self.rmq is not None:
                self.rmq.close()
        finally:
            try:
                self.mount.cleanup()
            finally:
                self.unmount_disks()

    def unmount_disks(self) -> None:
        """The file systems made for this Env, after its mount is gone."""
        run(["umount", self.hot], timeout=60)


def segment_counts(st: dict) -> dict[str, tuple[int, int]]:
    """kind -> (tiered files, tiered files with fewer resident bytes than their size)."""
    out = {}
    for kind in KINDS:
        tiered = [f for f in st["files"] if f["kind"] == kind and f["state"] == "tiered"]
        out[kind] = (len(tiered), sum(f["resident_bytes"] < f["size"] for f in tiered))
    return out


def wait_mostly_evicted(env: Env, kinds: tuple[str, ...] = KINDS, timeout: float = 120) -> dict[str, tuple[int, int]]:
    """Each of `kinds` has tiered segments, at least half of them evicted, and the upload backlog is empty."""
    def ok(seen: dict) -> bool:
        return all(seen[k][0] > 0 and seen[k][1] * 2 >= seen[k][0] for k in kinds)

    return wait_evicted(env, segment_counts, ok, f"most {'/'.join(kinds)} segments tiered and evicted", timeout)


def wait_evicted(env, counts: Callable[[dict], dict], ok: Callable[[dict], bool], what: str,
                 timeout: float) -> dict:
    """Wait until `ok(counts(status))` with an empty upload backlog. Segments uploaded after the last eviction
    pass stay resident while the cache is under its high watermark (15 of 32 ConsumeQueue files evicted, twice in
    CI): once the backlog is empty, `tierfs evict` makes a pass, as an operator would. `env` has status(), mount
    and mnt (an Env, or the broker group's)."""
    seen: dict = {}
    pressed = [0.0]

    def done() -> bool:
        st = env.status()
        seen.update(counts(st), backlog=st["totals"]["upload_backlog_files"])
        good = seen["backlog"] == 0 and ok(seen)
        if not good and seen["backlog"] == 0 and time.monotonic() - pressed[0] > 5:
            r = env.mount.cli("evict", env.mnt)
            assert r.returncode == 0, r.stderr
            pressed[0] = time.monotonic()
        return good

    try:
        wait_for(done, timeout, 0.5, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; (tiered, evicted) and upload backlog: {seen}") from None
    return dict(seen)


def assert_all_read(res: dict, expected: int, torn_unacked_ok: bool = False) -> None:
    """Every acknowledged message read back, none differing. `torn_unacked_ok` where writes died with the
    store under the broker: a message never acknowledged may come back torn (its head's pages written back, its
    tail's not), and the broker's recovery keeps it because its CRC covers only the body, as after a power loss
    on a local disk. Such messages are printed; any differing message that was acknowledged fails."""
    if torn_unacked_ok:
        assert res["bad_acked"] == 0, f"acknowledged messages differing from what was sent: {res['first_bad']}"
        if res["bad"]:
            print(f"\n{res['bad']} never-acknowledged messages came back torn: seq {res['bad_seqs']}, "
                  f"{res['first_bad']}")
    else:
        assert res["bad"] == 0, f"messages differing from what was sent: {res['first_bad']}"
    assert res.get("missing", 0) == 0, f"{res['missing']} acknowledged messages not read: {res['first_missing']}"
    assert res["distinct"] >= expected, res


def timed(report: dict, name: str):
    """Context manager adding the seconds a step took to `report` (printed at module teardown)."""
    class _T:
        def __enter__(self):
            self.t = time.monotonic()

        def __exit__(self, *exc):
            report[name] = round(time.monotonic() - self.t, 1)
    return _T()


REPORT: dict[str, dict] = {}


@pytest.fixture(scope="module", params=B.VERSIONS)
def env(request, tmp_path_factory):
    version = request.param
    report = REPORT.setdefault(version, {})
    e = Env(version, tmp_path_factory.mktemp(f"broker-{version}"))
    try:
        with timed(report, "start"):
            e.mount.mount()
            e.rmq = B.RocketMQ(version, e.base / "home")
            e.rmq.start_namesrv()
            e.rmq.start_broker(e.conf())
            e.client("topics", e.rmq.ns_addr, e.rmq.broker_addr, QUEUES, *TOPICS.split(","),
                     *(f"{t}:2" for t in SIDE_TOPICS))
        with timed(report, "produce 200k"):
            res = e.produce(TOPICS, QUEUES, 0, N, e.acked)
        report["produce msgs/s"] = round(N / res["secs"])
        assert res["acked"] == N and res["errors"] == 0, res
        yield e
    finally:
        e.close()
        print(f"\nbroker {version} step seconds: {report}")


def test_consume_and_query_evicted(env: Env):
    """Scenario 1: a new consumer group reads all 200,000 messages from offset 0 out of evicted segments, and
    key queries find their messages through evicted IndexFiles."""
    report = REPORT[env.version]
    with timed(report, "wait evicted"):
        counts = wait_mostly_evicted(env)
    assert counts["commitlog"][0] >= 8 and counts["index"][0] >= 8, counts
    with timed(report, "consume 200k"):
        res = env.consume("g-first", acked=env.acked)
    assert_all_read(res, N)
    assert res["read"] == N and res["dups"] == 0, res
    report["consume msgs/s"] = round(N / res["secs"])
    wait_mostly_evicted(env)
    with timed(report, "key queries"):
        q = env.client("query", env.rmq.ns_addr, TOPICS, 0, N, BODY, 40)
    assert q["found"] == 40, q


def test_restart_graceful_then_kill9(env: Env):
    """Scenario 2: the broker restarts gracefully, then is killed -9 and recovers, on a store whose old segments
    are evicted; it takes new messages, and a new group again reads everything acknowledged."""
    report = REPORT[env.version]
    rmq = env.rmq
    with timed(report, "graceful restart"):
        rmq.stop_broker(signal.SIGTERM)
        wait_mostly_evicted(env)
        rmq.start_broker(env.conf())
    q = env.client("query", rmq.ns_addr, TOPICS, 0, N, BODY, 8)
    assert q["found"] == 8, q
    with timed(report, "kill -9 restart"):
        assert rmq.stop_broker(signal.SIGKILL) == -signal.SIGKILL
        # the CommitLog, which recovery reads: the broker start and key queries just above may have made the
        # small ConsumeQueue/IndexFiles resident again, and under the 8 MiB budget nothing pushes them out
        wait_mostly_evicted(env, ("commitlog",))
        rmq.start_broker(env.conf())
    more = env.base / "acked-more"
    res = env.produce(TOPICS, QUEUES, N, 8_000, more)
    assert res["acked"] == 8_000, res
    merged = env.base / "acked-merged"  # the BitSet of 0..N plus the new range, as the consumer expects
    merged.write_bytes(_merge_bits(env.acked.read_bytes(), 0, more.read_bytes(), N))
    with timed(report, "consume after kill -9"):
        res = env.consume("g-after-kill", count=N + 8_000, acked=merged)
    assert_all_read(res, N + 8_000)


def _merge_bits(a: bytes, a_start: int, b: bytes, b_start: int) -> bytes:
    """Two java.util.BitSet byte arrays (little-endian) over ranges starting at a_start/b_start, as one from 0."""
    v = (int.from_bytes(a, "little") << a_start) | (int.from_bytes(b, "little") << b_start)
    return v.to_bytes((v.bit_length() + 7) // 8, "little")


def test_kill_tierfs_daemon_under_broker(env: Env):
    """Scenario 3: kill -9 of the tierfs daemon while the broker takes SYNC_FLUSH writes. After a remount and a
    broker restart, every message acknowledged before the daemon died is read back.

    What the broker sees (asserted): page faults on its mmap'd CommitLog raise java.lang.InternalError ("a fault
    occurred in a recent unsafe memory access"), which fails those sends, and msync(MS_SYNC) fails with
    ECONNABORTED/ENOTCONN. The broker stays up, and RocketMQ's MappedFile.flush() logs that msync error and
    carries on as if flushed, so under SYNC_FLUSH it still acknowledges messages written to pages that were
    already mapped: those acknowledgements, after the daemon's death, are not durable (counted and printed)."""
    report = REPORT[env.version]
    rmq = env.rmq
    acked = env.base / "acked-tk"
    count = 60_000
    result: dict = {}

    def producer() -> None:
        try:
            result["res"] = env.produce("TK", 2, 0, count, acked, threads=16)
        except Exception as e:  # noqa: BLE001 - reported below
            result["err"] = e

    t = threading.Thread(target=producer)
    t.start()
    cq = [env.hot / "consumequeue" / "TK" / str(q) / ("0" * 20) for q in range(2)]
    wait_for(lambda: any(_cq_units_written(p) for p in cq), 120, 0.1,
             what="the broker writing 2,000 messages of topic TK")
    daemon = env.mount.pid
    with timed(report, "daemon killed: producer ends"):
        killed_ms = int(time.time() * 1000)
        os.kill(daemon, signal.SIGKILL)
        wait_for(lambda: not pid_alive(daemon), 30, what="tierfs daemon exit")
        t.join(240)
    assert not t.is_alive(), "the producer did not end after the daemon died"
    res = result.get("res")
    assert res is not None, f"producer failed: {result.get('err')}"
    assert 0 < res["acked"] < count and res["errors"] > 0, res
    assert rmq.broker.proc.poll() is None, "the broker died with the tierfs daemon"
    wait_for(lambda: "msync with parameter MS_SYNC failed" in rmq.broker_log(), 30, 0.5,
             what="the broker logging its failed msync")
    durable = env.base / "acked-tk-before-kill"
    n_before = B.acked_before(acked, count, killed_ms, durable)
    with timed(report, "remount + broker restart"):
        rmq.stop_broker(signal.SIGKILL)
        env.mount.kill()  # clears the dead FUSE connection (fusermount3 -uz)
        env.mount.mount()
        rmq.start_broker(env.conf())
    res2 = env.consume("g-after-daemon-kill", topics="TK", queues=2, count=count, acked=durable)
    assert_all_read(res2, n_before, torn_unacked_ok=True)
    after = res["acked"] - n_before
    lost_after = res["acked"] - res2["distinct"]
    print(f"\nbroker {env.version}, tierfs daemon killed: {n_before} sends acknowledged before (all read "
          f"back), {after} after ({max(lost_after, 0)} of all acknowledged not durable); send errors: "
          f"{res['first_errors'][:1]}")


def _cq_units_written(path: Path) -> int:
    """Whether unit 2,000 of a ConsumeQueue file in the hot dir is written: 2,000, else 0."""
    try:
        with open(path, "rb") as f:
            f.seek(2_000 * 20)
            return 2_000 if f.read(20).strip(b"\0") else 0
    except OSError:
        return 0


def test_topic_deleted_and_recreated(env: Env):
    """Scenario 5: a topic deleted and created again while its old ConsumeQueue segments are tiered: after
    eviction, the new messages (and only they) are read back."""
    rmq = env.rmq
    per = 13_000  # 2 queues x 6,500 units: one full 6,000-unit ConsumeQueue file per queue
    res = env.produce("TR", 2, 0, per, env.base / "acked-tr-old")
    assert res["acked"] == per, res

    def tr_tiered() -> list[dict]:
        return [f for f in env.status()["files"]
                if f["path"].startswith("consumequeue/TR/") and f["state"] == "tiered"]

    wait_for(lambda: len(tr_tiered()) >= 2, 60, 0.5, what="TR's first ConsumeQueue files tiered")
    rmq.client("deltopic", rmq.ns_addr, rmq.broker_addr, "TR", 2)  # deleted, then created again
    new = env.base / "acked-tr-new"
    res = env.produce("TR", 2, 1_000_000, per, new)
    assert res["acked"] == per, res
    wait_for(lambda: len(tr_tiered()) >= 2, 60, 0.5, what="TR's new ConsumeQueue files tiered")
    # filler (about 8 MiB of CommitLog): pushes TR's files out of the 8 MiB cache
    assert env.produce("TF", 2, 0, 32_000, env.base / "acked-tf")["acked"] == 32_000
    wait_for(lambda: all(f["resident_bytes"] < f["size"] for f in tr_tiered()), 60, 0.5,
             what="TR's new ConsumeQueue files evicted")
    got = env.consume("g-tr", topics="TR", queues=2, start=1_000_000, count=per, acked=new)
    assert_all_read(got, per)
    assert got["read"] == per, got


def test_timer_messages_after_timerlog_tiered(env: Env):
    """Scenario 6 (5.x), timers: scheduled messages due after their TimerLog segments were tiered arrive on time."""
    if env.version.startswith("4."):
        pytest.skip("4.9 has no timer message store (TimerLog); covered for 5.x")
    rmq = env.rmq
    count = 12_000  # TimerLog units are 52 bytes, 5,000 per segment: two full segments tiered
    due = int(time.time() * 1000) + 20_000
    acked = env.base / "acked-tt"
    res = env.produce("TT", 2, 0, count, acked, deliver_at=due)
    assert res["acked"] == count, res

    def timerlog_tiered() -> int:
        return sum(1 for f in env.status()["files"] if f["kind"] == "timerlog" and f["state"] == "tiered")

    wait_for(lambda: timerlog_tiered() >= 2, 40, 0.5, what="two TimerLog segments tiered")
    assert time.time() * 1000 < due, "TimerLog segments were tiered only after the messages were due"
    got = env.consume("g-tt", topics="TT", queues=2, count=count, acked=acked, wait=90)
    assert_all_read(got, count)
    # delivered on time: stored again at their due time (timer precision 1 s), not before
    assert got["late_ms_min"] >= -1000 and got["late_ms_max"] <= 10_000, got


def test_rocksdb_metadata_store(env: Env):
    """Scenario 6 (5.x), the RocksDB-backed store option: `storeType=defaultRocksDB` keeps topic configs, consumer
    offsets, subscription groups and the ConsumeQueues in RocksDB databases under the store root. On a second
    store on the same mount, the broker creates them, survives a graceful restart and a kill -9 (RocksDB's WAL
    recovery, its LOCK file and directory fsyncs all go through tierfs), still knows its topics afterwards
    (autoCreateTopicEnable is off: a lost topic config refuses the next send), and serves every message."""
    if env.version.startswith("4."):
        pytest.skip("4.9 has no RocksDB store option; covered for 5.x")
    rmq = env.rmq
    store = env.mnt / "rocksdb-store"
    conf = env.conf(storePathRootDir=store, storePathCommitLog=store / "commitlog", storeType="defaultRocksDB")
    rmq.stop_broker(signal.SIGTERM)
    try:
        rmq.start_broker(conf)
        env.client("topics", rmq.ns_addr, rmq.broker_addr, 2, "RK")
        first, second = env.base / "acked-rk1", env.base / "acked-rk2"
        res = env.produce("RK", 2, 0, 20_000, first)
        assert res["acked"] == 20_000 and res["errors"] == 0, res
        dbs = sorted({p.parent.relative_to(store).as_posix() for p in store.rglob("CURRENT")})
        assert dbs, f"no RocksDB database under {store}: {sorted(p.name for p in store.iterdir())}"
        rmq.stop_broker(signal.SIGTERM)
        rmq.start_broker(conf)
        assert rmq.stop_broker(signal.SIGKILL) == -signal.SIGKILL
        rmq.start_broker(conf)
        res = env.produce("RK", 2, 20_000, 2_000, second)
        assert res["acked"] == 2_000 and res["errors"] == 0, f"topic RK after the restarts: {res}"
        merged = env.base / "acked-rk"
        merged.write_bytes(_merge_bits(first.read_bytes(), 0, second.read_bytes(), 20_000))
        got = env.consume("g-rk", topics="RK", queues=2, count=22_000, acked=merged)
        assert_all_read(got, 22_000)
        print(f"\nRocksDB databases on the mount: {dbs}")
    finally:
        rmq.stop_broker(signal.SIGKILL)
        shutil.rmtree(store, ignore_errors=True)  # through the mount: its tiered segments' rows and objects go
        rmq.start_broker(env.conf())  # the main store again, for the tests after this one


def test_retention_through_the_mount(env: Env):
    """Scenario 4 (last: it deletes the store), one broker start (its cleaning task first runs 60 s after start).
    (a) With statfs.capacity_bytes set so that the store fills 92% of it, the broker deletes its oldest
    segments regardless of age (above 85%), through the mount, until the ratio is back under 85%. (Not 88%:
    once, with segments reserved on truncate, a 4.9.7 broker's start took the ratio under 85% by itself, with
    no segment deleted; a file it drops gives back its whole reserved size.)
    (b) Then, set at run time, fileReservedTime=0 and deleteWhen=now (disk ratio limit 95%): it deletes every
    CommitLog segment but the last. The objects of deleted segments go after delete.grace_seconds, once no kept
    catalog snapshot names them (a read-only mount may be serving one): newer snapshots roll the old ones out."""
    report = REPORT[env.version]
    rmq, m = env.rmq, env.mount
    rmq.stop_broker(signal.SIGKILL)  # graceful stops are covered above; a 5.x one takes 10+ s
    base_options = m.options
    last: list[int] = []

    def settled() -> bool:
        """Nothing left to tier and the hot dir's use unchanged over the last poll: a segment the broker left
        half written is tiered and evicted after it goes quiet, its reserved tail (mount.reserve_on_truncate)
        freed with it, so the used bytes fall for a while after the kill."""
        st = env.status()
        last.append(st["hot_dir_bytes_used"])
        return st["totals"]["upload_backlog_files"] == 0 and len(last) > 1 and last[-1] == last[-2]

    wait_for(settled, 120, 2, what="the hot dir's use settled after the broker's kill")
    for _ in range(3):  # a remount itself can change the used bytes a little (its state dir): measure again
        st = env.status()
        used = st["hot_dir_bytes_used"] + _remote_bytes(st)
        capacity = int(used / 0.92)
        m.umount()
        m.options = (*base_options, f"statfs.capacity_bytes={capacity}")
        m.mount()
        if 0.905 < _ratio(env.mnt) < 0.94:
            break
    store_id = env.status()["store_id"]
    before = sorted(p.name for p in (env.mnt / "commitlog").iterdir())
    tiered_before = {f["path"].rsplit("/", 1)[1] for f in env.status()["files"]
                     if f["kind"] == "commitlog" and f["state"] == "tiered"}
    ratio = _ratio(env.mnt)
    assert 0.905 < ratio < 0.94, f"statfs ratio {ratio:.3f}, wanted ~0.92 (capacity {capacity}, used {used})"
    far_hour = f"{(time.gmtime().tm_hour + 12) % 24:02d}"
    with timed(report, "retention by disk ratio"):
        rmq.start_broker(env.conf(deleteWhen=far_hour, diskMaxUsedSpaceRatio=75))
        def cleaned() -> bool:
            left = {p.name for p in (env.mnt / "commitlog").iterdir()}
            return _ratio(env.mnt) <= 0.85 and before[0] not in left

        wait_for(cleaned, 150, 0.5, what=f"the broker deleting segments until the ratio is under 85% (now "
                                          f"{_ratio(env.mnt):.3f})")
    after = sorted(p.name for p in (env.mnt / "commitlog").iterdir())
    # the oldest segments went; (at its start the broker may also drop an unused last file, or roll a new one)
    gone = [n for n in before if n not in after and n < after[-1]]
    assert gone and gone == before[:len(gone)], (before, after)
    assert set(gone) & tiered_before, "no tiered segment was deleted"

    now = time.gmtime().tm_hour
    with timed(report, "retention by time"):
        rmq.client("config", rmq.ns_addr, rmq.broker_addr, "fileReservedTime=0", "diskMaxUsedSpaceRatio=95",
                   f"deleteWhen={now:02d};{(now + 1) % 24:02d}")
        wait_for(lambda: len(list((env.mnt / "commitlog").iterdir())) == 1, 360, 0.5,
                 what="the broker deleting all CommitLog segments but the last")
        last = next((env.mnt / "commitlog").iterdir()).name
        seg_objects = env.objects / store_id / "seg" / "commitlog"
        wait_for(lambda: not [p for p in files_under(seg_objects) if last not in p.parts], 240, 0.5,
                 what="objects of deleted CommitLog segments removed after the grace period")
    listed = [f["path"] for f in env.status()["files"] if f["kind"] == "commitlog"]
    assert all(p.endswith(last) for p in listed), listed


def _remote_bytes(st: dict) -> int:
    return sum(f["size"] - f["resident_bytes"] for f in st["files"] if f["state"] == "tiered")


def _ratio(mnt: Path) -> float:
    """The broker's disk ratio, used / (used + available), from statfs of the mount."""
    sv = os.statvfs(mnt)
    used = sv.f_blocks - sv.f_bfree
    return used / (used + sv.f_bavail) if used + sv.f_bavail else 1.0
