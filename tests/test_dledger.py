"""A broker with a DLedger CommitLog (`enableDLegerCommitLog=true`, Apache RocketMQ 4.9.7 from Maven Central).

The codec (tierfs.store.dledger) is checked against the files a real broker wrote on a plain directory: every
entry, blank and index unit, and every message body by content. Then the broker runs on a tierfs mount: its
sealed DLedger data files are tiered, evicted, and every acknowledged message is read back from them by content.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import threading
import time
from pathlib import Path

import pytest

import brokerutil as B
from mountutil import evict, requires_fuse, wait_for
from test_broker import BODY, Env, assert_all_read
from test_tiering import copy_in
from tierfs.spark import walk
from tierfs.store import commitlog, dledger
from tierfs.store.paths import Kind, classify, split_root
from tierfs.store.seal import is_sealed
from tierfs.tier import storeroots

VERSION = "4.9.7"
TOPICS = "TA,TB"
QUEUES = 2
CODEC_N = 20_000
SEG = 1 << 20  # mappedFileSizeCommitLog: DLedger's data file size
CQ_UNITS = 1000  # ConsumeQueue files of the codec store: 5 per queue, 4 of them full (sealed)


def dledger_conf(rmq: B.RocketMQ, store: Path, self_id: str = "n0", peers: str = "", **more: object) -> dict:
    """broker.conf of a DLedger group member: the data files are `mappedFileSizeCommitLog` bytes."""
    if not peers:
        peers = f"{self_id}-127.0.0.1:{dledger_port([rmq])}"
    return rmq.broker_conf(store, enableDLegerCommitLog="true", dLegerGroup=B.BROKER_NAME, dLegerPeers=peers,
                           dLegerSelfId=self_id, mappedFileSizeCommitLog=SEG, **more)


def dledger_port(rmqs: list[B.RocketMQ], taken: tuple[int, ...] = ()) -> int:
    """A free port for a DLedger member, none of the brokers' ports (a 4.9 broker also binds listenPort - 2)."""
    busy = set(taken)
    for r in rmqs:
        busy |= {r.ns_port, r.port, r.port - 2, r.ha_port}
    while True:
        port = B.free_ports(1)[0]
        if not busy & {port, port - 2}:
            return port


def body_of(seq: int, size: int = BODY) -> bytes:
    return B.body(seq, size)


@pytest.fixture(scope="module", params=B.VERSIONS)
def written(request, tmp_path_factory) -> Path:
    """A DLedger store a real broker of each version wrote (20,000 messages, 1 MiB data files) and stopped
    gracefully (their DLedger libraries, 0.3.1.2 and 0.3.2, share one format)."""
    base = tmp_path_factory.mktemp(f"dledger-codec-{request.param}")
    rmq = B.RocketMQ(request.param, base / "home")
    try:
        rmq.start_namesrv()
        rmq.start_broker(dledger_conf(rmq, base / "store", mappedFileSizeConsumeQueue=20 * CQ_UNITS))
        rmq.client("topics", rmq.ns_addr, rmq.broker_addr, QUEUES, *TOPICS.split(","))
        res = rmq.client("produce", rmq.ns_addr, B.BROKER_NAME, TOPICS, QUEUES, 0, CODEC_N, BODY, 16,
                         base / "acked")
        assert res["acked"] == CODEC_N, res
        rmq.stop_broker()  # graceful: its shutdown flushes and writes the checkpoint
    finally:
        rmq.close()
    yield base / "store"
    shutil.rmtree(base, ignore_errors=True)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.isdigit())


