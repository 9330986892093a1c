#!/usr/bin/env python3
"""Scale benchmark: a store of many tiny sealed ConsumeQueue files (RocketMQ RIP-66, many topics).

For each N of the sweep (default 10k, 30k, 100k files) one run creates a temp base dir (`--dir`, default $TMPDIR)
holding a native dir, a hot dir and a mountpoint on one filesystem, and writes the same tree into the native and
the hot dir: `consumequeue/<topic>/<queue>/<20-digit offset>`, each file full (`--cq-units` 20-byte units, every
unit valid, unit ends increasing), so the content seal rule holds, with an mtime an hour old, so the quiet period
has passed. Then, with the real CLI:

  1. mount (empty catalog) and wait until every file is sealed and tiered (the daemon's scan at mount finds them):
     seconds, ms per file, objects/s, daemon CPU per file. The catalog is polled read-only with sqlite3.
  2. render MNT/.tierfs/status.json, /status and /metrics (ms); daemon RSS.
  3. unmount; catalog.db size per file.
  4. remount with N catalog rows: mount time (reconcile), then `ls -R` of the mount (its first after mounting, so
     every entry goes through the daemon) vs the native tree (ratio); after the kernel's attribute timeout,
     `os.stat` of --stat-samples random files through the mount vs natively (p50/p99; each mount stat is a FUSE
     LOOKUP), and `statvfs` through the mount (p50).

The native tree is warm (dentries cached: the page cache is never dropped globally); the mount's first `ls -R`
is as cold as FUSE can be made, so its ratio is the whole cost of going through the daemon. Per-file columns
must stay flat as N grows: that is the point of the sweep.

The packing question (--floor-objects): PUT + verifying GET of tiny objects straight into the same object store
(posix default, or --rgw) from a child process, without FUSE or catalog: latency one at a time, throughput from
--floor-threads threads, and CPU per object. Packing N small files into one shared object would save at most that
per file; if it is a small share of the daemon's per-file cost (or the store's throughput far exceeds the
daemon's), requests do not dominate and packing would not pay.

    .venv/bin/python bench/scale.py                                  # sweep 10k,30k,100k
    .venv/bin/python bench/scale.py --n 10000 --json out.json
    .venv/bin/python bench/scale.py --n 30000 --py-spy /tmp/prof     # profile the daemon while it tiers
    .venv/bin/python bench/scale.py --n 10000 --rgw                  # object store: a throwaway Ceph RGW
    .venv/bin/python bench/scale.py --tierfs-src /tmp/before         # the daemon from another tree (A/B)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

CQ_UNIT = struct.Struct(">qiq")  # commitlog offset, size, tags code (format §5)
# the first scan (at mount) finds the pre-existing files; later ones every 30 s (the default); no compaction
BASE_OPTS = "tiering.enabled=true,seal.quiet_seconds=1,compaction.enabled=false"


# ======================================================================================== the tree


def tree_paths(n: int, queues: int, files_per_queue: int, units: int) -> list[str]:
    """N relative paths: topics of `queues` queues of `files_per_queue` files each (the last topic may be short)."""
    per_topic = queues * files_per_queue
    file_bytes = units * CQ_UNIT.size
    out = []
    for i in range(n):
        t, r = divmod(i, per_topic)
        q, k = divmod(r, files_per_queue)
        out.append(f"consumequeue/topic-{t:06d}/{q}/{k * file_bytes:020d}")
    return out


def cq_content(seed: int, units: int) -> bytes:
    """A full ConsumeQueue file: every unit valid, unit ends strictly increasing (the broker's own invariant)."""
    base = seed * units * 1024
    return b"".join(CQ_UNIT.pack(base + u * 1024, 200 + (seed + u) % 500, (seed * 31 + u) & 0x7FFFFFFF)
                    for u in range(units))


def write_tree(roots: list[Path], paths: list[str], units: int, mtime: float) -> None:
    """Write every file under each root (same bytes), with an old mtime so the quiet period has passed."""
    made: set[str] = set()
    for i, rel in enumerate(paths):
        data = cq_content(i, units)
        d = rel.rpartition("/")[0]
        for root in roots:
            if d not in made:
                (root / d).mkdir(parents=True, exist_ok=True)
            p = root / rel
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.utime(p, (mtime, mtime))
        made.add(d)
    for root in roots:
        C.syncfs(root)


# ======================================================================================== measurements


def catalog_counts(db: Path) -> dict[str, int]:
    """Rows per state, read-only (WAL readers never block the daemon's writer)."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    except sqlite3.OperationalError:
        return {}
    try:
        return dict(con.execute("SELECT state, count(*) FROM files GROUP BY state").fetchall())
    except sqlite3.OperationalError:
        return {}
    finally:
        con.close()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def timed_read(path: Path, repeat: int = 3) -> tuple[float, int]:
    """Median seconds to look up, open and read a control file, and its size. The daemon reuses one render for
    0.2 s (tierfs.fs.control), so each try waits that out first: every timed read renders once."""
    times, size = [], 0
    for _ in range(repeat):
        time.sleep(0.3)
        t = time.perf_counter()
        size = len(path.read_bytes())
        times.append(time.perf_counter() - t)
    return C.median(times), size


def ls_r(root: Path) -> tuple[float, int]:
    t = time.perf_counter()
    r = subprocess.run(["ls", "-R", str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=1800)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"ls -R {root} failed: {r.stderr.decode(errors='replace').strip()[:500]}")
    return dt, r.stdout.count(b"\n")


def stat_latencies(root: Path, rels: list[str]) -> list[float]:
    out = []
    for rel in rels:
        p = f"{root}/{rel}"
        t = time.perf_counter()
        os.stat(p)
        out.append(time.perf_counter() - t)
    out.sort()
    return out


def statvfs_latencies(root: Path, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        os.statvfs(root)
        out.append(time.perf_counter() - t)
    out.sort()
    return out


def wait_tiered(db: Path, n: int, timeout: float, pid: int) -> dict:
    """Poll the catalog until N rows are tiered. Times from now: all sealed (N rows), all tiered."""
    t0 = time.perf_counter()
    res: dict = {"sealed_s": None, "tiered_s": None}
    last_log = t0
    while True:
        counts = catalog_counts(db)
        rows, tiered = sum(counts.values()), counts.get("tiered", 0)
        now = time.perf_counter()
        if res["sealed_s"] is None and rows >= n:
            res["sealed_s"] = now - t0
        if tiered >= n:
            res["tiered_s"] = now - t0
            return res
        if now - t0 > timeout:
            res["timed_out"] = True
            res["timeout_s"] = now - t0
            res["tiered_at_timeout"] = tiered
            res["rows_at_timeout"] = rows
            return res
        if now - last_log > 30:
            C.log(f"  {now - t0:.0f}s: {rows} rows, {tiered} tiered; daemon cpu {C.daemon_cpu_seconds(pid):.0f}s, "
                  f"rss {rss_bytes(pid) >> 20} MiB")
            last_log = now
        # each poll scans the whole catalog (no index on state): poll less often the larger it is, so the bench
        # does not take a growing share of the CPU the daemon is measured on (resolution stays ~1% of the run)
        time.sleep(0.25 if now - t0 < 10 else min(5.0, max(1.0, n / 40_000)))


# ======================================================================================== the object store floor

_FLOOR_CHILD = r"""
import concurrent.futures, json, os, sys, time
sys.path.insert(0, sys.argv[1])
import crc32c
from tierfs.objectstore import open_store
url, opts, n, size, threads = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
store = open_store(url, **opts)
data = os.urandom(size)
crc = crc32c.crc32c(data)
keys = [f"floor/seg/consumequeue/t{i // 8:06d}/{i % 8}/{i:020d}/0.raw/000000" for i in range(n)]

def one(k):
    store.put(k, data, metadata={"crc32c": f"{crc:08x}"})
    assert crc32c.crc32c(store.get(k)) == crc

half = n // 2
t, c = time.perf_counter(), time.process_time()
for k in keys[:half]:
    one(k)
seq_s, seq_cpu = time.perf_counter() - t, time.process_time() - c
t, c = time.perf_counter(), time.process_time()
with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(one, keys[half:]))
par_s, par_cpu = time.perf_counter() - t, time.process_time() - c
store.delete_many(keys)
print(json.dumps({"objects": n, "threads": threads, "ms_per_object": seq_s / half * 1e3,
                  "objects_per_s": (n - half) / par_s, "cpu_ms_per_object": (seq_cpu + par_cpu) / n * 1e3}))
