#!/usr/bin/env python3
"""Cold-read benchmark: reads of an evicted CommitLog segment through tierfs vs. boto3 and rclone, same server.

One run starts a throwaway single-node Ceph RGW on 127.0.0.1 (tests/ceph_rgw.py) and one tierfs mount with
objectstore.url=s3://BUCKET/tierfs on it (small cache budget, short seal times), then:

  setup  A real sealed CommitLog segment of --size bytes (message records with real offsets, KEYS/UNIQ_KEY/TAGS
         properties and body CRCs, ended by a valid BLANK; format §4.5, §12) is generated locally, written
         through the mount (1 MiB writes, fsync), sealed, uploaded as chunk objects and fully evicted
         (status.json resident_bytes == 0). The same bytes are also uploaded as ONE object for rclone.
  seq    Sequential 1 MiB reads of the whole evicted file (posix_fadvise DONTNEED first, checked with mincore):
           tierfs   through the mount;
           boto3    parallel ranged GETs of the same chunk objects, objectstore.max_concurrency in flight, best
                    of --part-sizes (the fastest a client could fetch those bytes at that concurrency);
           rclone   `rclone mount` of the single object, fresh cache dir (cold), at each of RCLONE_SETTINGS (its
                    documented settings for large sequential reads; the kernel read-ahead tierfs has): the best.
         Ratios tierfs/boto3 (aim >= 0.9) and tierfs/rclone (aim >= 1.5), in MB/s; daemon CPU per byte against the
         boto3 client's CPU per byte of its best part size (aim <= 1.0).
  local  Share of FUSE reads the engine answered without waiting on the network during the tierfs sequential
         read (engine counters reads_local / (reads_local + reads_waited)); aim >= 95 %.
  rand   Random 4 KiB reads of the evicted file (distinct blocks, never near the previous read, fadvise RANDOM):
         p50 / p99 latency through the mount vs. a boto3 4 KiB ranged GET of the same bytes.
  multi  With --readers N: N evicted segments of --size (N-1 more written the same way) read sequentially at
         once, one thread each, vs boto3 ranged GETs of all their chunk objects with the same total concurrency
         (aim >= 0.9); the daemon's peak RSS over the phase (aim <= readahead.budget_bytes + 200 MiB).
  ceiling  Context, no aim: the same bytes as a never-tiered file in the same mount (backing file in the page
         cache, as RGW's memstore holds its objects in RAM), read the same way: what the FUSE path alone allows.

Every byte read on every side is checked against the reference (crc32c per MiB, bytes for 4 KiB reads).
With --repeat N the sides alternate order and each ratio is the median of the paired per-repetition ratios.
Every tierfs measurement starts from 0 bytes of its segments local: the bench asks the daemon for eviction passes
(SIGUSR1, as `tierfs evict` does) until no block is resident, checks it, and reports it. If the mount's bdi read_ahead_kb is not mount.read_ahead_kb, it is re-applied and
the report says so. The daemon can be profiled (--py-spy, --perf) or run from another tree (--tierfs-src).
With --ab-src DIR a second mount runs the daemon from DIR (e.g. a checkout of main) on the same RGW (its own
object prefix, same segment bytes) and is measured the same way in every repetition, alternating order: the
report adds same-run ratios this tree / that tree (sequential MB/s, daemon CPU, random p50/p99).

    .venv/bin/python bench/cold_read.py                      # 1 GiB, defaults, about 3 minutes on 2 cores
    .venv/bin/python bench/cold_read.py --repeat 3 --json out.json
    .venv/bin/python bench/cold_read.py --size 256MiB -o readahead.max_blocks=128 --py-spy /tmp/prof
    .venv/bin/python bench/cold_read.py --size 256MiB --no-rclone --ab-src /work/wt/base13 --repeat 3
    .venv/bin/python bench/cold_read.py --size 64MiB --readers 8 --no-rclone --no-ceiling --repeat 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common as C  # noqa: E402

from tierfs.config import parse_size  # noqa: E402
from tierfs.store import commitlog as cl  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
PIECE = MiB  # granularity of the reference crc32c list every sequential read is checked against
SEGMENT = "commitlog/00000000000000000000"
RCLONE_KEY = "rclone/00000000000000000000"
LOCAL_COPY = "bench-local/segment-copy"  # not a segment path: never tiered, always served from the hot dir
BASE_OPTS = ("tiering.enabled=true,cache.max_bytes=64MiB,seal.quiet_seconds=1,seal.scan_interval_seconds=0.5,"
             "delete.grace_seconds=0,compaction.enabled=false")
AIMS = {"boto3": 0.9, "rclone": 1.5, "local": 0.95, "cpu": 1.0}
# rclone mount settings tried for one large sequential read (rclone's VFS docs): streaming with no local cache and a
# large in-memory read-ahead (`--buffer-size`) over chunked ranged GETs, and the full VFS cache with a large
# `--vfs-read-ahead`. Every one also gets the kernel read-ahead tierfs has (`--max-read-ahead` and the bdi
# read_ahead_kb = mount.read_ahead_kb). The best one per repetition is the baseline.
RCLONE_SETTINGS: dict[str, list[str]] = {
    "off,buffer 64M,chunk 16M": ["--vfs-cache-mode", "off", "--buffer-size", "64M", "--vfs-read-chunk-size", "16M",
                                 "--vfs-read-chunk-size-limit", "off"],
    "off,buffer 256M,chunk 128M": ["--vfs-cache-mode", "off", "--buffer-size", "256M"],
    # in-order FUSE reads: with async reads the kernel's read-ahead requests can arrive out of order, and an
    # uncached rclone file handle then seeks (a new ranged GET) instead of reading on
    "off,buffer 64M,sync reads": ["--vfs-cache-mode", "off", "--buffer-size", "64M", "--async-read=false"],
    "full,read-ahead 256M": ["--vfs-cache-mode", "full", "--buffer-size", "64M", "--vfs-read-ahead", "256M"],
}


# ======================================================================================== the segment


def write_commitlog_segment(path: Path, size: int, seed: int = 7, topics: int = 2, queues: int = 4,
                            base_offset: int = 0) -> dict:
    """A sealed CommitLog segment as the broker leaves it at a roll (the one starting at CommitLog offset
    `base_offset`, which is its file name): records back to back from 0 (bodies of
    512..1536 bytes cut from a seeded random pool, real PHYSICALOFFSET/QUEUEOFFSET/timestamps, KEYS, UNIQ_KEY and
    TAGS properties), then the BLANK whose TOTALSIZE is what remains, then zeros. Checked with the seal rule."""
    rnd = random.Random(seed)
    pool = rnd.randbytes(4 * MiB + 2048)
    packers = [cl.RecordPacker(f"BenchTopic{t}".encode()) for t in range(topics)]
    qoff = [[0] * queues for _ in range(topics)]
    uniq = rnd.randbytes(10).hex().upper()
    flush_at = 8 * MiB
    buf = bytearray(flush_at + 64 * 1024)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        base, pos, seq = 0, 0, 0  # base: file offset of buf[0]
        ts = 1_700_000_000_000
        while True:
            t, q = seq % topics, (seq // topics) % queues
            body_len = 512 + (seq * 0x9E3779B1 >> 7) % 1025
            start = (seq * 7919) % (4 * MiB)
            body = memoryview(pool)[start:start + body_len]
            props = b"KEYS\x01k-%d\x02UNIQ_KEY\x01%s%012X\x02TAGS\x01Tag%c\x02WAIT\x01true\x02" % (
                seq, uniq.encode(), seq, 65 + seq % 3)
            total = packers[t].size(body_len, len(props))
            if base + pos + total + cl.BLANK_SIZE > size:
                break
            packers[t].pack_into(buf, pos, body, props, queue_id=q, queue_offset=qoff[t][q],
                                 physical_offset=base_offset + base + pos, store_timestamp=ts + seq // 100,
                                 born_timestamp=ts + seq // 100)
            qoff[t][q] += 1
            pos += total
            seq += 1
            if pos >= flush_at:
                os.pwrite(fd, memoryview(buf)[:pos], base)
                base, pos = base + pos, 0
        blank_at = base + pos
        buf[pos:pos + cl.BLANK_SIZE] = cl.encode_blank(size - blank_at)
        os.pwrite(fd, memoryview(buf)[:pos + cl.BLANK_SIZE], base)
        os.ftruncate(fd, size)
        os.fsync(fd)
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            end = cl.sealed_commitlog_end(m, size)
    finally:
        os.close(fd)
    if end != blank_at:
        raise RuntimeError(f"generated segment fails the CommitLog seal rule (BLANK expected at {blank_at}, "
                           f"seal check says {end})")
    return {"messages": seq, "blank_at": blank_at}


def piece_crcs(path: Path) -> list[int]:
    """crc32c of every PIECE of the reference file."""
    out = []
    with open(path, "rb") as f:
        while chunk := f.read(PIECE):
            out.append(crc32c.crc32c(chunk))
    return out


class Verifier:
    """Checks a sequential stream against the per-PIECE crc32c list, whatever sizes the reads come in."""

    def __init__(self, crcs: list[int], size: int):
        self.crcs, self.size = crcs, size
        self.pos, self.crc, self.bad = 0, 0, []

    def feed(self, data: memoryview) -> None:
        while len(data):
            fill = self.pos % PIECE
            n = min(len(data), PIECE - fill)
            self.crc = crc32c.crc32c(data[:n], self.crc)
            self.pos += n
            data = data[n:]
            if self.pos % PIECE == 0 or self.pos == self.size:
                if self.crc != self.crcs[(self.pos - 1) // PIECE]:
                    self.bad.append((self.pos - 1) // PIECE * PIECE)
                self.crc = 0

    def check(self, what: str) -> None:
        if self.pos != self.size or self.bad:
            raise RuntimeError(f"{what}: read {self.pos} of {self.size} bytes; wrong bytes in the MiB at offsets "
                               f"{self.bad[:5]}")


# ======================================================================================== sequential reads


def read_file_sequential(path: Path, crcs: list[int], size: int, block: int = MiB) -> dict:
    """Drop the file's page cache, then one timed sequential read with `block`-byte reads, verified."""
    C.evict(path)
    cached = C.resident_fraction(path)
    buf = bytearray(block)
    mv = memoryview(buf)
    v = Verifier(crcs, size)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while (n := os.readv(fd, [mv])) > 0:
            v.feed(mv[:n])
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    v.check(str(path))
    return {"MBps": size / dt / 1e6, "seconds": dt, "resident_before": round(cached, 4)}