def test_layout_of_a_real_store(written: Path):
    """The tree: dledger-n0/{data,index}/<20-digit offsets>, checkpoint and currterm beside them, no commitlog/."""
    ledger = written / "dledger-n0"
    data, index = _files(ledger / "data"), _files(ledger / "index")
    assert len(data) >= 5 and len(index) == 1
    assert all(p.stat().st_size == SEG and int(p.name) == i * SEG for i, p in enumerate(data))
    assert index[0].stat().st_size == dledger.INDEX_FILE_SIZE
    assert not (written / "commitlog").exists() or not any((written / "commitlog").iterdir())
    assert "committedIndex=" in (ledger / "checkpoint").read_text()
    for p in data:
        assert classify(str(p.relative_to(written))) is Kind.DLEDGER_DATA
        assert split_root(f"n0/{p.relative_to(written)}") == ("n0", str(p.relative_to(written)))
    assert classify(str(index[0].relative_to(written))) is Kind.DLEDGER_INDEX
    for name in ("checkpoint", "checkpoint.bak", "currterm"):
        assert classify(f"dledger-n0/{name}") is Kind.MUTABLE


def test_store_roots_of_dledger_members(tmp_path: Path):
    """Members' store roots below one mount are found by their dledger-<id>/ dirs (a member that wrote no
    ConsumeQueue yet has nothing else), and the sealer walks their data and index dirs."""
    for i in range(3):
        for d in ("data", "index"):
            (tmp_path / f"n{i}" / f"dledger-n{i}" / d).mkdir(parents=True)
    (tmp_path / "n2" / "consumequeue").mkdir()
    assert storeroots.find_roots(str(tmp_path)) == ["n0", "n1", "n2"]
    dirs = storeroots.segment_dirs(str(tmp_path))
    assert {f"n{i}/dledger-n{i}/{d}" for i in range(3) for d in ("data", "index")} <= set(dirs)
    assert "n2/consumequeue" in dirs and not any(d.startswith("n0/n") for d in dirs)
    assert classify("n1/dledger-n1/data/" + "0" * 20) is Kind.DLEDGER_DATA
    assert classify("dledger-n0/dledger-n1/data/" + "0" * 20) is Kind.MUTABLE  # no store root named dledger-*
    assert classify("dledger-n0/data/" + "0" * 19) is Kind.MUTABLE


def test_entries_blanks_and_bodies(written: Path):
    """Every entry of every data file: consecutive Raft indexes from 0, pos = its global offset, a body that is
    one whole RocketMQ record (crc checked) at PHYSICALOFFSET pos + 48 carrying the body that was sent; each
    full file ends in a blank (magic -1, the remaining length, zeros), the last one does not."""
    data = _files(written / "dledger-n0" / "data")
    want_index = 0
    seqs = set()
    entries: dict[int, dledger.Entry] = {}
    for i, p in enumerate(data):
        buf = p.read_bytes()
        start = int(p.name)
        end = dledger.sealed_data_end(buf, len(buf), file_start=start)
        if i < len(data) - 1:
            assert end is not None and end > SEG - 1024, p
            assert struct.unpack_from(">ii", buf, end) == (dledger.BLANK_MAGIC, SEG - end)
            assert not buf[end + 8:].strip(b"\0")
            assert is_sealed(Kind.DLEDGER_DATA, buf, len(buf)) == (True, f"blank at {end}")
            assert dledger.sealed_data_end(buf, len(buf), file_start=start + SEG) is None
        else:
            assert end is None
            assert is_sealed(Kind.DLEDGER_DATA, buf, len(buf)) == (False, "no valid terminal blank")
        for pos, e in dledger.iter_entries(buf):
            assert (e.magic, e.index, e.pos, e.term) == (dledger.MAGIC, want_index, start + pos, 0)
            assert (e.channel, e.chain_crc, e.body_crc, e.body_len) == (0, 0, 0, e.size - dledger.BODY_OFFSET)
            msg = commitlog.decode_record(buf, pos + dledger.BODY_OFFSET, check_crc=True)
            assert isinstance(msg, commitlog.Message) and msg.total_size == e.body_len
            assert msg.physical_offset == e.pos + dledger.BODY_OFFSET
            seq = int(msg.body[1:13])
            assert msg.body == body_of(seq)
            seqs.add(seq)
            entries[e.index] = e
            want_index += 1
    assert want_index == len(seqs) == CODEC_N


