"""The Spark pipeline end to end on real mounts: `tierfs compact` turns tiered segments into lz4c objects, builds
.cidx sidecars and the Parquet archive; the mount keeps serving identical bytes (cat, mmap, the consumer);
`tierfs query` answers like a chain walk of the original index files; a killed job leaves nothing half-swapped
(a daemon killed between manifest and swap: tests/test_crashpoints.py). The job runs on a real local SparkSession (a child process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import pytest

from mountutil import files_under, wait_for
from test_store_mount import consume
from test_tiering import (TIER_OPTS, s3_opts, assert_same_bytes, by_path, copy_in, reference_store, segments,  # noqa: F401
                          status, wait_tiered_and_evicted)
from tierfs.store import commitlog as cl
from tierfs.store import indexfile as ix

# 2 Spark cores keep the JVM start-up and the job short on a 2-core runner
PIPE_OPTS = TIER_OPTS + ",compaction.enabled=false,spark.master=local[2]"


def tierfs(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True, text=True, timeout=timeout)


def compact(m, *extra: str) -> dict:
    r = tierfs("compact", str(m.mnt), "--json", *extra)
    assert r.stdout.strip(), f"compact printed nothing: {r.stderr}\n{m.log_text()[-3000:]}"
    return json.loads(r.stdout)


def tiered_store(mount_store, ref: Path, options: str = PIPE_OPTS, env=None):
    m = mount_store(options=[options], env=env)
    copy_in(ref, m.mnt)
    segs = segments(ref)
    wait_for(lambda: all(by_path(m).get(p, {}).get("state") == "tiered" for p in segs if p in by_path(m))
             and len(by_path(m)) >= len(segs) - 6, timeout=90, what="tiering")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]])
    return m


def native_query(ref: Path, topic: str, key: str) -> list[int]:
    """What the broker's chain walk returns over the original index files."""
    names = sorted(p.name for p in (ref / "index").iterdir() if p.name.isdigit())
    bufs = [(ref / "index" / n).read_bytes() for n in names]
    return ix.query_offsets(bufs, ix.build_key(topic, key), 0, (1 << 63) - 1, 64, 500, 2000)