def s3_client(endpoint: str, ak: str, sk: str, pool: int):
    """A plain boto3 client as a tuned application would make it: path style, a pool as large as the
    concurrency, no default checksums (botocore >= 1.36 would checksum every ranged read)."""
    import boto3
    from botocore.config import Config

    kw: dict[str, Any] = dict(s3={"addressing_style": "path"}, max_pool_connections=pool, connect_timeout=5,
                              read_timeout=60, retries={"total_max_attempts": 3}, tcp_keepalive=True)
    try:
        cfg = Config(request_checksum_calculation="when_required", response_checksum_validation="when_required",
                     **kw)
    except TypeError:
        cfg = Config(**kw)
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                          aws_access_key_id=ak, aws_secret_access_key=sk, config=cfg)


def boto3_sequential(client, bucket: str, keys: list[str], chunk: int, size: int, part: int, concurrency: int,
                     crcs: list[int]) -> dict:
    """All bytes of the chunk objects by ranged GETs of `part` bytes, `concurrency` in flight, each verified."""
    ranges = [(i, off, min(part, min(chunk, size - i * chunk) - off))
              for i in range(len(keys)) for off in range(0, min(chunk, size - i * chunk), part)]

    def get(r: tuple[int, int, int]) -> tuple[int, list[int]]:
        i, off, n = r
        body = client.get_object(Bucket=bucket, Key=keys[i], Range=f"bytes={off}-{off + n - 1}")["Body"]
        data = memoryview(body.read())
        body.close()
        if len(data) != n:
            raise RuntimeError(f"{keys[i]} {off}+{n}: got {len(data)} bytes")
        g = i * chunk + off
        bad = [g + p for p in range(0, n, PIECE) if crc32c.crc32c(data[p:p + PIECE]) != crcs[(g + p) // PIECE]]
        return n, bad

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: client.head_object(Bucket=bucket, Key=keys[i % len(keys)]), range(concurrency)))
        t0 = time.perf_counter()
        got, bad = 0, []
        for n, b in pool.map(get, ranges):
            got += n
            bad += b
        dt = time.perf_counter() - t0
    if got != size or bad:
        raise RuntimeError(f"boto3 read {got} of {size} bytes; wrong bytes in the MiB at {bad[:5]}")
    return {"MBps": size / dt / 1e6, "seconds": dt, "part": part, "requests": len(ranges)}