def test_index_units_and_consumequeue(written: Path):
    """Index unit i is (1, pos, size, i, term) of data entry i; a ConsumeQueue unit names an entry's body."""
    ledger = written / "dledger-n0"
    index = (ledger / "index" / ("0" * 20)).read_bytes()
    data = b"".join(p.read_bytes() for p in _files(ledger / "data"))
    for i in range(CODEC_N):
        u = dledger.decode_index_unit(index, i * dledger.INDEX_UNIT_SIZE)
        assert u is not None and u.index == i and u.magic == dledger.MAGIC
        e = dledger.decode_entry(data, u.pos)
        assert e is not None and (e.index, e.size, e.term) == (i, u.size, u.term)
    assert dledger.decode_index_unit(index, CODEC_N * dledger.INDEX_UNIT_SIZE) is None
    assert is_sealed(Kind.DLEDGER_INDEX, index, len(index)) == (False, "last unit not written")
    cq = b"".join(p.read_bytes() for p in _files(written / "consumequeue" / "TA" / "0"))
    units = [u for u in struct.iter_unpack(">qiq", cq) if u[1] > 0]
    assert len(units) == CODEC_N // 4
    for phys, size, _ in units:
        e = dledger.decode_entry(data, phys - dledger.BODY_OFFSET)
        assert e is not None and e.pos + dledger.BODY_OFFSET == phys and e.body_len == size


def test_index_seal_rule_on_real_units(written: Path):
    """A full index file (here 1,000 real units) seals; one whose last unit is missing or from another log
    does not."""
    index = (written / "dledger-n0" / "index" / ("0" * 20)).read_bytes()
    full = index[:1000 * dledger.INDEX_UNIT_SIZE]
    assert dledger.index_sealed(full, len(full)) == (True, "index full")
    assert is_sealed(Kind.DLEDGER_INDEX, full, len(full))[0]
    torn = full[:-dledger.INDEX_UNIT_SIZE] + bytes(dledger.INDEX_UNIT_SIZE)
    assert dledger.index_sealed(torn, len(torn)) == (False, "last unit not written")
    skewed = full[:-dledger.INDEX_UNIT_SIZE] + index[2000 * 32:2001 * 32]
    ok, why = dledger.index_sealed(skewed, len(skewed))
    assert not ok and why.startswith("corrupt"), why
    assert not dledger.index_sealed(full[:-1], len(full) - 1)[0]


