"""The soak (bench/soak.py) in CI: two minutes of a continuous writer, a tail reader and a replaying reader on one
mount while segments seal, upload, evict and get compacted. Every message read is verified byte for byte, the upload
backlog must drain at the end, and every file must read back with the crc32c the writer computed as it wrote.

A first, fast test (no FUSE) proves the checks can fail: one flipped byte is caught by each of them."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from mountutil import requires_fuse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import soak  # noqa: E402

# 2000 msg/s of 256..2048-byte bodies is ~2.7 MB/s: 40 CommitLog segments of 8 MiB in two minutes, with room on two
# cores for the daemon, both readers and one Spark job (about 70 s under this load).
CI = soak.SoakParams(seconds=120, interval=20, rate=2000, replay_rate=4000, compactions=1, check_keys=1000,
                     drain_timeout=120, compact_timeout=300)


def drain_reader(reader: soak.TailReader) -> None:
    while sum(reader.poll(q) for q in reader.queues):
        pass


@pytest.mark.timeout(120)
def test_every_check_catches_one_flipped_byte(tmp_path):
    p = soak.SoakParams(commitlog_size=1 << 20, cq_units=2000, index_slots=500, index_items=2000)
    store, work = tmp_path / "store", tmp_path / "work"
    store.mkdir()
    work.mkdir()
    # a count, not a time: on a loaded machine 1.5 s at 20,000 msg/s once wrote 9,856 (short of a third segment)
    ch = soak.Child("writer", store, p.child_params(rate=0, messages=12_000), work)
    final = ch.wait_final(60)
    assert not final["errors"] and final["messages"] == 12_000
    files = final["files"]
    assert soak.check_crcs(store, files, {})["mismatches"] == 0
    reader = soak.TailReader(store, p.child_params())
    drain_reader(reader)
    assert (reader.read, reader.fail.count) == (final["messages"], 0)

    # one byte of the first body in the second CommitLog segment (a record's body starts at 88 with IPv4 hosts)
    rel = "commitlog/00000000000001048576"
    assert files[rel]["sealed"]
    with open(store / rel, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x40]))
    crcs = soak.check_crcs(store, files, {})
    assert crcs["mismatches"] == 1 and crcs["first_mismatches"][0]["path"] == rel
    reader = soak.TailReader(store, p.child_params())
    drain_reader(reader)
    assert reader.fail.count == 1 and reader.read == final["messages"] - 1
    assert reader.fail.first[0]["what"].startswith("BODYCRC does not match the body"), reader.fail.first
    replay = soak.ReplayReader(store, p.child_params(replay_rate=0))
    seq = replay._segment(0, 0)
    assert seq is not None and replay.fail.count == 0
    assert replay._segment(1 << 20, seq) is None and replay.fail.count == 1
    assert replay.fail.first[0]["what"].startswith("BODYCRC does not match the body"), replay.fail.first
    assert replay._segment(2 << 20, None) is not None and replay.fail.count == 1  # resynchronised on the next one


@requires_fuse
@pytest.mark.timeout(480)
def test_soak_two_minutes(mount_store, tmp_path):
    m = mount_store(options=[soak.mount_options(CI)])
    t = time.monotonic()
    res = soak.run_soak(m.mnt, CI, workdir=tmp_path / "work")
    soak.print_summary(res)
    print(f"soak test: {time.monotonic() - t:.0f} s in all")
    (tmp_path / "soak.json").write_text(json.dumps(res, indent=1, default=str))
    assert res["problems"] == [], res["problems"]
    assert res["verification_failures"] == 0, res["failures"]
    written = res["written"]["messages"]
    assert written >= 0.8 * CI.rate * CI.seconds  # the writer kept its pace (it catches up after a stall)
    assert res["tail"]["read"] == written  # every message verified at least once
    assert res["replay"]["read"] > 0 and res["replay"]["segments"] > 0
    # tiering really ran: segments uploaded, evicted, and read back from the object store
    eng = res["engine"]
    assert eng["uploads"] >= res["files"]["sealed"] and eng["evicted_bytes"] > 0 and eng["fetches"] > 0
    assert eng["fetch_errors"] == 0 and eng["corrupt_objects"] == 0
    assert res["cache_hit_ratio"] is not None and eng["reads_waited"] > 0  # some reads waited on a fetch
    # compaction ran while everything else did, and changed objects under the readers
    assert res["compactions"] and all(c["ok"] for c in res["compactions"])
    assert res["compactions"][0]["applied"]["segments"] > 0
    # the backlog drained and nothing was lost
    assert res["drain"]["ok"], res["drain"]
    cc = res["crc_check"]
    assert cc["mismatches"] == 0 and cc["files"] == res["files"]["total"] and cc["sealed_files"] > 40
    assert cc["per_format"].get("lz4c", {}).get("files", 0) > 0
    assert res["final_consumer"]["ok"] and res["final_consumer"]["messages"] == written
    assert res["fsck"]["ok"], res["fsck"]