class RcloneMount:
    """`rclone mount REMOTE MNT SETTINGS` in the foreground as our child (own session), with a fresh cache dir and
    the kernel read-ahead `read_ahead_kb`; unmounted with fusermount and stopped by its PID on exit."""

    def __init__(self, conf: Path, remote: str, mnt: Path, cache_dir: Path, log_file: Path,
                 settings: list[str], read_ahead_kb: int):
        self.mnt, self.cache_dir, self.log_file = mnt, cache_dir, log_file
        self.read_ahead_kb = read_ahead_kb
        self.cmd = ["rclone", "--config", str(conf), "mount", remote, str(mnt), *settings,
                    "--max-read-ahead", f"{read_ahead_kb}K", "--cache-dir", str(cache_dir), "--read-only",
                    "--log-file", str(log_file), "--log-level", "INFO"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "RcloneMount":
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # rclone's AWS SDK refuses to start when AWS_CA_BUNDLE is set ("HTTPClient's transport unsupported
        # type"); the endpoint is plain http on 127.0.0.1, so the bundle is irrelevant to it
        env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, env=env)
        try:
            deadline = time.monotonic() + 30
            while not C._mounted(self.mnt):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"rclone mount did not come up (rc {self.proc.poll()}):\n{self.log_tail()}")
                time.sleep(0.05)
            if self.read_ahead_kb:
                dev = os.stat(self.mnt).st_dev
                Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").write_text(
                    str(self.read_ahead_kb))
        except BaseException:
            self.__exit__()
            raise
        return self

    def log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        return "(no log)"

    def __exit__(self, *exc: Any) -> None:
        if C._mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True, check=False)
        if self.proc is not None:
            for sig, wait in ((None, 10.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                if sig is not None and self.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.proc.pid, sig)
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if C._mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True, check=False)
        shutil.rmtree(self.cache_dir, ignore_errors=True)


# ======================================================================================== concurrent readers


def multi_segments(size: int, readers: int) -> list[str]:
    """The CommitLog segments the concurrent readers read: the bench segment and the ones after it."""
    return [f"commitlog/{i * size:020d}" for i in range(readers)]


def write_multi_segments(mnt: C.TierfsMount, base: Path, size: int, readers: int) -> dict[str, list[int]]:
    """Segments 2..N of the concurrent-reader phase, written through the mount like the first; their per-MiB
    crc32c lists (the first segment's is the caller's)."""
    crcs: dict[str, list[int]] = {}
    for i, rel in enumerate(multi_segments(size, readers)[1:], start=1):
        ref = base / f"reference-segment-{i}"
        write_commitlog_segment(ref, size, seed=7 + i, base_offset=i * size)
        crcs[rel] = piece_crcs(ref)
        with open(ref, "rb") as src, open(mnt.mnt / rel, "wb") as dst:
            shutil.copyfileobj(src, dst, MiB)
            dst.flush()
            os.fsync(dst.fileno())
        ref.unlink()
    return crcs


def force_evicted(mnt: C.TierfsMount, rels: list[str], timeout: float = 300) -> int:
    """Make every tierfs measurement start from 0 bytes of `rels` local: wait until they are tiered, then ask the
    daemon for eviction passes (SIGUSR1, as `tierfs evict` does) until none of their blocks is resident (a pass
    skips a segment read within the last second). Returns the bytes resident, 0, or raises."""
    def files() -> dict[str, dict]:
        return {f["path"]: f for f in mnt.status().get("files", [])}

    wait_until(lambda: all(files().get(r, {}).get("state") == "tiered" for r in rels), timeout,
               f"{len(rels)} segments tiered")
    deadline = time.monotonic() + timeout
    while True:
        now = files()
        resident = sum(int(now[r].get("resident_bytes", 0)) for r in rels)
        if resident == 0:
            return 0
        if time.monotonic() > deadline:
            raise RuntimeError(f"{resident} bytes of {rels} stay resident after {timeout:g} s of eviction passes")
        asked = mnt.status()["evict_now"]["requested"]
        os.kill(mnt.pid, signal.SIGUSR1)

        def served() -> bool:
            st = mnt.status()["evict_now"]
            return st["requested"] > asked and st["done"] >= st["requested"]

        wait_until(served, 60, "the daemon's eviction pass")


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM afresh (/proc/PID/clear_refs, 5), so the peak is the one of the phase measured next."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def run_multi_boto3(mnt: C.TierfsMount, client, bucket: str, crcs: dict[str, list[int]], chunk: int, size: int,
                    parts: list[int], conc: int) -> dict:
    """The same bytes by ranged GETs of all the segments' chunk objects, `conc` in flight in all, best part size
    (the segments one after the other in the list: the GETs in flight span several of them)."""
    files = {f["path"]: f for f in mnt.status().get("files", [])}
    keys = [f"tierfs/{k}" for rel in crcs for k in files[rel]["objects"]]
    all_crcs = [c for rel in crcs for c in crcs[rel]]
    return run_boto3_seq(client, bucket, keys, chunk, len(crcs) * size, parts, conc, all_crcs)


def run_tierfs_multi(mnt: C.TierfsMount, crcs: dict[str, list[int]], size: int) -> dict:
    """Every segment read sequentially at once, one thread per segment (each verified): aggregate MB/s, daemon
    CPU and its peak RSS over the phase (aim: within readahead.budget_bytes + 200 MiB)."""
    rels = list(crcs)
    resident = force_evicted(mnt, rels)
    reset_peak_rss(mnt.pid)
    cpu0 = C.daemon_cpu_seconds(mnt.pid)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(rels)) as pool:
        each = list(pool.map(lambda r: read_file_sequential(mnt.mnt / r, crcs[r], size), rels))
    dt = time.perf_counter() - t0
    return {"MBps": len(rels) * size / dt / 1e6, "seconds": dt, "readers": len(rels),
            "daemon_cpu_s": round(C.daemon_cpu_seconds(mnt.pid) - cpu0, 2), "daemon_peak_rss_mb": peak_rss_mb(mnt.pid),
            "slowest_reader_MBps": min(r["MBps"] for r in each), "resident_before": resident}


# ======================================================================================== random reads