def test_data_seal_rule_refuses_damage(written: Path):
    """A full data file with any header or body field out of place, or a short blank, does not seal."""
    buf = bytearray((written / "dledger-n0" / "data" / ("0" * 20)).read_bytes())
    end = dledger.sealed_data_end(buf, len(buf))
    assert end is not None
    entries = list(dledger.iter_entries(buf))
    pos, e = entries[len(entries) // 2]
    for off, value in ((8, e.index + 1), (16, e.term - 1), (24, e.pos + 1), (44, e.body_len - 1),
                       (48 + commitlog.PHYSICAL_OFFSET_POSITION, e.pos)):
        bad = bytearray(buf)
        struct.pack_into(">q" if off in (8, 16, 24, 76) else ">i", bad, pos + off, value)
        assert dledger.sealed_data_end(bad, len(bad)) is None, off
        assert not is_sealed(Kind.DLEDGER_DATA, bad, len(bad))[0]
    bad = bytearray(buf)
    struct.pack_into(">i", bad, end + 4, SEG - end - 1)
    assert dledger.sealed_data_end(bad, len(bad)) is None
    bad = bytearray(buf)
    struct.pack_into(">i", bad, 0, 0x12345678)
    assert is_sealed(Kind.DLEDGER_DATA, bad, len(bad))[1].startswith("corrupt: unknown DLedger magic")
    assert is_sealed(Kind.DLEDGER_DATA, bytes(SEG), SEG) == (False, "no valid terminal blank")
    # the encoder agrees with the broker: the first entry and the blank, re-encoded, are its bytes
    pos0, e0 = entries[0]
    assert dledger.encode_entry(e0.index, e0.term, e0.pos, buf[48:e0.size]) == bytes(buf[:e0.size])
    assert dledger.encode_blank(SEG - end) == bytes(buf[end:])


def test_archive_walk_reads_dledger_bodies(written: Path):
    """The archive's column-wise walk over a real data file (dledger=True): one checked record per entry, at
    the entry's offset + 48; a damaged entry header raises naming its position, after the records before it."""
    p = _files(written / "dledger-n0" / "data")[0]
    buf = p.read_bytes()
    entries = list(dledger.iter_entries(buf))
    blocks = [buf[i:i + 65536] for i in range(0, len(buf), 65536)]
    got = list(walk.batches(blocks, p.name, len(buf), dledger=True))
    phys = [int(x) for b in got for x in b.phys]
    assert phys == [e.pos + dledger.BODY_OFFSET for _, e in entries]
    bodies = [bytes(b.data[a:a + n]) for b in got for a, n in zip(b.body_at.tolist(), b.body_len.tolist())]
    assert all(body == body_of(int(body[1:13])) for body in bodies)
    with pytest.raises(walk.ArchiveError, match="no record at position 0"):
        list(walk.batches([buf], p.name, len(buf)))  # read as a CommitLog it is no CommitLog
    pos, e = entries[100]
    bad = bytearray(buf)
    struct.pack_into(">q", bad, pos + 24, e.pos + 8)
    with pytest.raises(walk.ArchiveError, match=f"dledger/{p.name}: entry at position {pos} is invalid"):
        list(walk.batches([bytes(bad)], p.name, len(bad), dledger=True))
    bad = bytearray(buf)
    bad[pos + dledger.BODY_OFFSET + 120] ^= 1  # inside the message body: its crc
    with pytest.raises(walk.ArchiveError, match=f"dledger/{p.name}: record at position {pos + 48}"):
        list(walk.batches([bytes(bad)], p.name, len(bad), dledger=True))


# ---------------------------------------------------------------------------------------------- on a tierfs mount

PREFETCH_OPTS = ("tiering.enabled=true,cache.max_bytes=256KiB,cache.block_bytes=64KiB,objectstore.chunk_bytes=256KiB,"
                 "seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5,delete.grace_seconds=0,"
                 "readahead.max_blocks=16")


@requires_fuse
def test_consumequeue_page_prefetches_dledger_records(written: Path, mount_store, tmp_path):
    """Layout-aware prefetch on a DLedger store: reading a tiered ConsumeQueue page fetches the evicted blocks of
    the DLedger data files its units name (at entry bodies), so the record reads that follow wait on nothing."""
    ref = tmp_path / "ref"
    for sub in ("dledger-n0/data", "consumequeue/TA/0"):
        shutil.copytree(written / sub, ref / sub)
    m = mount_store(options=[PREFETCH_OPTS])
    copy_in(ref, m.mnt)
    cq = f"consumequeue/TA/0/{_files(ref / 'consumequeue' / 'TA' / '0')[1].name}"  # past the pinned first file page
    data = [f"dledger-n0/data/{p.name}" for p in _files(ref / "dledger-n0" / "data")[:-1]]

    def status() -> dict:
        return json.loads((m.mnt / ".tierfs" / "status.json").read_text())

    def evicted() -> bool:
        files = {f["path"]: f for f in status()["files"]}
        return all(files.get(p, {}).get("state") == "tiered" and files[p]["resident_bytes"] <= 8192
                   for p in [cq, *data])
    try:
        wait_for(evicted, timeout=120, what="the queue file and the sealed DLedger data files tiered and evicted")
    except AssertionError as e:
        files = {f["path"]: f for f in status()["files"]}
        raise AssertionError(f"{e}: {[(p, files.get(p)) for p in [cq, *data]]}") from None
    for rel in [cq, *data]:
        evict(m.mnt / rel)  # written through the mount: still in the page cache
    fds = {rel: os.open(m.mnt / rel, os.O_RDONLY) for rel in data}  # open, as the broker keeps them mapped
    try:
        for fd in fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, 64, 0)
        e0 = status()["totals"]["engine"]
        units = [u for u in struct.iter_unpack(">qiq", (m.mnt / cq).read_bytes()) if u[1] > 0]
        assert len(units) == CQ_UNITS
        e1 = status()["totals"]["engine"]
        named = e1["named_prefetch_bytes"] - e0["named_prefetch_bytes"]
        assert named > 0
        wait_for(lambda: status()["totals"]["engine"]["prefetch_bytes"] - e0["prefetch_bytes"] >= named,
                 timeout=30, what="the named data file blocks fetched")
        e2 = status()["totals"]["engine"]
        for phys, size, _ in units:
            rel = f"dledger-n0/data/{phys - phys % SEG:020d}"
            if rel in fds:
                msg = commitlog.decode_record(os.pread(fds[rel], size, phys % SEG), 0, check_crc=True)
                assert isinstance(msg, commitlog.Message) and msg.body == body_of(int(msg.body[1:13]))
        e3 = status()["totals"]["engine"]
    finally:
        for fd in fds.values():
            os.close(fd)
    assert e3["reads_waited"] == e2["reads_waited"]  # every record was in memory already
    assert e3["fetches"] == e2["fetches"]