def some_keys(ref: Path, n: int) -> list[tuple[str, str]]:
    """(topic, key) pairs from the first CommitLog segment of the reference store."""
    first = sorted((ref / "commitlog").iterdir())[0].read_bytes()
    out = []
    for _, rec in cl.iter_records(first):
        if isinstance(rec, cl.Message) and rec.keys:
            out.append((rec.topic, rec.keys[0]))
    return out[:: max(1, len(out) // n)][:n]


def check_mount_reads(m, ref: Path) -> None:
    segs = segments(ref)
    assert_same_bytes(m, ref, segs)
    assert consume(m.mnt, "--expect-messages", "6000", "--check-keys", "-1")["ok"]
    rel = next(p for p in segs if p.startswith("commitlog/"))
    code = ("import mmap,sys,zlib; f=open(sys.argv[1],'rb'); m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); "
            "print(zlib.crc32(m[:]))")
    out = subprocess.run([sys.executable, "-c", code, str(m.mnt / rel)], capture_output=True, text=True, timeout=60)
    assert int(out.stdout) == zlib.crc32((ref / rel).read_bytes())


def check_archive_table(m, ref: Path, commitlogs: list[str]) -> None:
    """The archive table (archive.format's default) holds each message of the tiered CommitLog segments once."""
    from deltalake import DeltaTable

    want = Counter()
    for rel in commitlogs:
        for _, rec in cl.iter_records((ref / rel).read_bytes()):
            if isinstance(rec, cl.Message):
                want[(rec.topic, rec.queue_id, rec.queue_offset)] += 1
    t = DeltaTable(str(m.state_dir / "objects" / "tables" / "messages")).to_pyarrow_table(
        columns=["topic", "queue_id", "queue_offset", "segment"])
    got = Counter(zip(*(t.column(c).to_pylist() for c in ("topic", "queue_id", "queue_offset"))))
    assert got == want and max(want.values()) == 1 and set(t.column("segment").to_pylist()) == set(commitlogs)


def test_compact_then_every_byte_and_key_reads_back(mount_store, reference_store):
    ref = reference_store
    m = tiered_store(mount_store, ref)
    tiered = [f for f in status(m)["files"] if f["state"] == "tiered"]
    summary = compact(m)
    assert summary["ok"], summary
    assert summary["applied"]["segments"] == len(tiered)
    assert summary["applied"]["indexes"] == sum(f["kind"] == "index" for f in tiered) > 0
    assert summary["applied"]["archive"] == sum(f["kind"] == "commitlog" for f in tiered) > 0
    assert summary["bytes_out"] < summary["bytes_in"]
    files = by_path(m)
    assert all(files[f["path"]]["format"] == "lz4c" for f in tiered)
    assert all(len(files[f["path"]]["objects"]) == 1 and files[f["path"]]["objects"][0].endswith(".lz4c")
               for f in tiered)
    check_mount_reads(m, ref)
    check_archive_table(m, ref, [f["path"] for f in tiered if f["kind"] == "commitlog"])
    # the raw objects are gone after the grace period (0 here); lz4c objects remain
    objects = m.state_dir / "objects"
    wait_for(lambda: not any(p.name.endswith(".raw") for p in files_under(objects)), timeout=30,
             what="raw objects deleted")
    # key look-ups: the sidecars answer what a chain walk of the original index files answers
    used_sidecar = 0
    for topic, key in some_keys(ref, 12):
        r = tierfs("query", str(m.mnt), "--topic", topic, "--key", key, "--max", "64", "--json")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        want = native_query(ref, topic, key)
        hits = [msg["phys_offset"] for msg in got["messages"]]
        assert hits == [p for p in want if p in hits] and set(hits) <= set(want)
        assert all(key in msg["keys"] and msg["topic"] == topic for msg in got["messages"])
        assert len(hits) >= 1
        st = got["stats"]
        used_sidecar += st["files_by_sidecar"]
        assert st["sidecar_gets"] <= 2 * st["files_by_sidecar"]  # slot entry + run: the header is in the catalog
    assert used_sidecar > 0
    # the human status shows the job
    assert "compaction: job" in (m.ctl / "status").read_text()
    # remount: the lz4c rows are durable
    m.umount()
    m.mount()
    assert all(by_path(m)[f["path"]]["format"] == "lz4c" for f in tiered)
    assert_same_bytes(m, ref, segments(ref)[:8])


def test_spark_job_killed_midway_swaps_nothing(mount_store, reference_store):
    ref = reference_store
    m = tiered_store(mount_store, ref)
    before = by_path(m)
    proc = subprocess.Popen([sys.executable, "-m", "tierfs", "compact", str(m.mnt), "--only", "segments", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        jobs = m.state_dir / "jobs"

        def first_item() -> bool:
            for d in jobs.glob("*"):
                p = d / "progress.jsonl"
                if p.exists() and any('"ok"' in line for line in p.read_text().splitlines()):
                    return True
            return False
        wait_for(first_item, timeout=180, what="the job's first finished segment")
        job = max(jobs.glob("*"), key=lambda d: d.stat().st_mtime)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), str(job))]
        assert pids, "the job process was not found"
        for pid in pids:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads(out)
    assert not summary["ok"] and "without a result" in summary["errors"][0]["error"]
    after = by_path(m)
    assert {p: f["format"] for p, f in after.items()} == {p: f["format"] for p, f in before.items()}
    assert all(f["format"] == "raw" for f in after.values())
    assert_same_bytes(m, ref, segments(ref)[:10])
    # a second run finishes the work
    summary = compact(m, "--only", "segments")
    assert summary["ok"] and summary["applied"]["segments"] == sum(f["state"] == "tiered" for f in after.values())
    assert_same_bytes(m, ref, segments(ref))


def _cmdline_has(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def test_s3_compaction_reads_back_identically(mount_store, reference_store, rgw):
    ref = reference_store
    opts = s3_opts(rgw, "pipeline", ",compaction.enabled=false,spark.master=local[2]")
    m = tiered_store(mount_store, ref, opts)
    summary = compact(m, "--only", "segments")
    assert summary["ok"], summary
    summary = compact(m, "--only", "index")
    assert summary["ok"] and summary["applied"]["indexes"] > 0, summary
    assert all(f["format"] == "lz4c" for f in status(m)["files"] if f["state"] == "tiered")
    check_mount_reads(m, ref)
    topic, key = some_keys(ref, 1)[0]
    got = json.loads(tierfs("query", str(m.mnt), "--topic", topic, "--key", key, "--json").stdout)
    assert got["stats"]["files_by_sidecar"] > 0
    assert [x["phys_offset"] for x in got["messages"]] == [p for p in native_query(ref, topic, key)
                                                          if p in {x["phys_offset"] for x in got["messages"]}]


def test_sealed_segments_reach_the_table_within_max_lag(mount_store, reference_store):
    """archive.max_lag_seconds: with no scheduled run due (a day away), the daemon runs an archive-only job once
    the oldest unarchived tiered CommitLog segment is half the limit old; every tiered segment's messages land in
    the table, and the lag the daemon measured (last write to commit, in status and the metrics) is within the
    limit; the rows carry the brokerName of the store root's brokerIdentity; the first job also runs the table's
    retention (archive.retention_days). Fails on a daemon that archives only
    on its schedule (no table within the wait)."""
    from deltalake import DeltaTable

    max_lag = 120  # the job (JVM start included) must take under half of it: 20-30 s on a loaded 2-core runner
    ref = reference_store
    m = mount_store(options=[TIER_OPTS + f",spark.master=local[2],compaction.enabled=true,compaction.stages=archive,"
                                         f"compaction.interval_seconds=86400,archive.max_lag_seconds={max_lag},"
                                         f"archive.retention_days=3650"])
    (m.mnt / "brokerIdentity").write_text("DefaultCluster#broker-x#0")  # what a 5.x controller-mode broker writes
    copy_in(ref, m.mnt)
    logs = [p for p in segments(ref) if p.startswith("commitlog/")]
    wait_for(lambda: sum(by_path(m).get(p, {}).get("state") == "tiered" for p in logs) >= len(logs) - 1,
             timeout=90, what="CommitLog segments tiered")
    tiered = [p for p in logs if by_path(m).get(p, {}).get("state") == "tiered"]
    want = Counter()
    for rel in tiered:
        for _, rec in cl.iter_records((ref / rel).read_bytes()):
            if isinstance(rec, cl.Message):
                want[(rec.topic, rec.queue_id, rec.queue_offset)] += 1
    table = m.state_dir / "objects" / "tables" / "messages"

    def in_table() -> bool:
        if not (table / "_delta_log").is_dir():
            return False
        t = DeltaTable(str(table)).to_pyarrow_table(columns=["topic", "queue_id", "queue_offset"])
        got = Counter(zip(*(t.column(c).to_pylist() for c in ("topic", "queue_id", "queue_offset"))))
        return all(got[k] == n for k, n in want.items())

    wait_for(in_table, timeout=4 * max_lag, what="the tiered segments' messages in the archive table")
    wait_for(lambda: status(m)["compaction"].get("archive_last_lag_seconds") is not None, timeout=60,
             what="the daemon applying the archive job")
    c = status(m)["compaction"]
    print(f"\narchive lag: {c['archive_last_lag_seconds']} s measured, {max_lag} s allowed")
    assert 0 < c["archive_last_lag_seconds"] <= max_lag, c
    # the rows carry the brokerName the broker recorded in its store root (archive.broker_name unset)
    assert DeltaTable(str(table)).to_pyarrow_table(columns=["broker"]).column("broker").unique().to_pylist() == \
        ["broker-x"]
    assert c["archive_max_lag_seconds"] == max_lag
    text = (m.ctl / "metrics").read_text()
    last = float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("tierfs_archive_last_lag_seconds ")))
    assert 0 < last <= max_lag
    assert "tierfs_archive_lag_seconds " in text
    assert "archive lag:" in tierfs("status", str(m.mnt)).stdout
    jobs = [json.loads(p.read_text()) for p in (m.state_dir / "jobs").glob("*/input.json")]
    assert jobs and all(j["stages"] == ["archive"] and j["trigger"] == "freshness" for j in jobs), jobs
    # archive.retention_days: the daemon's first job also expires the table (nothing is 10 years old here)
    expiring = [p.parent for p in (m.state_dir / "jobs").glob("*/input.json")
                if json.loads(p.read_text())["table_expiry"] == {"retention_days": 3650, "vacuum_grace_hours": 168}]
    assert expiring
    assert json.loads((expiring[0] / "result.json").read_text())["table_expiry"]["deleted_rows"] == 0