def random_offsets(size: int, block: int, n: int, seed: int) -> list[int]:
    """4 KiB-aligned offsets in n distinct blocks (never block 0, whose first page is pinned), none within a block
    of the previous read so no read looks sequential to the engine's detector."""
    rnd = random.Random(seed)
    blocks = rnd.sample(range(1, size // block), min(n * 2, size // block - 1))
    out: list[int] = []
    for b in blocks:
        off = b * block + rnd.randrange(block // 4096) * 4096
        if out and abs(off - out[-1]) <= block + 4096:
            continue
        out.append(off)
        if len(out) == n:
            break
    return out


def pread_4k(fd: int, off: int) -> bytes:
    return os.pread(fd, 4096, off)


def timed_reads(read: Callable[[int], bytes], offsets: list[int], ref_fd: int) -> list[float]:
    """Latency (ms) of each 4 KiB read, every result checked against the reference outside the timing."""
    lat = []
    for off in offsets:
        t = time.perf_counter()
        data = read(off)
        lat.append((time.perf_counter() - t) * 1e3)
        if data != os.pread(ref_fd, 4096, off):
            raise RuntimeError(f"4 KiB read at {off} returned wrong bytes")
    return lat


def lat_summary(lat: list[float]) -> dict:
    s = sorted(lat)
    return {"p50_ms": C.percentile(s, 0.5), "p99_ms": C.percentile(s, 0.99), "mean_ms": sum(s) / len(s),
            "n": len(s)}


# ======================================================================================== the run


wait_until = C.wait_until


def segment_status(mnt: C.TierfsMount) -> dict:
    return next((f for f in mnt.status().get("files", []) if f["path"] == SEGMENT), {})


def wait_evicted(mnt: C.TierfsMount, timeout: float = 300) -> tuple[float, int]:
    """Wait until the segment is tiered with no resident block, as the engine gets there by itself (seal, upload,
    eviction under the budget); returns (seconds waited, resident bytes)."""
    def evicted() -> bool:
        f = segment_status(mnt)
        return f.get("state") == "tiered" and f.get("resident_bytes") == 0

    def progress() -> str:
        f = segment_status(mnt)
        return f"state {f.get('state', 'not cataloged')}, resident {f.get('resident_bytes', '?')} bytes"

    waited = wait_until(evicted, timeout, f"{SEGMENT} tiered and evicted (is cache.max_bytes small?)", progress)
    return waited, int(segment_status(mnt).get("resident_bytes", 0))


def engine_counters(mnt: C.TierfsMount) -> dict:
    return dict(mnt.status()["totals"].get("engine", {}))


def counters_delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a.get(k, 0) for k in b if isinstance(b[k], (int, float)) and not isinstance(b[k], bool)}


def peak_rss_mb(pid: int) -> float | None:
    """The daemon's peak resident set so far (VmHWM), in MB: the read-ahead buffers are bounded by
    readahead.budget_bytes, and this shows it."""
    with contextlib.suppress(OSError):
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmHWM:"):
                return round(int(ln.split()[1]) / 1024, 1)
    return None


def run_tierfs_seq(mnt: C.TierfsMount, crcs: list[int], size: int, prof: Path | None, rate: int,
                   perf: Path | None = None) -> dict:
    resident = force_evicted(mnt, [SEGMENT])
    path = mnt.mnt / SEGMENT
    e0, s0 = engine_counters(mnt), mnt.stats()
    cpu0 = C.daemon_cpu_seconds(mnt.pid)
    # the peak of this read, not of the daemon's life: the seal maps the whole segment it checks (file pages,
    # counted in VmHWM), which showed as a 1.1 GB "peak" of a 1 GiB read with 60 MB of anonymous memory
    reset_peak_rss(mnt.pid)
    with contextlib.ExitStack() as stack:
        if prof:
            stack.enter_context(C.py_spy_record(mnt.pid, prof, rate=rate))
        if perf:
            stack.enter_context(C.perf_record(mnt.pid, perf))
        res = read_file_sequential(path, crcs, size)
    res["daemon_cpu_s"] = round(C.daemon_cpu_seconds(mnt.pid) - cpu0, 2)
    res["daemon_peak_rss_mb"] = peak_rss_mb(mnt.pid)
    res["segment_resident_before"] = resident
    d = counters_delta(e0, engine_counters(mnt))
    res["engine"] = {k: d.get(k, 0) for k in ("reads_local", "reads_waited", "fetches", "fetch_bytes",
                                              "prefetch_bytes", "fetch_errors")}
    n = d.get("reads_local", 0) + d.get("reads_waited", 0)
    res["local_share"] = d.get("reads_local", 0) / n if n else float("nan")
    res["fuse"] = C.stats_delta(s0, mnt.stats())
    if prof:
        res["profile"] = str(prof)
    if perf:
        res["perf_data"] = str(perf)
    return res


def run_boto3_seq(client, bucket: str, keys: list[str], chunk: int, size: int, parts: list[int], conc: int,
                  crcs: list[int]) -> dict:
    runs = []
    for p in parts:
        cpu0 = time.process_time()
        runs.append(boto3_sequential(client, bucket, keys, chunk, size, p, conc, crcs))
        runs[-1]["client_cpu_s"] = round(time.process_time() - cpu0, 2)
    best = max(runs, key=lambda r: r["MBps"])
    return {"MBps": best["MBps"], "part": best["part"], "client_cpu_s": best["client_cpu_s"],
            "by_part": {r["part"]: round(r["MBps"], 1) for r in runs}}


def run_rclone_seq(base: Path, conf: Path, bucket: str, crcs: list[int], size: int, rep: int,
                   read_ahead_kb: int) -> dict:
    """The single object read through a fresh `rclone mount` per setting of RCLONE_SETTINGS (in a rotating order);
    the best one, with every setting's MB/s and rclone's CPU (a helper process: counted like the daemon's)."""
    names = list(RCLONE_SETTINGS)
    names = names[rep % len(names):] + names[:rep % len(names)]
    runs: dict[str, dict] = {}
    for i, name in enumerate(names):
        mnt = base / f"rclone-mnt-{rep}-{i}"
        with RcloneMount(conf, f"rgw:{bucket}/{Path(RCLONE_KEY).parent}", mnt, base / f"rclone-cache-{rep}-{i}",
                         base / f"rclone-{rep}-{i}.log", RCLONE_SETTINGS[name], read_ahead_kb) as rc:
            assert rc.proc is not None
            cpu0 = C.daemon_cpu_seconds(rc.proc.pid)
            runs[name] = read_file_sequential(mnt / Path(RCLONE_KEY).name, crcs, size)
            runs[name]["rclone_cpu_s"] = round(C.daemon_cpu_seconds(rc.proc.pid) - cpu0, 2)
    best = max(runs, key=lambda n: runs[n]["MBps"])
    return {**runs[best], "settings": best, "by_settings": {n: round(r["MBps"], 1) for n, r in runs.items()}}


def run_random(mnt: C.TierfsMount, client, bucket: str, keys: list[str], chunk: int, block: int, size: int,
               ref: Path, n: int, rep: int) -> dict:
    offsets = random_offsets(size, block, n + 5, seed=1000 + rep)
    warm, offsets = offsets[:5], offsets[5:]
    path = mnt.mnt / SEGMENT
    out: dict = {}
    ref_fd = os.open(ref, os.O_RDONLY)
    try:
        def via_boto3(off: int) -> bytes:
            body = client.get_object(Bucket=bucket, Key=keys[off // chunk],
                                     Range=f"bytes={off % chunk}-{off % chunk + 4095}")["Body"]
            try:
                return body.read()
            finally:
                body.close()

        for side in (("tierfs", "boto3") if rep % 2 == 0 else ("boto3", "tierfs")):
            if side == "boto3":
                timed_reads(via_boto3, warm, ref_fd)
                out["boto3"] = lat_summary(timed_reads(via_boto3, offsets, ref_fd))
                continue
            out["tierfs_resident_before"] = force_evicted(mnt, [SEGMENT])
            C.evict(path)
            e0, s0 = engine_counters(mnt), mnt.stats()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                via_mount = functools.partial(pread_4k, fd)
                timed_reads(via_mount, warm, ref_fd)
                lat = timed_reads(via_mount, offsets, ref_fd)
            finally:
                os.close(fd)
            out["tierfs"] = lat_summary(lat)
            d = counters_delta(e0, engine_counters(mnt))
            out["tierfs"]["engine"] = {k: d.get(k, 0) for k in ("reads_local", "reads_waited", "fetches",
                                                                 "fetch_bytes", "prefetch_bytes")}
            out["tierfs"]["fuse"] = C.stats_delta(s0, mnt.stats())
    finally:
        os.close(ref_fd)
    return out


def check_readahead(mnt: C.TierfsMount, want_kb: int) -> str:
    """The daemon sets the mount's bdi read_ahead_kb (mount.read_ahead_kb) right after mounting, best effort; under
    load it has been seen at the kernel's 128 KiB instead, and the kernel then sends 128 KiB READs, not 1 MiB ones.
    Measure the configured value: re-apply it, and say so (with the daemon's own log lines) in the report."""
    said: list[str] = []
    time.sleep(0.5)
    have = mnt.kernel_tuning().get("read_ahead_kb")
    if not want_kb or have is None or have == want_kb:
        return ""
    C.set_bdi(mnt, [f"read_ahead_kb={want_kb}"])
    with contextlib.suppress(OSError):
        said = [ln for ln in (mnt.hot / ".tierfs" / "tierfs.log").read_text().splitlines() if "read_ahead" in ln]
    msg = (f"mount read_ahead_kb was {have} instead of mount.read_ahead_kb={want_kb} (daemon log: "
           f"{' | '.join(said) or 'nothing'}); re-applied")
    C.log("WARNING: " + msg)
    return msg


def rclone_conf(path: Path, endpoint: str, ak: str, sk: str) -> None:
    path.write_text(f"[rgw]\ntype = s3\nprovider = Ceph\nenv_auth = false\naccess_key_id = {ak}\n"
                    f"secret_access_key = {sk}\nendpoint = {endpoint}\nregion = us-east-1\n")
    path.chmod(0o600)


def summarize(reps: list[dict], with_rclone: bool, with_ceiling: bool) -> list[dict]:
    """One row per figure: medians over repetitions, the ratio being the median of the paired ratios."""
    def seq(side: str) -> list[tuple[float, float]]:
        return [(r["seq"][side]["MBps"], r["seq"]["tierfs"]["MBps"]) for r in reps]

    rows = [{"metric": f"seq read vs boto3 ranged GETs (c={reps[0]['concurrency']}, best part)", "unit": "MB/s",
             "aim": f">= {AIMS['boto3']}", **_pairs_stats(seq("boto3"))}]
    rows[-1]["pass"] = rows[-1]["ratio"] >= AIMS["boto3"]
    cpu = [(r["seq"]["boto3"]["client_cpu_s"], r["seq"]["tierfs"]["daemon_cpu_s"]) for r in reps]
    rows.append({"metric": "seq read CPU/GiB: daemon vs boto3 client", "unit": "s/GiB", "aim": f"<= {AIMS['cpu']}",
                 **_pairs_stats([(b * GiB / reps[0]["size"], t * GiB / reps[0]["size"]) for b, t in cpu])})
    rows[-1]["pass"] = rows[-1]["ratio"] <= AIMS["cpu"]
    if with_rclone:
        rows.append({"metric": "seq read vs rclone mount (cold, best settings)", "unit": "MB/s",
                     "aim": f">= {AIMS['rclone']}", **_pairs_stats(seq("rclone"))})
        rows[-1]["pass"] = rows[-1]["ratio"] >= AIMS["rclone"]
    if with_ceiling:  # context: the same bytes, local, through the same mount; tierfs column = that read
        pairs = [(r["seq"]["boto3"]["MBps"], r["seq"]["ceiling"]["MBps"]) for r in reps]
        rows.append({"metric": "  (ceiling: never-tiered local copy via mount vs boto3)", "unit": "MB/s", "aim": "-",
                     **_pairs_stats(pairs)})
    for q in ("p50", "p99"):
        rows.append({"metric": f"random 4 KiB read {q} vs boto3 4 KiB GET", "unit": "ms", "aim": "-",
                     **_pairs_stats([(r["rand"]["boto3"][f"{q}_ms"], r["rand"]["tierfs"][f"{q}_ms"])
                                     for r in reps])})
    if "tierfs_b" in reps[0]["seq"]:  # same-run A/B: this tree vs the --ab-src tree
        rows.append({"metric": "A/B seq read: this tree vs --ab-src tree", "unit": "MB/s", "aim": "-",
                     **_pairs_stats([(r["seq"]["tierfs_b"]["MBps"], r["seq"]["tierfs"]["MBps"]) for r in reps])})
        rows.append({"metric": "A/B daemon CPU of the seq read", "unit": "s", "aim": "-",
                     **_pairs_stats([(r["seq"]["tierfs_b"]["daemon_cpu_s"], r["seq"]["tierfs"]["daemon_cpu_s"])
                                     for r in reps])})
        for q in ("p50", "p99"):
            rows.append({"metric": f"A/B random 4 KiB read {q}", "unit": "ms", "aim": "-",
                         **_pairs_stats([(r["rand_b"]["tierfs"][f"{q}_ms"], r["rand"]["tierfs"][f"{q}_ms"])
                                         for r in reps])})
    if "multi" in reps[0]:
        rows.append({"metric": f"{reps[0]['multi']['tierfs']['readers']} concurrent seq readers vs boto3 (same c)",
                     "unit": "MB/s", "aim": ">= 0.9",
                     **_pairs_stats([(r["multi"]["boto3"]["MBps"], r["multi"]["tierfs"]["MBps"]) for r in reps])})
        rows[-1]["pass"] = rows[-1]["ratio"] >= 0.9
    shares = [r["seq"]["tierfs"]["local_share"] for r in reps]
    rows.append({"metric": "FUSE reads answered without waiting (seq)", "unit": "%", "baseline": None,
                 "tierfs": 100 * C.median(shares), "ratio": None, "ratio_min": 100 * min(shares),
                 "ratio_max": 100 * max(shares), "aim": f">= {AIMS['local'] * 100:.0f}%",
                 "pass": C.median(shares) >= AIMS["local"]})
    return rows


def _pairs_stats(pairs: list[tuple[float, float]]) -> dict:
    ratios = [t / b for b, t in pairs if b]
    return {"baseline": C.median(b for b, _ in pairs), "tierfs": C.median(t for _, t in pairs),
            "ratio": C.median(ratios), "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None)}


def print_report(rows: list[dict], reps: list[dict], setup: dict, args: argparse.Namespace) -> None:
    print()
    print(f"tierfs cold-read benchmark  ({setup['size'] >> 20} MiB sealed CommitLog segment, "
          f"{setup['messages']:,} messages, Ceph RGW on 127.0.0.1; chunk {setup['chunk'] >> 20} MiB, block "
          f"{setup['block'] >> 20} MiB, objectstore.max_concurrency {setup['concurrency']}, "
          f"repeat {len(reps)}; -o {','.join(args.options) or '(bench defaults)'}"
          f"{'; daemon from ' + args.tierfs_src if args.tierfs_src else ''})")
    table = []
    for r in rows:
        lo, hi = r.get("ratio_min"), r.get("ratio_max")
        if r["unit"] == "%":
            rng = f"{lo:.1f}-{hi:.1f}" if lo is not None and lo != hi else "-"
            table.append([r["metric"], r["unit"], "-", f"{r['tierfs']:.1f}", "-", rng, r["aim"],
                          "PASS" if r["pass"] else "MISS"])
            continue
        rng = f"{lo:.2f}-{hi:.2f}" if lo is not None and hi is not None and lo != hi else "-"
        verdict = ("PASS" if r["pass"] else "MISS") if "pass" in r else ""
        table.append([r["metric"], r["unit"], r["baseline"], r["tierfs"], f"{r['ratio']:.2f}", rng, r["aim"],
                      verdict])
    C.print_table(["metric", "unit", "baseline", "tierfs", "tierfs/base", "range", "aim", ""], table)
    last = reps[-1]
    t = last["seq"]["tierfs"]
    print()
    print(f"details (last repetition; {C.DAEMON_CPU_NOTE}):")
    b = last["seq"]["boto3"]
    print(f"  boto3 MB/s by part size: {', '.join(f'{p >> 20} MiB {v}' for p, v in b['by_part'].items())}; "
          f"client CPU of the best {b['client_cpu_s']} s")
    print(f"  tierfs seq: {t['seconds']:.2f} s, daemon CPU {t['daemon_cpu_s']} s, peak RSS "
          f"{t.get('daemon_peak_rss_mb')} MB, engine {json.dumps(t['engine'])}, "
          f"page cache before {t['resident_before']}, segment bytes resident before {t['segment_resident_before']}")
    print(f"  tierfs seq FUSE: {C.format_stats_delta(t['fuse'])}")
    if "tierfs_b" in last["seq"]:
        tb = last["seq"]["tierfs_b"]
        print(f"  --ab-src tierfs seq: {tb['seconds']:.2f} s, daemon CPU {tb['daemon_cpu_s']} s, peak RSS "
              f"{tb.get('daemon_peak_rss_mb')} MB, engine "
              f"{json.dumps(tb['engine'])}, segment bytes resident before {tb['segment_resident_before']}")
        print(f"  --ab-src tierfs seq FUSE: {C.format_stats_delta(tb['fuse'])}")
    if "multi" in last:
        m = last["multi"]["tierfs"]
        print(f"  {m['readers']} concurrent readers: {m['seconds']:.2f} s, slowest reader "
              f"{m['slowest_reader_MBps']:.1f} MB/s, daemon CPU {m['daemon_cpu_s']} s, peak RSS {m['daemon_peak_rss_mb']} MB during the phase "
              f"(readahead.budget_bytes {setup.get('budget', 0) >> 20} MiB + 200 MiB: "
              f"{(setup.get('budget', 0) >> 20) + 200} MiB); boto3 part {last['multi']['boto3']['part'] >> 20} MiB")
    if "ceiling" in last["seq"]:
        c = last["seq"]["ceiling"]
        print(f"  ceiling (local copy) seq: {c['seconds']:.2f} s, daemon CPU {c['daemon_cpu_s']} s, FUSE: "
              f"{C.format_stats_delta(c['fuse'])}")
    if "rclone" in last["seq"]:
        rc = last["seq"]["rclone"]
        print(f"  rclone seq: best {rc['settings']} ({rc['seconds']:.2f} s, rclone CPU {rc['rclone_cpu_s']} s); "
              f"MB/s by settings: {json.dumps(rc['by_settings'])}")
    rt = last["rand"]["tierfs"]
    print(f"  random: {rt['n']} reads per side; tierfs mean {rt['mean_ms']:.2f} ms, boto3 mean "
          f"{last['rand']['boto3']['mean_ms']:.2f} ms; tierfs engine {json.dumps(rt['engine'])}, segment bytes "
          f"resident before {last['rand'].get('tierfs_resident_before')}")
    print(f"  random FUSE: {C.format_stats_delta(rt['fuse'])}")
    print(f"  setup: {json.dumps({k: v for k, v in setup.items() if k.endswith('_s')})}; kernel {setup.get('kernel')}")
    if setup.get("readahead_fixup"):
        print(f"  WARNING: {setup['readahead_fixup']}")
    sys.stdout.flush()


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="CommitLog segment size (default 1GiB)")
    ap.add_argument("--repeat", type=int, default=1, help="repetitions of every measurement; medians reported")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="also write machine-readable results (to FILE, or stdout when no FILE)")
    ap.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE[,...]",
                    help=f"extra `tierfs mount -o` options (after the bench's own: {BASE_OPTS})")
    ap.add_argument("--part-sizes", default="4MiB,16MiB", help="boto3 ranged-GET sizes to try (best one counts)")
    ap.add_argument("--rand-ops", type=int, default=200, help="timed random 4 KiB reads per side")
    ap.add_argument("--no-rclone", action="store_true", help="skip the rclone comparison")
    ap.add_argument("--no-ceiling", action="store_true",
                    help="skip the FUSE ceiling (a never-tiered copy of the bytes read through the mount)")
    ap.add_argument("--readers", type=int, default=0, metavar="N",
                    help="also read N evicted segments of --size at once (N-1 more are written) vs boto3 GETs of all "
                         "their objects at the same total concurrency; 0 (default) skips it")
    ap.add_argument("--bucket", default="tierfs-bench")
    ap.add_argument("--dir", help="base dir for the temp files and mountpoints (default $TMPDIR)")
    ap.add_argument("--py-spy", metavar="DIR", help="record a py-spy profile of the daemon per tierfs seq read")
    ap.add_argument("--py-spy-rate", type=int, default=200)
    ap.add_argument("--perf", metavar="DIR", help="record `perf record -g` of the daemon per tierfs seq read")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (debugging)")
    ap.add_argument("--tierfs-src", metavar="DIR",
                    help="run the daemon from this source tree (prepended to PYTHONPATH), e.g. a patched copy, to "
                         "compare versions; default: the installed tierfs")
    ap.add_argument("--ab-src", metavar="DIR",
                    help="also mount a daemon from this source tree (e.g. a checkout of main) and measure it the "
                         "same way in the same run: same-run A/B ratios")
    args = ap.parse_args(argv)
    if args.ab_src and not (Path(args.ab_src) / "tierfs" / "__init__.py").is_file():
        ap.error(f"--ab-src {args.ab_src}: no tierfs/ package in that directory")
    args.size = parse_size(args.size)
    args.parts = [parse_size(p) for p in args.part_sizes.split(",") if p.strip()]
    if args.size < 64 * MiB or args.size % PIECE:
        ap.error("--size must be a multiple of 1 MiB, at least 64 MiB")
    if args.readers == 1 or args.readers < 0:
        ap.error("--readers must be 0 (off) or at least 2")
    if any(p <= 0 or p % PIECE for p in args.parts):
        ap.error("--part-sizes must be multiples of 1 MiB")
    if not args.no_rclone and shutil.which("rclone") is None:
        ap.error("rclone not found: apt-get install -y rclone (or pass --no-rclone)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    C.install_signal_handlers()
    prof_dir = Path(args.py_spy).resolve() if args.py_spy else None
    perf_dir = Path(args.perf).resolve() if args.perf else None
    for d in (prof_dir, perf_dir):
        if d:
            d.mkdir(parents=True, exist_ok=True)
    size = args.size
    setup: dict = {"size": size}
    reps: list[dict] = []
    # RAM-backed OSD, sized for all it gets: the chunk objects of every segment, the single rclone object, the
    # ceiling's never-tiered copy (continuous tiering uploads it, maybe twice while it is being written), one more
    # tree's worth with --ab-src, and headroom for RGW's own objects and Ceph's full ratio (0.95). A full OSD blocks
    # every write without an error: the daemon's final snapshot then hangs at the unmount.
    stored = (max(args.readers, 1) + (0 if args.no_rclone else 1) + (0 if args.no_ceiling else 2)) * size
    memstore = int(1.25 * (stored * (2 if args.ab_src else 1) + (1 << 30)))
    with C.ceph_rgw(memstore_bytes=max(4 << 30, memstore), keep=args.keep) as rgw, \
            C.temp_base(args.dir, prefix="tierfs-cold-", keep=args.keep) as base:
        bucket = rgw.make_bucket(args.bucket)
        ref = base / "reference-segment"
        t = time.perf_counter()
        C.log(f"generating a sealed {size >> 20} MiB CommitLog segment...")
        setup.update(write_commitlog_segment(ref, size))
        setup["generate_s"] = round(time.perf_counter() - t, 1)
        crcs = piece_crcs(ref)
        s3 = C.rgw_store_options(rgw, bucket, "tierfs")
        opts = [BASE_OPTS, s3, *args.options]
        with contextlib.ExitStack() as ab_stack, \
                C.TierfsMount(base / "hot", base / "mnt", opts, tierfs_src=args.tierfs_src) as mnt:
            mnt_b = None
            if args.ab_src:
                opts_b = [BASE_OPTS, s3.replace(f"s3://{bucket}/tierfs,", f"s3://{bucket}/tierfs-b,"), *args.options]
                mnt_b = ab_stack.enter_context(C.TierfsMount(base / "hot-b", base / "mnt-b", opts_b,
                                                             tierfs_src=args.ab_src))
            cfg = mnt.config()
            conc, chunk, block = (int(cfg["objectstore.max_concurrency"]), int(cfg["objectstore.chunk_bytes"]),
                                  int(cfg["cache.block_bytes"]))
            setup.update(concurrency=conc, chunk=chunk, block=block, budget=int(cfg["readahead.budget_bytes"]))
            setup["readahead_fixup"] = check_readahead(mnt, int(cfg["mount.read_ahead_kb"]))
            C.log(f"mounted (daemon pid {mnt.pid}); writing the segment through the mount...")
            t = time.perf_counter()
            (mnt.mnt / "commitlog").mkdir()
            with open(ref, "rb") as src, open(mnt.mnt / SEGMENT, "wb") as dst:
                shutil.copyfileobj(src, dst, MiB)
                dst.flush()
                os.fsync(dst.fileno())
            setup["write_through_mount_s"] = round(time.perf_counter() - t, 1)
            if mnt_b is not None:
                check_readahead(mnt_b, int(cfg["mount.read_ahead_kb"]))
                (mnt_b.mnt / "commitlog").mkdir()
                with open(ref, "rb") as src, open(mnt_b.mnt / SEGMENT, "wb") as dst:
                    shutil.copyfileobj(src, dst, MiB)
                    dst.flush()
                    os.fsync(dst.fileno())
            multi_crcs: dict[str, list[int]] = {}
            if args.readers and size % chunk:
                raise SystemExit(f"--readers needs --size to be a multiple of objectstore.chunk_bytes ({chunk})")
            if args.readers:
                multi_crcs = {SEGMENT: crcs, **write_multi_segments(mnt, base, size, args.readers)}
            C.log(f"written in {setup['write_through_mount_s']} s; waiting for seal, upload, eviction...")
            setup["tier_and_evict_s"] = round(wait_evicted(mnt, timeout=900)[0], 1)
            if mnt_b is not None:
                wait_evicted(mnt_b, timeout=900)
            seg = segment_status(mnt)
            keys = [f"tierfs/{k}" for k in seg["objects"]]
            C.log(f"tiered as {len(keys)} objects and evicted in {setup['tier_and_evict_s']} s")
            if not args.no_ceiling:
                (mnt.mnt / LOCAL_COPY).parent.mkdir()
                with open(ref, "rb") as src, open(mnt.mnt / LOCAL_COPY, "wb") as dst:
                    shutil.copyfileobj(src, dst, MiB)
                    dst.flush()
                    os.fsync(dst.fileno())
            client = s3_client(rgw.endpoint_url, rgw.access_key, rgw.secret_key, max(conc, 10) + 4)
            conf = base / "rclone.conf"
            if not args.no_rclone:
                t = time.perf_counter()
                from boto3.s3.transfer import TransferConfig

                client.upload_file(str(ref), bucket, RCLONE_KEY,
                                   Config=TransferConfig(multipart_chunksize=64 * MiB, max_concurrency=4))
                setup["single_object_upload_s"] = round(time.perf_counter() - t, 1)
                rclone_conf(conf, rgw.endpoint_url, rgw.access_key, rgw.secret_key)
            for rep in range(args.repeat):
                r: dict = {"concurrency": conc, "size": size, "seq": {}}
                order = ["tierfs", "boto3", "rclone", "ceiling"] + (["tierfs_b"] if mnt_b is not None else [])
                if mnt_b is not None and rep % 2:
                    order = ["tierfs_b"] + order[:-1]  # the two daemons alternate who goes first
                if rep % 2:
                    order.reverse()
                for side in order:
                    if side == "tierfs":
                        prof = prof_dir / f"seq-rep{rep}.speedscope.json" if prof_dir else None
                        perf = perf_dir / f"seq-rep{rep}.perf.data" if perf_dir else None
                        r["seq"]["tierfs"] = run_tierfs_seq(mnt, crcs, size, prof, args.py_spy_rate, perf)
                    elif side == "tierfs_b":
                        prof = prof_dir / f"seq-rep{rep}-ab.speedscope.json" if prof_dir else None
                        r["seq"]["tierfs_b"] = run_tierfs_seq(mnt_b, crcs, size, prof, args.py_spy_rate)
                    elif side == "boto3":
                        r["seq"]["boto3"] = run_boto3_seq(client, bucket, keys, chunk, size, args.parts, conc, crcs)
                    elif side == "rclone" and not args.no_rclone:
                        r["seq"]["rclone"] = run_rclone_seq(base, conf, bucket, crcs, size, rep,
                                                            int(cfg["mount.read_ahead_kb"]))
                    elif side == "ceiling" and not args.no_ceiling:
                        C.read_file_once(mnt.hot / LOCAL_COPY)  # the backing bytes in RAM, like RGW's memstore
                        s0, cpu0 = mnt.stats(), C.daemon_cpu_seconds(mnt.pid)
                        r["seq"]["ceiling"] = read_file_sequential(mnt.mnt / LOCAL_COPY, crcs, size)
                        r["seq"]["ceiling"]["daemon_cpu_s"] = round(C.daemon_cpu_seconds(mnt.pid) - cpu0, 2)
                        r["seq"]["ceiling"]["fuse"] = C.stats_delta(s0, mnt.stats())
                    if side in r["seq"]:
                        C.log(f"rep{rep} seq {side}: {r['seq'][side]['MBps']:.1f} MB/s"
                              + (f" (local share {100 * r['seq'][side]['local_share']:.1f}%, daemon CPU "
                                 f"{r['seq'][side]['daemon_cpu_s']} s)" if side.startswith("tierfs") else ""))
                if multi_crcs:
                    r["multi"] = {}
                    for side in (("tierfs", "boto3") if rep % 2 == 0 else ("boto3", "tierfs")):
                        if side == "tierfs":
                            r["multi"]["tierfs"] = run_tierfs_multi(mnt, multi_crcs, size)
                        else:
                            r["multi"]["boto3"] = run_multi_boto3(mnt, client, bucket, multi_crcs, chunk, size,
                                                                  args.parts, conc)
                        C.log(f"rep{rep} {args.readers} readers {side}: {r['multi'][side]['MBps']:.1f} MB/s")
                r["rand"] = run_random(mnt, client, bucket, keys, chunk, block, size, ref, args.rand_ops, rep)
                if mnt_b is not None:
                    r["rand_b"] = run_random(mnt_b, client, bucket, keys, chunk, block, size, ref, args.rand_ops,
                                             rep)
                    C.log(f"rep{rep} random 4 KiB p50/p99 ms --ab-src: {r['rand_b']['tierfs']['p50_ms']:.2f}/"
                          f"{r['rand_b']['tierfs']['p99_ms']:.2f}")
                C.log(f"rep{rep} random 4 KiB p50/p99 ms: tierfs {r['rand']['tierfs']['p50_ms']:.2f}/"
                      f"{r['rand']['tierfs']['p99_ms']:.2f}, boto3 {r['rand']['boto3']['p50_ms']:.2f}/"
                      f"{r['rand']['boto3']['p99_ms']:.2f}")
                reps.append(r)
            setup["kernel"] = mnt.kernel_tuning()
    rows = summarize(reps, not args.no_rclone, not args.no_ceiling)
    print_report(rows, reps, setup, args)
    if prof_dir:
        print("\ndaemon profiles during the tierfs sequential reads (py-spy, share of samples):")
        for rep, r in enumerate(reps):
            for side in ("tierfs", "tierfs_b"):
                pf = r["seq"].get(side, {}).get("profile")
                if not pf or not Path(pf).exists():
                    continue
                s = C.summarize_speedscope(Path(pf), top=15)
                r["seq"][side]["profile_summary"] = s
                print(f"  rep{rep} {side} ({pf}, {s['samples']:.0f} samples)\n    self:")
                for n, pct in s["self_pct"]:
                    print(f"      {pct:5.1f}%  {n}")
                print("    inclusive:")
                for n, pct in s["inclusive_pct"][:8]:
                    print(f"      {pct:5.1f}%  {n}")
    if perf_dir:
        print("\ndaemon CPU by symbol during the tierfs sequential reads (perf, self time, kernel + user):")
        for rep, r in enumerate(reps):
            pd = r["seq"]["tierfs"].get("perf_data")
            if pd and Path(pd).exists():
                r["seq"]["tierfs"]["perf_top"] = top = C.perf_top_symbols(Path(pd), top=25)
                print(f"  rep{rep} ({pd})")
                for ln in top:
                    print("    " + ln.strip())
    if args.json:
        C.write_json(args.json, {"setup": setup, "options": args.options, "tierfs_src": args.tierfs_src, "summary": rows,
                           "runs": reps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