MOUNT_N = 80_000
MOUNT_TOPICS = "TA,TB,TC,TD"
MOUNT_QUEUES = 4


def tiered_counts(env: Env, kind: str) -> tuple[int, int, int]:
    """(tiered files of `kind`, those with evicted bytes, upload backlog) from status.json."""
    st = env.status()
    tiered = [f for f in st["files"] if f["kind"] == kind and f["state"] == "tiered"]
    return (len(tiered), sum(f["resident_bytes"] < f["size"] for f in tiered),
            st["totals"]["upload_backlog_files"])


def wait_evicted(env: Env, kind: str, at_least: int, timeout: float = 180) -> tuple[int, int, int]:
    """At least `at_least` segments of `kind` tiered, half of them evicted, no upload backlog; `tierfs evict`
    presses when the backlog is empty (an operator's pass)."""
    seen = [(0, 0, 0)]

    def done() -> bool:
        seen[0] = n, ev, backlog = tiered_counts(env, kind)
        if n >= at_least and ev * 2 >= n and backlog == 0:
            return True
        if backlog == 0:
            assert env.mount.cli("evict", env.mnt).returncode == 0
        return False

    try:
        wait_for(done, timeout, 1.0, what=f"{at_least} {kind} segments tiered and mostly evicted")
    except AssertionError as e:
        raise AssertionError(f"{e}: (tiered, evicted, backlog) = {seen[0]}") from None
    return seen[0]


def check_data_files_through_mount(root: Path, self_id: str = "n0") -> int:
    """Read every full DLedger data file through the mount (evicted ones from the object store): each is a
    valid sealed file at its offset, every body's crc checks, and the Raft indexes run on across files."""
    files = _files(root / f"dledger-{self_id}" / "data")
    prev = None
    sealed = 0
    for p in files[:-1]:
        buf = p.read_bytes()
        end = dledger.sealed_data_end(buf, len(buf), file_start=int(p.name))
        assert end is not None, f"{p} read through the mount is not a sealed DLedger data file"
        for pos, e in dledger.iter_entries(buf):
            assert prev is None or e.index == prev + 1, (p, pos)
            prev = e.index
            assert commitlog.decode_record(buf, pos + dledger.BODY_OFFSET, check_crc=True) is not None
        sealed += 1
    return sealed


KNOWN_NATIVE_LOSS = """Apache RocketMQ 5.5.0, enableDLegerCommitLog=true, one member, on a plain directory: 80,000
messages acknowledged, kill -9, restart: DLedger recovers every entry ("Recover data to the end entryIndex=79999
processOffset=33332543"), then the broker logs "dledger maxPhyOffsetOfConsumeQueue(33332175) >= processOffset
(33237359), truncate dirty logic files" and a consumer misses 228 acknowledged messages (the same count twice).
The cause, in 5.x `DLedgerCommitLog.dledgerRecoverAbnormally`: its walk adds each message's size
(`getMsgSize`), not the entry's (`getBufferSize`, 48 more), to the offset it recovers to, so it truncates the
ConsumeQueues 48 bytes per entry of the last data file short (95,184 = 48 x 1,983 entries here), and the reput
never dispatches those messages again. 4.9.7 recovers its DLedger CommitLog right."""