"""


def object_floor(url: str, opts: dict, n: int, size: int, threads: int, tierfs_src: str | None) -> dict:
    """PUT + verifying GET of `n` tiny objects straight into the store (no FUSE, no catalog): half one at a time
    (latency), half from `threads` threads (the concurrency the daemon gives small uploads: throughput), and
    the CPU it took per object (what those requests cost the daemon's process, GIL and all)."""
    src = str(Path(tierfs_src).resolve()) if tierfs_src else str(Path(__file__).resolve().parent.parent)
    return C.run_child([C.PY, "-c", _FLOOR_CHILD, src, url, json.dumps(opts), str(n), str(size), str(threads)],
                       timeout=900)


# ======================================================================================== one N


def run_one(n: int, args: argparse.Namespace, store_opts: list[str], floor_store: tuple[str, dict] | None,
            prof_dir: Path | None) -> dict:
    res: dict = {"n": n}
    paths = tree_paths(n, args.queues, args.files_per_queue, args.cq_units)
    rnd = random.Random(n)
    sample = rnd.sample(paths, min(args.stat_samples, n))
    opts = [BASE_OPTS, *store_opts, *args.options]
    with C.temp_base(args.dir, prefix="tierfs-scale-", keep=args.keep) as base:
        native, hot, mntp = base / "native", base / "hot", base / "mnt"
        for p in (native, hot, mntp):
            p.mkdir()
        t = time.perf_counter()
        write_tree([native, hot], paths, args.cq_units, time.time() - 3600)
        res["generate_s"] = round(time.perf_counter() - t, 1)
        C.log(f"N={n}: wrote {n} files of {args.cq_units * 20} B twice in {res['generate_s']}s")
        db = hot / ".tierfs" / "catalog.db"

        # ---- 1. first mount: nothing in the catalog; the scan seals everything, the uploaders tier it
        t = time.perf_counter()
        with C.TierfsMount(hot, mntp, opts, tierfs_src=args.tierfs_src) as m:
            res["mount_empty_s"] = round(time.perf_counter() - t, 3)
            assert m.pid is not None
            res["rss_start"] = rss_bytes(m.pid)
            cpu0 = C.daemon_cpu_seconds(m.pid)
            with contextlib.ExitStack() as stack:
                if prof_dir is not None:
                    prof = prof_dir / f"tiering-{n}.speedscope.json"
                    stack.enter_context(C.py_spy_record(m.pid, prof, rate=args.py_spy_rate))
                    res["profile"] = str(prof)
                res.update(wait_tiered(db, n, args.tier_timeout, m.pid))
            res["tier_cpu_s"] = round(C.daemon_cpu_seconds(m.pid) - cpu0, 2)
            res["rss_tiered"] = rss_bytes(m.pid)
            if res.get("timed_out"):
                C.log(f"N={n}: NOT all tiered after {args.tier_timeout}s "
                      f"({res['tiered_at_timeout']} tiered, {res['rows_at_timeout']} rows)")
            else:
                C.log(f"N={n}: all sealed after {res['sealed_s']:.1f}s, tiered after {res['tiered_s']:.1f}s "
                      f"(daemon cpu {res['tier_cpu_s']}s)")
            time.sleep(1.0)
            res["status_json_s"], res["status_json_bytes"] = timed_read(m.mnt / ".tierfs" / "status.json")
            res["status_s"], _ = timed_read(m.mnt / ".tierfs" / "status")
            res["metrics_s"], _ = timed_read(m.mnt / ".tierfs" / "metrics")
            t = time.perf_counter()
        res["umount_s"] = round(time.perf_counter() - t, 2)
        res["catalog_bytes"] = sum(f.stat().st_size for f in db.parent.glob("catalog.db*"))
        res["objects"] = catalog_objects(db)

        # ---- 2. remount with N rows: reconcile, then the namespace as the broker and an operator see it
        t = time.perf_counter()
        with C.TierfsMount(hot, mntp, opts, tierfs_src=args.tierfs_src) as m:
            res["remount_s"] = round(time.perf_counter() - t, 3)
            assert m.pid is not None
            res["remount_cpu_s"] = C.daemon_cpu_seconds(m.pid)  # the daemon's whole life so far: start + reconcile
            cpu0 = C.daemon_cpu_seconds(m.pid)
            res["ls_mount_s"], lines_m = ls_r(m.mnt)
            res["ls_mount_cpu_s"] = C.daemon_cpu_seconds(m.pid) - cpu0
            res["ls_native_s"], lines_n = ls_r(native)
            res["ls_mount_warm_s"], _ = ls_r(m.mnt)
            res["ls_lines"] = [lines_m, lines_n]
            time.sleep(float(args.attr_timeout) + 0.5)  # the kernel's cached entries expire: stats reach the daemon
            cpu0 = C.daemon_cpu_seconds(m.pid)
            sm = stat_latencies(m.mnt, sample)
            res["stat_cpu_us"] = (C.daemon_cpu_seconds(m.pid) - cpu0) / len(sample) * 1e6
            sn = stat_latencies(native, sample)
            res["stat_mount_p50_us"], res["stat_mount_p99_us"] = C.percentile(sm, .5) * 1e6, C.percentile(sm, .99) * 1e6
            res["stat_native_p50_us"], res["stat_native_p99_us"] = C.percentile(sn, .5) * 1e6, C.percentile(sn, .99) * 1e6
            sv = statvfs_latencies(m.mnt, 200)
            res["statfs_mount_p50_us"] = C.percentile(sv, .5) * 1e6
            res["rss_after_ls"] = rss_bytes(m.pid)
        if floor_store is not None:
            url, sopts = floor_store
            if url.startswith("file://"):
                url = f"file://{base / 'floor-objects'}"
            res["floor"] = object_floor(url, sopts, args.floor_objects, args.cq_units * 20, args.floor_threads,
                                        args.tierfs_src)
    return res


def catalog_objects(db: Path) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return sum(len(json.loads(r[0])) for r in con.execute("SELECT objects FROM files"))
    finally:
        con.close()


# ======================================================================================== report


def derived(r: dict) -> dict:
    n = r["n"]
    d = dict(r)
    tiered, done = r.get("tiered_s"), n
    if r.get("timed_out"):  # per-file figures over what was tiered before the timeout
        tiered, done = r["timeout_s"], max(r["tiered_at_timeout"], 1)
    d["tier_ms_per_file"] = tiered / done * 1e3
    d["objects_per_s"] = done / tiered
    d["tier_cpu_ms_per_file"] = r["tier_cpu_s"] / done * 1e3
    d["remount_us_per_file"] = r["remount_s"] / n * 1e6
    d["ls_mount_us_per_file"] = r["ls_mount_s"] / n * 1e6
    d["ls_ratio"] = r["ls_mount_s"] / r["ls_native_s"] if r["ls_native_s"] else float("nan")
    d["stat_ratio_p50"] = r["stat_mount_p50_us"] / r["stat_native_p50_us"]
    d["stat_ratio_p99"] = r["stat_mount_p99_us"] / r["stat_native_p99_us"]
    d["catalog_bytes_per_file"] = r["catalog_bytes"] / n
    d["status_json_us_per_file"] = r["status_json_s"] / n * 1e6
    d["rss_mib"] = r["rss_after_ls"] / (1 << 20)
    d["rss_kib_per_file"] = (r["rss_after_ls"] - r["rss_start"]) / n / 1024
    return d


def print_report(rows: list[dict], args: argparse.Namespace, store: str) -> None:
    print()
    print(f"tierfs scale benchmark  ({args.cq_units * 20} B ConsumeQueue files, {args.queues} queues x "
          f"{args.files_per_queue} files per topic; object store: {store}; "
          f"-o {','.join([BASE_OPTS, *args.options])})")
    print("\nnamespace (remount with N catalog rows; ls -R: the mount's first after mounting vs the warm native tree)")
    C.print_table(
        ["N", "remount s", "us/file", "ls -R mount s", "native s", "ratio", "us/file", "stat p50 us mnt/nat",
         "ratio", "stat p99 us mnt/nat", "ratio", "statfs p50 us"],
        [[f"{r['n']:,}", r["remount_s"], r["remount_us_per_file"], r["ls_mount_s"], r["ls_native_s"],
          f"{r['ls_ratio']:.1f}", r["ls_mount_us_per_file"],
          f"{r['stat_mount_p50_us']:.0f}/{r['stat_native_p50_us']:.1f}", f"{r['stat_ratio_p50']:.0f}",
          f"{r['stat_mount_p99_us']:.0f}/{r['stat_native_p99_us']:.1f}", f"{r['stat_ratio_p99']:.0f}",
          r["statfs_mount_p50_us"]] for r in rows])
    print("\ntiering (first mount, empty catalog: scan, seal, upload + verify, commit) and state")
    C.print_table(
        ["N", "sealed s", "tiered s", "ms/file", "objects/s", "daemon CPU ms/file", "catalog B/file",
         "status.json ms", "us/file", "status ms", "metrics ms", "RSS MiB", "KiB/file", "mount s"],
        [[f"{r['n']:,}", r["sealed_s"] if r.get("sealed_s") else f"> {r['timeout_s']:.0f}",
          r["tiered_s"] if r.get("tiered_s") else f"> {r['timeout_s']:.0f} ({r['tiered_at_timeout']:,} done)",
          r["tier_ms_per_file"],
          r["objects_per_s"], r["tier_cpu_ms_per_file"], r["catalog_bytes_per_file"], r["status_json_s"] * 1e3,
          r["status_json_us_per_file"], r["status_s"] * 1e3, r["metrics_s"] * 1e3, r["rss_mib"],
          r["rss_kib_per_file"], r["mount_empty_s"]] for r in rows])
    print(f"({C.DAEMON_CPU_NOTE})")
    floors = [r for r in rows if r.get("floor")]
    if floors:
        print("\nper-object requests (PUT + verifying GET of tiny objects straight into the store, no FUSE, no "
              "catalog) vs the daemon's per-file tiering cost: what packing small files into shared objects could "
              "save at most")
        C.print_table(["N", "store ms/object", "store objects/s", "daemon files/s", "store CPU ms/object",
                       "daemon CPU ms/file", "request share of CPU"],
                      [[f"{r['n']:,}", r["floor"]["ms_per_object"],
                        f"{r['floor']['objects_per_s']:.0f} ({r['floor']['threads']} thr)", r["objects_per_s"],
                        r["floor"]["cpu_ms_per_object"], r["tier_cpu_ms_per_file"],
                        f"{r['floor']['cpu_ms_per_object'] / r['tier_cpu_ms_per_file'] * 100:.0f}%"]
                       for r in floors])
    sys.stdout.flush()


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="10000,30000,100000", help="comma-separated file counts (default 10k,30k,100k)")
    ap.add_argument("--dir", help="base dir for the temp native/hot/mountpoint dirs (default $TMPDIR)")
    ap.add_argument("--cq-units", type=int, default=50, help="20-byte units per ConsumeQueue file (default 50)")
    ap.add_argument("--queues", type=int, default=4, help="queues per topic (default 4)")
    ap.add_argument("--files-per-queue", type=int, default=2, help="ConsumeQueue files per queue (default 2)")
    ap.add_argument("--stat-samples", type=int, default=5000, help="random files stat'ed on each side")
    ap.add_argument("--tier-timeout", type=float, default=3600, help="longest wait for all files to be tiered (s)")
    ap.add_argument("--floor-objects", type=int, default=2000,
                    help="tiny objects PUT+GET for the object store floor (0: skip)")
    ap.add_argument("--floor-threads", type=int, default=8,
                    help="threads of the floor's throughput half (default 8: objectstore.max_concurrency / 2, "
                         "what the daemon gives a batch of small uploads)")
    ap.add_argument("--rgw", action="store_true", help="object store: a throwaway Ceph RGW (tests/ceph_rgw.py)")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="also write machine-readable results (to FILE, or stdout when no FILE)")
    ap.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE[,...]",
                    help="passed to `tierfs mount -o`")
    ap.add_argument("--py-spy", metavar="DIR", help="record a py-spy profile of the daemon while it tiers")
    ap.add_argument("--py-spy-rate", type=int, default=100)
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (debugging)")
    ap.add_argument("--tierfs-src", metavar="DIR", help="run the daemon from this source tree (A/B of versions)")
    args = ap.parse_args(argv)
    try:
        args.n = [int(x) for x in args.n.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--n: expected comma-separated integers, got {args.n!r}")
    if not args.n or min(args.n) < 1:
        ap.error("--n: every count must be >= 1")
    if args.cq_units < 1 or args.queues < 1 or args.files_per_queue < 1:
        ap.error("--cq-units, --queues and --files-per-queue must be >= 1")
    args.attr_timeout = 1.0
    for o in args.options:
        for kv in o.split(","):
            if kv.strip().startswith("mount.attr_timeout="):
                args.attr_timeout = float(kv.split("=", 1)[1])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    C.install_signal_handlers()
    prof_dir = Path(args.py_spy).resolve() if args.py_spy else None
    if prof_dir:
        prof_dir.mkdir(parents=True, exist_ok=True)
    results = []
    with contextlib.ExitStack() as stack:
        store_opts: list[str] = []
        floor_store: tuple[str, dict] | None = ("file://", {}) if args.floor_objects else None
        store = "posix (embedded default: HOT/.tierfs/objects)"
        if args.rgw:
            rgw = stack.enter_context(C.ceph_rgw(keep=args.keep))
            bucket = rgw.make_bucket("tierfs-scale")
            store = f"Ceph RGW {rgw.endpoint_url}"
            store_opts = [C.rgw_store_options(rgw, bucket, "scale")]
            if args.floor_objects:
                floor_store = (f"s3://{bucket}/floor", {"endpoint_url": rgw.endpoint_url, "addressing": "path",
                                                         "access_key": rgw.access_key, "secret_key": rgw.secret_key})
        for n in args.n:
            r = derived(run_one(n, args, store_opts, floor_store, prof_dir))
            results.append(r)
            C.log(f"N={n}: remount {r['remount_s']}s, ls -R {r['ls_mount_s']:.2f}s (native {r['ls_native_s']:.2f}s), "
                  f"stat p50 {r['stat_mount_p50_us']:.0f} us, tiering {r['tier_ms_per_file']:.2f} ms/file")
            if args.json and args.json != "-":  # a long sweep keeps what it measured if a later N is stopped
                C.write_json(args.json, json_doc(args, store, results))
    print_report(results, args, store)
    if prof_dir:
        print("\ndaemon profiles while tiering (py-spy, share of samples):")
        for r in results:
            pf = r.get("profile")
            if pf and Path(pf).exists():
                s = C.summarize_speedscope(Path(pf), top=15)
                r["profile_summary"] = s
                print(f"  N={r['n']} ({pf}, {s['samples']:.0f} samples)\n    self:")
                for name, pct in s["self_pct"]:
                    print(f"      {pct:5.1f}%  {name}")
                print("    inclusive:")
                for name, pct in s["inclusive_pct"]:
                    print(f"      {pct:5.1f}%  {name}")
    if args.json:
        C.write_json(args.json, json_doc(args, store, results))
    return 0


def json_doc(args: argparse.Namespace, store: str, results: list[dict]) -> dict:
    return {"options": [BASE_OPTS, *args.options], "cq_units": args.cq_units, "queues": args.queues,
            "files_per_queue": args.files_per_queue, "tierfs_src": args.tierfs_src, "store": store,
            "results": results}


if __name__ == "__main__":
    sys.exit(main())
