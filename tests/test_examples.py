"""End-to-end: examples/producer.py writes a store on the native filesystem, examples/consumer.py verifies it.

Small segments (1 MiB commitlog, 6000-byte CQ files, 100-slot/400-item index files) make every roll path run.
The store files are also checked directly with the codecs (seal rules, names, sizes, small files).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierfs.store import commitlog as cl
from tierfs.store import consumequeue as cq
from tierfs.store import indexfile as ix
from tierfs.store.checkpoint import decode_checkpoint
from tierfs.store.names import is_index_name, name_to_offset

REPO = Path(__file__).resolve().parent.parent
PRODUCER = REPO / "examples" / "producer.py"
CONSUMER = REPO / "examples" / "consumer.py"
CL_SIZE = 1 << 20
CQ_SIZE = 6000
SLOTS, ITEMS = 100, 400
SMALL = ["--commitlog-size", str(CL_SIZE), "--cq-size", str(CQ_SIZE),
         "--index-slots", str(SLOTS), "--index-items", str(ITEMS)]


def run(script: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def produce(store: Path, *args: str) -> dict:
    p = run(PRODUCER, str(store), *SMALL, *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def consume(store: Path, *args: str) -> tuple[int, dict, str]:
    p = run(CONSUMER, str(store), "--json", *args)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def check_store_files(store: Path, version: int, crashed: bool = False) -> None:
    """Byte-level checks of what the broker itself would look at (names, sizes, seals, small files)."""
    def listing(d: Path) -> list[Path]:
        files = sorted(d.iterdir())
        if crashed and files and files[-1].stat().st_size == 0:
            files.pop()  # killed between open(O_CREAT) and ftruncate: the broker deletes such a last file
        return files

    segs = listing(store / "commitlog")
    assert segs and all(p.stat().st_size == CL_SIZE for p in segs)
    assert [name_to_offset(p.name) for p in segs] == [i * CL_SIZE for i in range(len(segs))]
    bufs = [p.read_bytes() for p in segs]
    data_segs = [b for b in bufs if b[:8] != bytes(8)]
    assert bufs[:len(data_segs)] == data_segs  # empty segments only after the data
    for i, b in enumerate(data_segs[:-1]):  # every completed segment: valid records then a terminal BLANK
        end = cl.sealed_commitlog_end(b, CL_SIZE, check_crc=True, file_start=i * CL_SIZE)
        assert end is not None and b[end + 8:] == bytes(CL_SIZE - end - 8)
    empty_tail = len(bufs) - len(data_segs)
    if crashed:
        # Next-next preallocation: the empty preallocated segment survives a crash (two of them if the crash
        # hit a roll, which also leaves the last data segment sealed by its BLANK).
        assert empty_tail in (1, 2)
    else:  # a clean shutdown unlinks the preallocated segment; the active one is open
        assert empty_tail == 0 and cl.sealed_commitlog_end(data_segs[-1], CL_SIZE) is None

    for qdir in (store / "consumequeue").glob("*/*"):
        files = listing(qdir)
        assert all(f.stat().st_size == CQ_SIZE for f in files)
        assert [name_to_offset(f.name) for f in files] == [i * CQ_SIZE for i in range(len(files))]
        for f in files[:-1]:
            assert cq.is_full_and_valid(f.read_bytes(), CQ_SIZE)

    idx = listing(store / "index")
    assert idx and all(is_index_name(p.name) for p in idx)
    assert len({p.name for p in idx}) == len(idx)
    for p in idx[:-1]:
        h = ix.decode_header(p.read_bytes())
        assert h.index_count == ITEMS and p.stat().st_size == ix.index_file_size(SLOTS, ITEMS)

    assert (store / "lock").read_bytes() == b"lock"
    cp = (store / "checkpoint").read_bytes()
    assert len(cp) == 4096
    if version == 4:
        assert cp[24:40] == bytes(16)  # 4.9 writes three longs only
    if not crashed:
        assert not (store / "abort").exists()
        assert decode_checkpoint(cp).physic_msg_timestamp > 0
    config = {p.name for p in (store / "config").iterdir()}
    assert {"topics.json", "consumerOffset.json", "subscriptionGroup.json"} <= config
    if not crashed:  # persisted at start and again at shutdown
        assert "consumerOffset.json.bak" in config
    assert not any(n.endswith(".tmp") for n in config)
    assert (store / "abort.bak").exists() == (version == 5)  # 5.x writes the PID through string2File


@pytest.mark.parametrize(
    "version,cq_mode,extra",
    [
        (4, "mmap", ["--keys-per-msg", "2", "--body-min", "0", "--body-max", "1500"]),
        (4, "filechannel", ["--tags", ""]),
        (5, "mmap", ["--ipv6", "--body-size", "300"]),
        (5, "filechannel", ["--long-topics", "--body-min", "10", "--body-max", "700"]),
    ],
)
def test_produce_then_consume(tmp_path, version, cq_mode, extra):
    store = tmp_path / "store"
    n = 4000
    summary = produce(store, "--broker-version", str(version), "--cq-mode", cq_mode, "--messages", str(n),
                      "--topics", "3", "--queues", "2", "--seed", "7", *extra)
    assert summary["messages"] == n and summary["files"]["commitlog"] >= 2
    rc, out, err = consume(store, "--expect-messages", str(n), "--check-keys", "150")
    assert rc == 0, err
    assert out["ok"] and out["messages"] == n and out["cq_units"] == n and out["queues"] == 6
    assert out["bytes"] == summary["max_phys_offset"]
    keys_per = 2 if "--keys-per-msg" in extra else 1
    assert out["keys_checked"] == 150 * (1 + keys_per)
    check_store_files(store, version)
    first = cl.decode_record((store / "commitlog" / "00000000000000000000").read_bytes(), 0)
    assert first.version == (2 if "--long-topics" in extra else 1)
    assert first.trailing_separator == (version == 5)
    if "--ipv6" in extra:
        assert len(first.store_host[0]) == 16 and first.sys_flag & 0x30 == 0x30


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


@pytest.mark.parametrize("version,cq_mode", [(4, "mmap"), (5, "filechannel")])
def test_kill9_then_recover(tmp_path, version, cq_mode):
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, str(PRODUCER), str(store), *SMALL, "--broker-version", str(version),
                             "--cq-mode", cq_mode, "--messages", "0", "--topics", "2", "--queues", "2",
                             "--body-size", "700"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        cl_dir = store / "commitlog"
        wait_for(lambda: cl_dir.is_dir() and len(list(cl_dir.iterdir())) >= 4)
        time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert (store / "abort").exists()
    rc, out, _ = consume(store)
    assert rc == 1 and "abort" in out["error"]
    rc, out, err = consume(store, "--recover", "--check-keys", "200")
    assert rc == 0, err
    assert out["ok"] and out["messages"] > 0, out
    # the next-next segment is made when a segment is handed out, so one or two empty ones follow the data; none
    # only when the kill landed in a roll, after the BLANK and before that file existed: the data then ends
    # exactly where the last file starts
    rolled = out["bytes"] == (out["commitlog_files"] - 1) * CL_SIZE
    assert out["empty_tail_segments"] in (1, 2) or (out["empty_tail_segments"] == 0 and rolled), out
    assert out["keys_checked"] >= 2 * 199
    check_store_files(store, version, crashed=True)


def test_recovery_ends_before_a_record_the_crash_cut_short(tmp_path):
    """A kill -9 in the middle of an append can leave the last record with its header and body (lengths and body
    crc right, so the broker's recovery keeps it) but zeros where the rest of its properties should be. Seen in CI
    as "no producer key k-<seq> in KEYS=None" from test_kill9_then_recover (1 in 50 kills here). The recovering
    consumer ends the valid data before such a record (fails on 1214b6c: it required the record's key)."""
    store = tmp_path / "store"
    produce(store, "--messages", "500", "--body-size", "300", "--topics", "1", "--queues", "1")
    seg = store / "commitlog" / "00000000000000000000"
    data = bytearray(seg.read_bytes())
    pos, rec = [(p, r) for p, r in cl.iter_records(data) if not isinstance(r, cl.Blank)][-1]
    end = pos + rec.total_size
    props = rec.properties.get("KEYS")
    assert props and data[end - 1] != 0
    tail = data.rfind(props.encode(), pos, end)  # from the key on, the properties are not written yet
    data[tail:end] = bytes(end - tail)
    assert cl.decode_record(data, pos, check_crc=True) is not None  # the broker's recovery keeps it
    seg.write_bytes(bytes(data))
    (store / "abort").touch()
    rc, out, err = consume(store, "--recover", "--check-keys", "50")
    assert rc == 0, (out, err)
    assert out["messages"] == 499 and out["torn_records"] == 1 and out["bytes"] == pos, out
    assert cl.torn_record(data, pos) and not cl.torn_record(data, [p for p, _ in cl.iter_records(data)][-3])


_MAPPED_WRITER = """
import mmap, os, sys, time
from tierfs.store import checkpoint as ckpt, indexfile as ix
index_path, cp_path = sys.argv[1:3]
def mapped(path, size):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, size)
    return mmap.mmap(fd, size)
buf, cp_buf = mapped(index_path, ix.index_file_size(100, 1 << 20)), mapped(cp_path, 4096)
w = ix.IndexWriter(buf, 100, 1 << 20)
print("ready", flush=True)
k = 1
while w.put_key(k * 7919, k * 100, int(time.time() * 1000)):
    ckpt.encode_checkpoint_into(cp_buf, ckpt.Checkpoint(k, k, k, k, k), 5)
    k += 1
"""


def test_a_writer_killed_anywhere_leaves_index_and_checkpoint_fields_whole(tmp_path):
    """The index header of a SIGKILLed producer said index_count 0 (CI: "index lookup resolved to []" for a key
    ~40 items before the kill): Struct.pack_into zeroes its target, then packs field by field, so a kill inside it
    left zeros in the shared mapping. Writers now store packed bytes with one slice assignment. Here a process
    puts keys and rewrites a checkpoint through MAP_SHARED mappings and is killed at random moments: whatever the
    moment, the header counts every item but the one being put, the newest keys resolve, no checkpoint field is
    0. Fails on 15049e1 (a zeroed header or checkpoint within the 30 kills in each of 3 runs here)."""
    import random

    rng = random.Random(1)
    for attempt in range(30):
        index_path, cp_path = tmp_path / f"index{attempt}", tmp_path / f"checkpoint{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", _MAPPED_WRITER, str(index_path), str(cp_path)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "ready\n"
            time.sleep(rng.uniform(0.001, 0.03))
        finally:
            proc.kill()
            proc.communicate(timeout=30)
        buf = index_path.read_bytes()
        count = ix.decode_header(buf).index_count  # items 1 .. count-1 counted; item `count` maybe being put
        after = buf[ix.index_file_size(100, count + 1):ix.index_file_size(100, count + 2)]  # items go in order
        assert after == bytes(ix.ITEM_SIZE), f"kill {attempt}: header counts {count - 1} items, item {count + 1} " \
                                             "is written"
        for k in range(max(1, count - 300), count):
            assert ix.lookup(buf, k * 7919, 0, 1 << 62, 1, 100, 1 << 20) == [k * 100], f"kill {attempt}: key {k}"
        cp = decode_checkpoint(cp_path.read_bytes())
        fields = (cp.physic_msg_timestamp, cp.logics_msg_timestamp, cp.index_msg_timestamp,
                  cp.master_flushed_offset, cp.confirm_phy_offset)
        assert count <= 2 or 0 not in fields, f"kill {attempt}: checkpoint fields {fields}"


def test_sigterm_is_a_clean_exit(tmp_path):
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, str(PRODUCER), str(store), *SMALL, "--messages", "0",
                             "--rate", "20000", "--body-size", "200"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (store / "abort").exists() and (store / "index").is_dir())
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    n = json.loads(stdout.strip().splitlines()[-1])["messages"]
    assert n > 0 and not (store / "abort").exists()
    rc, out, err = consume(store, "--expect-messages", str(n))
    assert rc == 0, err
    check_store_files(store, 5)


def test_refuses_to_start_when_locked(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    fd = os.open(store / "lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        p = run(PRODUCER, str(store), *SMALL, "--messages", "10")
        assert p.returncode == 1 and "MQ already started" in p.stderr
        assert not (store / "abort").exists() and not list((store / "commitlog").iterdir())
    finally:
        os.close(fd)
    produce(store, "--messages", "10")  # the lock is free again
    p = run(PRODUCER, str(store), *SMALL, "--messages", "10")
    assert p.returncode == 2 and "already has commitlog segments" in p.stderr


def test_consumer_detects_damage(tmp_path):
    store = tmp_path / "store"
    produce(store, "--messages", "3000", "--body-size", "500", "--topics", "2", "--queues", "2")
    assert consume(store, "--expect-messages", "3000")[0] == 0
    rc, out, _ = consume(store, "--expect-messages", "2999")
    assert rc == 1 and "expected 2999" in out["error"]

    # A flipped body byte in the middle of the first segment: BODYCRC fails, the walk stops, non-zero bytes follow.
    seg = store / "commitlog" / "00000000000000000000"
    data = bytearray(seg.read_bytes())
    recs = list(cl.iter_records(data))
    pos, rec = recs[len(recs) // 2]
    body_at = pos + 88  # IPv4 hosts: the body starts at byte 88 of the record
    assert data[body_at:body_at + 16] == rec.body[:16]
    data[body_at + 20] ^= 0xFF
    seg.write_bytes(bytes(data))
    rc, out, _ = consume(store)
    assert rc == 1 and f"00000000000000000000@{pos}" in out["error"]
    data[body_at + 20] ^= 0xFF
    seg.write_bytes(bytes(data))
    assert consume(store)[0] == 0

    # A CQ unit whose size disagrees with the record.
    qfile = store / "consumequeue" / "TopicTest0" / "1" / "00000000000000000000"
    q = bytearray(qfile.read_bytes())
    unit = cq.decode_unit(q, 40)
    q[40:60] = cq.encode_unit(unit.phys_offset, unit.size + 1, unit.tags_code)
    qfile.write_bytes(bytes(q))
    rc, out, _ = consume(store)
    assert rc == 1 and "TopicTest0/1" in out["error"] and "unit size" in out["error"]
    q[40:60] = cq.encode_unit(*unit)
    qfile.write_bytes(bytes(q))

    # A stray file in commitlog/ makes the broker refuse to load; the consumer says so.
    (store / "commitlog" / ".fuse_hidden0001").write_bytes(b"x")
    rc, out, _ = consume(store)
    assert rc == 1 and ".fuse_hidden0001" in out["error"]