def run_pipeline(env: Env, topics: str, n: int) -> None:
    """`tierfs compact` on the DLedger store: every tiered data file becomes lz4c, its messages go to the
    Parquet archive (one row per entry), and `tierfs query` finds messages by key in the data files."""
    tiered = [f for f in env.status()["files"] if f["state"] == "tiered"]
    data = [f["path"] for f in tiered if f["kind"] == "dledger_data"]
    r = env.mount.cli("compact", env.mnt, "--json", "--master", "local[2]", timeout=600)
    summary = json.loads(r.stdout)
    assert summary["ok"] and not summary["errors"], summary
    assert summary["applied"]["archive"] >= len(data) > 0, summary
    files = {f["path"]: f for f in env.status()["files"]}
    assert all(files[p]["format"] == "lz4c" for p in data), [files[p]["format"] for p in data]
    entries = sum(len(list(dledger.iter_entries((env.mnt / p).read_bytes()))) for p in data)
    from deltalake import DeltaTable  # archive.format = "delta", the default: one table beside the objects

    segments = DeltaTable(str(env.objects / "tables" / "messages")).to_pyarrow_table(
        columns=["segment"]).column("segment").to_pylist()
    assert segments and all(s.startswith("dledger-n0/data/") for s in segments), sorted(set(segments))[:5]
    assert len(segments) >= entries
    names = topics.split(",")
    for seq in range(0, n, n // 5):
        q = env.mount.cli("query", env.mnt, "--topic", names[seq % len(names)], "--key", f"K{seq}", "--json")
        assert q.returncode == 0, q.stderr
        got = json.loads(q.stdout)["messages"]
        assert [m["body"] for m in got] == [body_of(seq).decode()], got


@pytest.fixture
def mounted(request, tmp_path):
    version = getattr(request, "param", VERSION)
    env = Env(version, tmp_path)
    try:
        env.mount.mount()
        env.rmq = B.RocketMQ(version, tmp_path / "home")
        env.rmq.start_namesrv()
        yield env
    finally:
        env.close()


@requires_fuse
@pytest.mark.parametrize("mounted", B.VERSIONS, indirect=True)
def test_dledger_broker_on_tierfs(mounted: Env):
    """One DLedger broker on a tierfs mount: 80,000 acknowledged messages; its sealed data files are tiered and
    evicted (`tierfs status` says so), read back through the mount byte-valid, and a new consumer group reads
    every acknowledged message by content; the pipeline compacts and archives them; after a kill -9 (4.9.7; a
    graceful stop for 5.5.0, see KNOWN_NATIVE_LOSS) the broker recovers from the evicted files, takes more
    messages, and everything is read again."""
    env, rmq = mounted, mounted.rmq
    conf = dledger_conf(rmq, env.mnt)
    rmq.start_broker(conf)
    env.client("topics", rmq.ns_addr, rmq.broker_addr, MOUNT_QUEUES, *MOUNT_TOPICS.split(","))
    acked = env.base / "acked"
    res = env.produce(MOUNT_TOPICS, MOUNT_QUEUES, 0, MOUNT_N, acked, threads=32)
    assert res["acked"] == MOUNT_N and res["errors"] == 0, res
    n, evicted, _ = wait_evicted(env, "dledger_data", 8)
    text = env.mount.cli("status", env.mnt)
    assert text.returncode == 0 and "dledger_data" in text.stdout, text.stdout
    assert check_data_files_through_mount(env.mnt) >= 8
    res = env.consume("g-first", topics=MOUNT_TOPICS, queues=MOUNT_QUEUES, count=MOUNT_N, acked=acked)
    assert_all_read(res, MOUNT_N)
    assert res["read"] == MOUNT_N and res["dups"] == 0, res

    run_pipeline(env, MOUNT_TOPICS, MOUNT_N)
    res = env.consume("g-after-compact", topics=MOUNT_TOPICS, queues=MOUNT_QUEUES, count=MOUNT_N, acked=acked)
    assert_all_read(res, MOUNT_N)

    # kill -9, or for 5.5.0 a graceful stop: a 5.5.0 DLedger broker killed -9 loses its last ~230 acknowledged
    # messages on a plain directory too (its recovery truncates the ConsumeQueues short of the end DLedger
    # recovered, and they are never dispatched again; see KNOWN_NATIVE_LOSS)
    if env.version == "4.9.7":
        assert rmq.stop_broker(signal.SIGKILL) == -signal.SIGKILL
    else:
        rmq.stop_broker(signal.SIGTERM, timeout=120)
    wait_evicted(env, "dledger_data", 8)
    rmq.start_broker(conf)
    more = env.base / "acked-more"
    res = env.produce(MOUNT_TOPICS, MOUNT_QUEUES, MOUNT_N, 8_000, more, threads=16)
    assert res["acked"] == 8_000, res
    merged = env.base / "acked-merged"
    merged.write_bytes(B.merge_acked([(acked.read_bytes(), 0), (more.read_bytes(), MOUNT_N)]))
    wait_evicted(env, "dledger_data", 9)
    res = env.consume("g-after-kill", topics=MOUNT_TOPICS, queues=MOUNT_QUEUES, count=MOUNT_N + 8_000,
                      acked=merged)
    assert_all_read(res, MOUNT_N + 8_000)
    assert check_data_files_through_mount(env.mnt) >= 9
    assert os.path.isdir(env.hot / "dledger-n0" / "data")


# ---------------------------------------------------------------------------------------------- a 3-node group

GROUP_N = 60_000


def _role(rmq: B.RocketMQ) -> tuple[int, str]:
    """(term, role) of the broker's last finished role change (-1, '' before any), from its broker.log."""
    last = (-1, "")
    for line in rmq.broker_log().splitlines():
        if "Finish handling broker role change succ=true" in line:
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            last = (int(fields["term"]), fields["role"])
    return last


def wait_leader(members: list[B.RocketMQ], timeout: float = 120) -> B.RocketMQ:
    """The group member that is leader in the highest term any live member has reached."""
    found: list[B.RocketMQ] = []

    def done() -> bool:
        live = [r for r in members if r.broker is not None and r.broker.proc.poll() is None]
        roles = {id(r): _role(r) for r in live}
        top = max((t for t, _ in roles.values()), default=-1)
        leaders = [r for r in live if roles[id(r)] == (top, "LEADER")]
        followers = [r for r in live if roles[id(r)] == (top, "FOLLOWER")]
        if len(leaders) == 1 and len(leaders) + len(followers) == len(live):
            found[:] = leaders
            return True
        return False

    wait_for(done, timeout, 0.5, what="one DLedger leader and its followers in one term")
    return found[0]


@pytest.fixture
def group(mounted: Env):
    """Three DLedger members n0, n1, n2 on one tierfs mount (store roots n0/, n1/, n2/), one name server."""
    env = mounted
    members = [env.rmq] + [B.RocketMQ(env.version, env.base / f"home{i}") for i in (1, 2)]
    ports: list[int] = []
    for _ in members:
        ports.append(dledger_port(members, tuple(ports)))
    peers = ";".join(f"n{i}-127.0.0.1:{p}" for i, p in enumerate(ports))
    confs = [dledger_conf(r, env.mnt / f"n{i}", f"n{i}", peers, namesrvAddr=env.rmq.ns_addr)
             for i, r in enumerate(members)]
    try:
        for r, c in zip(members, confs):
            r.start_broker(c)
        yield env, members, confs
    finally:
        for r in members[1:]:
            r.close()


@requires_fuse
def test_dledger_group_survives_leader_kill(group):
    """A 3-node DLedger group on one tierfs mount takes 60,000 messages; the leader is killed -9 while a producer
    sends; a new leader is elected and serves, from tiered and evicted data files, every message that was
    acknowledged before and after the kill; the old leader rejoins as a follower and catches up on tierfs."""
    env, members, confs = group
    leader = wait_leader(members)
    env.client("topics", env.rmq.ns_addr, leader.broker_addr, MOUNT_QUEUES, *MOUNT_TOPICS.split(","))
    acked = env.base / "acked"
    res = env.produce(MOUNT_TOPICS, MOUNT_QUEUES, 0, GROUP_N, acked, threads=32)
    assert res["acked"] == GROUP_N and res["errors"] == 0, res
    wait_evicted(env, "dledger_data", 3 * 4)

    # kill -9 of the leader while a producer sends: what it acknowledged is on a majority
    during = env.base / "acked-during"
    result: dict = {}

    def producer() -> None:
        try:
            result["res"] = env.produce(MOUNT_TOPICS, MOUNT_QUEUES, GROUP_N, 20_000, during, threads=16)
        except Exception as e:  # noqa: BLE001 - reported below
            result["err"] = e

    old = leader
    old_id = members.index(old)
    data_dir = env.mnt / f"n{old_id}" / f"dledger-n{old_id}" / "data"
    before = len(_files(data_dir))
    t = threading.Thread(target=producer)
    t.start()
    try:
        # a few data files into the batch (thousands of messages acknowledged), the leader dies
        wait_for(lambda: len(_files(data_dir)) > before + 2, 120, 0.2, what="the leader writing the second batch")
        assert old.stop_broker(signal.SIGKILL) == -signal.SIGKILL
        killed = time.monotonic()
        leader = wait_leader(members)
        elected = time.monotonic() - killed
        assert leader is not old
    finally:
        t.join(600)
    assert "err" not in result, result.get("err")
    got = result["res"]
    assert got["acked"] > 0, got
    merged = env.base / "acked-merged"
    merged.write_bytes(B.merge_acked([(acked.read_bytes(), 0), (during.read_bytes(), GROUP_N)]))
    expected = GROUP_N + got["acked"]
    print(f"\nleader n{old_id} killed; n{members.index(leader)} elected after {elected:.1f}s; the producer "
          f"of the kill got {got['acked']} of 20,000 acknowledged ({got['errors']} errors)")

    new_id = members.index(leader)
    wait_evicted(env, "dledger_data", 3 * 4)
    assert check_data_files_through_mount(env.mnt / f"n{new_id}", f"n{new_id}") >= 4
    res = env.consume("g-new-leader", topics=MOUNT_TOPICS, queues=MOUNT_QUEUES, count=GROUP_N + 20_000,
                      acked=merged)
    assert_all_read(res, expected)

    # the new leader takes writes (entries of its term: the old leader's log is behind, it cannot win back)
    after = env.base / "acked-after"
    res = env.produce(MOUNT_TOPICS, MOUNT_QUEUES, GROUP_N + 20_000, 2_000, after, threads=8)
    assert res["acked"] == 2_000, res
    merged.write_bytes(B.merge_acked([(acked.read_bytes(), 0), (during.read_bytes(), GROUP_N),
                                      (after.read_bytes(), GROUP_N + 20_000)]))
    expected += 2_000

    # the old leader comes back as a follower (truncating what the group never committed) and catches up
    old.start_broker(confs[old_id])
    wait_leader(members)
    assert _role(old)[1] == "FOLLOWER"
    new_files = _files(env.mnt / f"n{new_id}" / f"dledger-n{new_id}" / "data")
    wait_for(lambda: len(_files(data_dir)) >= len(new_files), 120, 0.5, what="the old leader catching up")
    assert check_data_files_through_mount(env.mnt / f"n{old_id}", f"n{old_id}") >= len(new_files) - 1
    res = env.consume("g-after-rejoin", topics=MOUNT_TOPICS, queues=MOUNT_QUEUES, count=GROUP_N + 22_000,
                      acked=merged)
    assert_all_read(res, expected)
