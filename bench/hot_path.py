#!/usr/bin/env python3
"""Hot-path benchmark: the broker's four I/O patterns on a native dir vs. through a tierfs mount.

One run creates a temp base dir (`--dir`, default $TMPDIR) holding a native dir, a hot dir and a mountpoint (so
native and hot share one filesystem), mounts tierfs with the real CLI, and runs every workload once natively and
once through the mount, each in its own child interpreter (so the Python-side cost is identical on both sides):

  a  CommitLog: 1 KiB records memcpy'd into MAP_SHARED mmaps of 1 GiB ftruncate'd segments (struct.pack_into for
     the offsets), mmap.flush() (msync of the whole mapping) every 500 ms, roll when full.
     Figure: MB/s of durable data (bytes covered by completed msyncs, final msync included / elapsed).
  b  ConsumeQueue: 20-byte sequential os.write + fdatasync every 1 s. Figure: writes/s.
  c  Sequential 1 MiB reads of an uncached 1 GiB file. Figure: MB/s.
  d  Random 4 KiB reads of the same uncached file (re-evicted every 256 reads, untimed, so read-ahead never
     warms it; offsets never repeat). Figures: p50 / p99 latency (us).

Uncached = posix_fadvise(DONTNEED) on the native name, the hot (backing) name AND the file seen through the
mount, checked with mincore; the page cache is never dropped globally. For c and d the native name is a hard
link to the hot file, so both runs read the same blocks (a VM's host cache cannot favour one side).

Every mount run also reports the FUSE requests it caused (count, daemon-side mean latency, bytes per READ/WRITE,
from MNT/.tierfs/stats) and the daemon's CPU time per unit of work, which is steadier than throughput on a
shared or virtualised host. With --repeat N the pairs alternate which side goes first and the ratio shown is the
median of the paired ratios, with its range.

    .venv/bin/python bench/hot_path.py --seconds 8                  # all four, defaults
    .venv/bin/python bench/hot_path.py --seconds 8 --repeat 3 --json out.json
    .venv/bin/python bench/hot_path.py --only a,b -o mount.writeback_cache=false
    .venv/bin/python bench/hot_path.py --only c -o mount.read_ahead_kb=4096 --bdi strict_limit=0
    .venv/bin/python bench/hot_path.py --only c --py-spy /tmp/prof --perf /tmp/perf   # profile the daemon
    .venv/bin/python bench/hot_path.py --tierfs-src /tmp/snapshot   # daemon from another tree (A/B of versions)
    .venv/bin/python bench/hot_path.py --ab-src /work/wt/base13 --repeat 3   # both trees in the same run
    .venv/bin/python bench/hot_path.py --floor --repeat 3          # + a C passthrough: FUSE's own cost

With --ab-src DIR a second daemon from DIR is mounted too (its own hot dir, the c/d data file hard-linked into it)
and every repetition runs each workload against it right after this tree's pair: the report adds the same-run
ratio this tree / that tree (the median of the per-repetition ratios of the mount figures).

With --floor (or --floor splice) bench/fuse_floor.c is built and mounted the same way: a passthrough in C on
libfuse's low-level API with tierfs's kernel settings (writeback cache, keep_cache, attr timeout, and the
read-ahead and max_background read back from the tierfs mount). Its figure over native is what FUSE itself
costs on this machine; tierfs's over it is what tierfs's Python request loop and engine add. `splice` replies to
READs by splicing from the file instead of copying from a buffer, as pyfuse3 does: it measures whether a binding
with a spliced reply would save anything (here it did not: more CPU per GB than the copy, the same MB/s).
The floor also does what tierfs does beside passing requests through: its write primer (the same trigger, window
mount.write_prime_kb and helper process; workload b's writer otherwise waits for a READ per 4 KiB page) and the
answer of large READs from holes without the disk (workload a's mmap faults, the primer's READs), so "this tree /
C floor" is what tierfs's Python adds. --floor-primer off mounts a bare passthrough instead.

"daemon CPU" is always the daemon's with its helper processes' (tierfs's flusher and write primer, the floor's
primer), live or already reaped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import random
import shutil
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30

WORKLOADS = {
    "a": "CommitLog mmap append 1 KiB + msync/500ms",
    "b": "ConsumeQueue 20 B write + fdatasync/1s",
    "c": "seq read 1 MiB, uncached 1 GiB file",
    "d": "random read 4 KiB, uncached",
}

# ======================================================================================== child side: workloads


def wl_commitlog(p: dict) -> dict:
    """Broker CommitLog: MAP_SHARED mmap of preallocated (ftruncate) segments; flusher msyncs the whole mapping."""
    d = Path(p["dir"]) / "commitlog"
    d.mkdir(parents=True, exist_ok=True)
    seg_size, rs, interval, seconds = p["segment_size"], p["record_size"], p["flush_interval"], p["seconds"]
    assert seg_size % rs == 0
    rec = bytearray(os.urandom(rs))
    struct.pack_into(">iI", rec, 0, rs, 0xDAA320A7)  # TOTALSIZE, MAGICCODE
    pack = struct.Struct(">qq").pack_into  # QUEUEOFFSET @20, PHYSICALOFFSET @28
    msync_us: list[float] = []
    segments = 0

    def open_segment(base: int) -> tuple[int, mmap.mmap]:
        nonlocal segments
        segments += 1
        fd = os.open(d / f"{base:020d}", os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, seg_size)
        return fd, mmap.mmap(fd, seg_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def msync(mm: mmap.mmap) -> None:
        t = time.perf_counter()
        mm.flush()  # msync(addr, whole mapping, MS_SYNC), like MappedByteBuffer.force()
        msync_us.append((time.perf_counter() - t) * 1e6)

    t0 = time.perf_counter()
    deadline = t0 + seconds
    next_flush = t0 + interval
    base, pos, qoff, durable = 0, 0, 0, 0
    fd, mm = open_segment(base)
    batch = 64
    while True:
        for _ in range(batch):
            if pos == seg_size:  # full: force the whole file before moving on, then roll
                msync(mm)
                durable = base + pos
                mm.close()
                os.close(fd)
                base += seg_size
                pos = 0
                fd, mm = open_segment(base)
            pack(rec, 20, qoff, base + pos)
            mm[pos:pos + rs] = rec
            pos += rs
            qoff += 1
        now = time.perf_counter()
        if now >= next_flush:
            covered = base + pos
            msync(mm)
            durable = covered
            next_flush = max(next_flush + interval, time.perf_counter())
            if now >= deadline:
                break
    elapsed = time.perf_counter() - t0  # includes the final msync
    mm.close()
    os.close(fd)
    ms = sorted(msync_us)
    return {"value": durable / elapsed / 1e6, "unit": "MB/s", "durable_bytes": durable, "elapsed_s": elapsed,
            "records": qoff, "segments": segments, "msyncs": len(ms), "msync_p50_ms": C.percentile(ms, .5) / 1e3,
            "msync_max_ms": (ms[-1] / 1e3) if ms else None}


def wl_consumequeue(p: dict) -> dict:
    """Broker 5.3 ConsumeQueue: position+write(20 B) per message; flusher fdatasyncs every second."""
    d = Path(p["dir"]) / "consumequeue" / "TopicTest" / "0"
    d.mkdir(parents=True, exist_ok=True)
    unit, file_size, interval, seconds = 20, p["cq_file_size"], p["sync_interval"], p["seconds"]
    entry = bytearray(unit)
    pack = struct.Struct(">qiq").pack_into
    sync_us: list[float] = []

    def open_file(k: int) -> int:
        fd = os.open(d / f"{k * unit:020d}", os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, file_size)  # the broker maps CQ files at full size first
        return fd

    def fdatasync(fd: int) -> None:
        t = time.perf_counter()
        os.fdatasync(fd)
        sync_us.append((time.perf_counter() - t) * 1e6)

    per_file = file_size // unit
    t0 = time.perf_counter()
    deadline = t0 + seconds
    next_sync = t0 + interval
    k = 0
    fd = open_file(0)
    write = os.write
    while True:
        for _ in range(256):
            if k and k % per_file == 0:
                fdatasync(fd)
                os.close(fd)
                fd = open_file(k)
            pack(entry, 0, k * 1024, 1024, 0x1234)
            write(fd, entry)
            k += 1
        now = time.perf_counter()
        if now >= next_sync:
            fdatasync(fd)
            next_sync = max(next_sync + interval, time.perf_counter())
            if now >= deadline:
                break
    elapsed = time.perf_counter() - t0
    os.close(fd)
    s = sorted(sync_us)
    return {"value": k / elapsed, "unit": "writes/s", "writes": k, "elapsed_s": elapsed, "fdatasyncs": len(s),
            "fdatasync_p50_ms": C.percentile(s, .5) / 1e3, "fdatasync_max_ms": (s[-1] / 1e3) if s else None}


def _evict_all(paths: dict[str, str]) -> dict:
    """Evict every copy, then report the share of each still resident (should be 0)."""
    for q in paths.values():
        C.evict(q)
    return {label: round(C.resident_fraction(q), 4) for label, q in paths.items()}


def wl_seqread(p: dict) -> dict:
    buf = bytearray(p["block"])
    mv = memoryview(buf)
    total, elapsed, rates = 0, 0.0, []
    for _ in range(p["passes"]):  # each pass: evict every copy, then one timed sequential read of the file
        cached = _evict_all(p["evict"])
        fd = os.open(p["file"], os.O_RDONLY)
        n_pass = 0
        t0 = time.perf_counter()
        while True:
            n = os.readv(fd, [mv])
            if n <= 0:
                break
            n_pass += n
        dt = time.perf_counter() - t0
        os.close(fd)
        total += n_pass
        elapsed += dt
        rates.append(round(n_pass / dt / 1e6, 1))
    return {"value": total / elapsed / 1e6, "unit": "MB/s", "bytes": total, "elapsed_s": elapsed,
            "pass_MBps": rates, "resident_before": cached}


def wl_randread(p: dict) -> dict:
    cached = _evict_all(p["evict"])
    bs = p["block"]
    fd = os.open(p["file"], os.O_RDONLY)
    npages = os.fstat(fd).st_size // bs
    rnd = random.Random(p.get("seed", 42))
    offs = [i * bs for i in rnd.sample(range(npages), min(npages, p["max_ops"]))]  # no repeats: never a cache hit
    lat: list[int] = []
    pread, clock = os.pread, time.perf_counter_ns
    t0 = time.perf_counter()
    deadline = t0 + p["seconds"]
    every = p["evict_every"]
    untimed = 0.0
    for i, off in enumerate(offs):
        if i and not i % every:  # keep the cache empty so no read-ahead history builds up (untimed)
            u = time.perf_counter()
            for q in p["evict"].values():
                C.evict(q)
            untimed += time.perf_counter() - u
            if time.perf_counter() - untimed >= deadline:
                break
        s = clock()
        pread(fd, bs, off)
        lat.append(clock() - s)
    elapsed = time.perf_counter() - t0 - untimed
    os.close(fd)
    lat.sort()
    us = [x / 1e3 for x in lat]
    return {"value": C.percentile(us, .5), "unit": "us", "p50_us": C.percentile(us, .5),
            "p99_us": C.percentile(us, .99), "mean_us": sum(us) / len(us), "ops": len(us),
            "iops": len(us) / elapsed, "hits_under_20us": round(sum(1 for x in us if x < 20) / len(us), 3),
            "resident_before": cached}


CHILD = {"a": wl_commitlog, "b": wl_consumequeue, "c": wl_seqread, "d": wl_randread}


def child_main(wl: str, params_json: str) -> int:
    res = CHILD[wl](json.loads(params_json))
    print(json.dumps(res), flush=True)
    return 0


# ======================================================================================== parent side


def _rm_tree_contents(path: Path) -> None:
    """Remove a workload's files (through the mount when it is the mount, so the daemon sees the unlinks)."""
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _work_of(wl: str, res: dict) -> float:
    """What a run moved, for CPU-per-work figures: bytes for a/c, operations for b/d."""
    return float({"a": res.get("durable_bytes"), "b": res.get("writes"), "c": res.get("bytes"),
                  "d": res.get("ops")}[wl] or 0)


def run_pair(wl: str, args: argparse.Namespace, env: dict | None, mnt: C.FuseMount, native: Path,
             files: dict[str, Path], prof_dir: Path | None, rep: int) -> dict:
    """One workload on both sides, each in a fresh child (native first on even repetitions, mount first on odd).
    Returns both results, plus FUSE request stats and CPU used by the daemon and by the workload child."""
    out: dict = {}
    # alternate which side goes first across repetitions, so neither always inherits the other's writeback
    for side in (("native", "mount") if rep % 2 == 0 else ("mount", "native")):
        root = native if side == "native" else mnt.mnt
        params: dict = {"seconds": args.seconds}
        # a and b use the broker's layout at the store root, so path classification in the daemon is exercised
        if wl == "a":
            params.update(dir=str(root), segment_size=args.segment_size, record_size=args.record_size,
                          flush_interval=args.flush_interval)
        elif wl == "b":
            params.update(dir=str(root), cq_file_size=args.cq_file_size, sync_interval=args.sync_interval)
        else:
            target = files["native"] if side == "native" else files["mount"]
            # evict everything that could serve the read: the native copy, the backing copy and the FUSE copy
            params.update(file=str(target), evict={k: str(v) for k, v in files.items()})
            if wl == "c":
                params.update(block=args.seq_block, passes=args.seq_passes)
            else:
                params.update(block=args.rand_block, max_ops=args.rand_max_ops, seed=1000 + rep,
                              evict_every=args.rand_evict_every)
        argv = [C.PY, str(Path(__file__).resolve()), "--child", wl, json.dumps(params)]
        timeout = args.seconds * 6 + 300
        C.syncfs(native)  # start each run with no dirty data from the previous one (flush only, no drop)
        before = mnt.stats() if side == "mount" else None
        cpu0, dcpu0 = C.children_cpu_seconds(), C.tree_cpu(mnt.pid)
        if side == "mount" and (prof_dir is not None or args.perf):
            with contextlib.ExitStack() as stack:
                if prof_dir is not None:
                    prof = prof_dir / f"{wl}-rep{rep}.speedscope.json"
                    stack.enter_context(C.py_spy_record(mnt.pid, prof, rate=args.py_spy_rate))
                if args.perf:
                    pdata = Path(args.perf).resolve() / f"{wl}-rep{rep}.perf.data"
                    pdata.parent.mkdir(parents=True, exist_ok=True)
                    stack.enter_context(C.perf_record(mnt.pid, pdata))
                res = C.run_child(argv, timeout, env)
                cpu1, dcpu1 = C.children_cpu_seconds(), C.tree_cpu(mnt.pid)
            if prof_dir is not None:
                res["profile"] = str(prof)
            if args.perf:
                res["perf_data"] = str(pdata)
        else:
            res = C.run_child(argv, timeout, env)
            cpu1, dcpu1 = C.children_cpu_seconds(), C.tree_cpu(mnt.pid)
        res["client_cpu_s"] = round(cpu1 - cpu0, 3)
        work = _work_of(wl, res)
        if side == "mount":
            res["fuse"] = C.stats_delta(before, mnt.stats())
            # the daemon's CPU with its helper processes' (flusher, write primer), see C.tree_cpu
            dcpu = dcpu1.total - dcpu0.total
            res["daemon_cpu_s"] = round(dcpu, 3)
            res["helpers_cpu_s"] = round(dcpu1.helpers - dcpu0.helpers, 3)
            # CPU the daemon spent per unit of work: ms per GB (a, c) or us per operation (b, d)
            if work:
                res["daemon_cpu_per_work"] = round(dcpu * (1e12 / work if wl in "ac" else 1e6 / work), 2)
                res["daemon_cpu_unit"] = "ms/GB" if wl in "ac" else "us/op"
        if wl in ("a", "b"):
            t = time.perf_counter()
            _rm_tree_contents(root / {"a": "commitlog", "b": "consumequeue"}[wl])
            C.syncfs(native)
            res["cleanup_s"] = round(time.perf_counter() - t, 2)
        out[side] = res
        C.log(f"{wl} rep{rep} {side}: {C.fmt_num(res['value'])} {res['unit']}"
              + (f"  [{C.format_stats_delta(res['fuse'])}]" if side == "mount" else ""))
    return out


def summarize(wl: str, reps: list[dict]) -> dict:
    """Medians over repetitions; the ratio is the median of the paired (back-to-back) per-repetition ratios."""
    nat = C.median(r["native"]["value"] for r in reps)
    mnt = C.median(r["mount"]["value"] for r in reps)
    ratios = [r["mount"]["value"] / r["native"]["value"] for r in reps if r["native"]["value"]]
    row = {"workload": wl, "name": WORKLOADS[wl], "unit": reps[0]["native"]["unit"], "native": nat, "mount": mnt,
           "ratio": C.median(ratios), "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
           "daemon_cpu_per_work": C.median(r["mount"].get("daemon_cpu_per_work", float("nan")) for r in reps),
           "daemon_cpu_unit": reps[0]["mount"].get("daemon_cpu_unit", "")}
    if wl == "d":
        row["native_p99"] = C.median(r["native"]["p99_us"] for r in reps)
        row["mount_p99"] = C.median(r["mount"]["p99_us"] for r in reps)
        row["ratio_p99"] = C.median(r["mount"]["p99_us"] / r["native"]["p99_us"] for r in reps)
        row["target"] = "p50 <= 2x"
        row["pass"] = row["ratio"] <= 2.0
    else:
        need = {"a": 0.5, "b": 0.85, "c": 0.6}[wl]
        row["target"] = f">= {need}"
        row["pass"] = row["ratio"] >= need
    return row


def print_report(rows: list[dict], results: dict, options: list[str], tuning: dict, seconds: float,
                 bdi: list[str] = ()) -> None:
    print()
    print(f"tierfs hot-path benchmark  (seconds={seconds}, -o {','.join(options) or '(defaults)'}"
          f"{'; --bdi ' + ','.join(bdi) if bdi else ''}; "
          f"kernel: {', '.join(f'{k}={v}' for k, v in tuning.items()) or '?'})")
    table = []

    def rng(r: dict) -> str:
        lo, hi = r.get("ratio_min"), r.get("ratio_max")
        return f"{lo:.2f}-{hi:.2f}" if lo is not None and hi is not None and lo != hi else "-"

    def dcpu(r: dict) -> str:
        v = r.get("daemon_cpu_per_work")
        return f"{v:,.1f} {r['daemon_cpu_unit']}" if v == v and v is not None else "-"

    for r in rows:
        verdict = "PASS" if r["pass"] else "FAIL"
        if r["workload"] == "d":
            table.append([f"d  {r['name']} p50", "us", r["native"], r["mount"], f"{r['ratio']:.2f}", rng(r),
                          r["target"], verdict, dcpu(r)])
            table.append(["d  ... p99", "us", r["native_p99"], r["mount_p99"], f"{r['ratio_p99']:.2f}", "-", "-", "",
                          ""])
        else:
            table.append([f"{r['workload']}  {r['name']}", r["unit"], r["native"], r["mount"], f"{r['ratio']:.2f}",
                          rng(r), r["target"], verdict, dcpu(r)])
    C.print_table(["workload", "unit", "native", "mount", "mount/native", "range", "target", "", "daemon CPU"],
                  table)
    print(f"({C.DAEMON_CPU_NOTE})")
    print()
    print("FUSE requests during the mount runs (count, mean daemon-side latency, bytes per READ/WRITE):")
    for wl, reps in results.items():
        print(f"  {wl}: {C.format_stats_delta(reps[-1]['mount']['fuse'])}")
    detail = {"a": ("msyncs", "msync_p50_ms", "msync_max_ms", "segments"),
              "b": ("fdatasyncs", "fdatasync_p50_ms", "fdatasync_max_ms"),
              "c": ("pass_MBps", "resident_before"), "d": ("ops", "mean_us", "hits_under_20us", "resident_before")}

    def rounded(v: object) -> object:
        return round(v, 2) if isinstance(v, float) else v

    print("details (last repetition, native | mount):")
    for wl, reps in results.items():
        last = reps[-1]
        keys = detail[wl] + ("client_cpu_s",)
        n = {k: rounded(last["native"].get(k)) for k in keys}
        m = {k: rounded(last["mount"].get(k)) for k in keys + ("daemon_cpu_s", "helpers_cpu_s")}
        print(f"  {wl}: {json.dumps(n, default=str)} | {json.dumps(m, default=str)}")
    sys.stdout.flush()


def print_ab(results: dict, results_b: dict, label: str) -> None:
    """Same-run A/B: this tree's mount figures over the other mount's (--ab-src or --floor), per repetition (each
    pair ran back to back), the median and range of those ratios, the other mount's own ratio to native, and both
    daemons' CPU per unit of work."""
    print(f"\nsame-run A/B, this tree / {label} (mount figures; for d, latency: lower is better):")
    table = []
    for wl, reps in results.items():
        keys = [("value", "p50")] + ([("p99_us", "p99")] if wl == "d" else [])
        for key, name in keys:
            ratios = [a["mount"][key] / b["mount"][key] for a, b in zip(reps, results_b[wl]) if b["mount"][key]]
            own = [b["mount"][key] / b["native"][key] for b in results_b[wl] if b["native"][key]]
            table.append([f"{wl} {name if wl == 'd' else WORKLOADS[wl]}", reps[0]["mount"]["unit"] if key == "value"
                          else "us", C.median(b["mount"][key] for b in results_b[wl]), f"{C.median(own):.2f}",
                          C.median(a["mount"][key] for a in reps), f"{C.median(ratios):.2f}",
                          f"{min(ratios):.2f}-{max(ratios):.2f}",
                          C.median(b["mount"].get("daemon_cpu_per_work", float("nan")) for b in results_b[wl]),
                          C.median(a["mount"].get("daemon_cpu_per_work", float("nan")) for a in reps)])
    C.print_table(["workload", "unit", "other", "other/native", "this tree", "this/other", "range", "other CPU/work",
                   "this CPU/work"], table)
    print(f"(CPU/work: {C.DAEMON_CPU_NOTE})")
    for wl, reps in results_b.items():
        if reps[-1]["mount"]["fuse"]["ops"]:  # a tierfs daemon's stats (the C floor keeps none)
            print(f"  {wl} {label} FUSE: {C.format_stats_delta(reps[-1]['mount']['fuse'])}")


def floor_like_tierfs(cfg: dict, primer: bool) -> dict:
    """The C floor's options that do what the tierfs mount does beside passing requests through: its write primer
    with the same window, and the hole answer of large READs that serves the primer's (and mmap faults') READs."""
    kb = int(cfg.get("mount.write_prime_kb", 0)) if primer else 0
    return {"write_prime_kb": kb, "hole_reads": primer}


def floor_label(args: argparse.Namespace, opts: dict) -> str:
    return (f"C floor ({args.floor}, " + (f"write primer {opts['write_prime_kb']} KiB + hole reads, as tierfs)"
                                         if opts.get("hole_reads") else "no write primer: b is not comparable)"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="base dir for the temp native/hot/mountpoint dirs (default $TMPDIR)")
    ap.add_argument("--seconds", type=float, default=10.0, help="duration of workloads a, b, d (default 10)")
    ap.add_argument("--only", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="also write machine-readable results (to FILE, or stdout when no FILE)")
    ap.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE[,...]",
                    help="passed to `tierfs mount -o`, e.g. -o mount.writeback_cache=false")
    ap.add_argument("--bdi", action="append", default=[], metavar="KEY=VALUE[,...]",
                    help="after mounting, write /sys/class/bdi/<mount>/KEY (kernel knobs tierfs does not set yet, "
                         "e.g. --bdi strict_limit=0,max_ratio=20)")
    ap.add_argument("--repeat", type=int, default=1, help="run each native/mount pair N times; report medians")
    ap.add_argument("--py-spy", metavar="DIR", help="record a py-spy speedscope profile of the daemon per mount run")
    ap.add_argument("--py-spy-rate", type=int, default=200)
    ap.add_argument("--perf", metavar="DIR", help="record `perf record -g` of the daemon per mount run (kernel+C)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (debugging)")
    ap.add_argument("--tierfs-src", metavar="DIR",
                    help="run the daemon from this source tree (prepended to PYTHONPATH), e.g. a `git archive` "
                         "snapshot, to compare versions; default: the installed tierfs")
    ap.add_argument("--ab-src", metavar="DIR",
                    help="also mount a daemon from this tree and run every workload on it in the same run")
    ap.add_argument("--floor", nargs="?", const="copy", choices=("copy", "splice"),
                    help="also mount bench/fuse_floor.c (a C passthrough; `splice`: READ replies spliced from the "
                         "file) and run every workload on it in the same run")
    ap.add_argument("--floor-primer", choices=("on", "off"), default="on",
                    help="the floor with tierfs's write primer (mount.write_prime_kb, same trigger) and hole answer "
                         "of large READs (default on, so tierfs/floor is what Python adds); off: a bare passthrough")
    ap.add_argument("--segment-size", type=int, default=GiB)
    ap.add_argument("--record-size", type=int, default=1024)
    ap.add_argument("--flush-interval", type=float, default=0.5)
    ap.add_argument("--cq-file-size", type=int, default=300_000 * 20)
    ap.add_argument("--sync-interval", type=float, default=1.0)
    ap.add_argument("--read-file-size", type=int, default=GiB)
    ap.add_argument("--seq-block", type=int, default=MiB)
    ap.add_argument("--seq-passes", type=int, default=1, help="timed passes over the file in workload c")
    ap.add_argument("--warmup-max-passes", type=int, default=4,
                    help="untimed reads of the c/d file before the runs, until the rate is steady")
    ap.add_argument("--rand-block", type=int, default=4096)
    ap.add_argument("--rand-max-ops", type=int, default=200_000)
    ap.add_argument("--rand-evict-every", type=int, default=256,
                    help="re-evict all copies every N random reads (untimed) so read-ahead never warms the cache")
    ap.add_argument("--child", nargs=2, metavar=("WL", "PARAMS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = [w.strip() for w in args.only.split(",") if w.strip()]
    args.floor_primer = args.floor_primer == "on"
    if args.floor and args.ab_src:
        ap.error("--floor and --ab-src each add a second mount; choose one")
    bad = [w for w in args.only if w not in WORKLOADS]
    if bad:
        ap.error(f"--only: unknown workload(s) {bad}; choose from a,b,c,d")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child_main(*args.child)
    WORKLOADS["a"] = f"CommitLog mmap append {args.record_size} B, {args.segment_size >> 20} MiB segs, msync/{args.flush_interval * 1000:.0f}ms"
    WORKLOADS["b"] = f"ConsumeQueue 20 B write + fdatasync/{args.sync_interval:g}s"
    WORKLOADS["c"] = f"seq read {args.seq_block >> 10} KiB, uncached {args.read_file_size >> 20} MiB file"
    WORKLOADS["d"] = f"random read {args.rand_block >> 10} KiB, uncached"
    C.install_signal_handlers()
    env = None  # workload children run with the caller's environment
    prof_dir = Path(args.py_spy).resolve() if args.py_spy else None
    if prof_dir:
        prof_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    with C.temp_base(args.dir, keep=args.keep) as base:
        native, hot, mntp = base / "native", base / "hot", base / "mnt"
        for p in (native, hot, mntp):
            p.mkdir()
        if os.stat(native).st_dev != os.stat(hot).st_dev:
            raise SystemExit("native and hot dirs are on different filesystems")
        files = {}
        if {"c", "d"} & set(args.only):
            # One file, two names: native/data/readfile is a hard link to hot/data/readfile, so the native and
            # the mount runs read the very same disk blocks. A virtual disk's host-side cache then treats both
            # alike; a warm-up pass (evicted from the guest afterwards) makes that state equal from the start.
            C.log(f"writing a {args.read_file_size >> 20} MiB data file (hot, hard-linked into native) + warm-up...")
            files = {"native": native / "data" / "readfile", "hot": hot / "data" / "readfile"}
            C.write_data_file(files["hot"], args.read_file_size)
            files["native"].parent.mkdir()
            os.link(files["hot"], files["native"])
            prev = 0.0
            for i in range(args.warmup_max_passes):  # until the lower layers deliver a steady rate
                t = time.perf_counter()
                rate = C.read_file_once(files["native"]) / (time.perf_counter() - t) / 1e6
                C.evict(files["native"])
                C.log(f"warm-up pass {i + 1}: {rate:.0f} MB/s")
                if prev and abs(rate - prev) / prev < 0.15:
                    break
                prev = rate
            files["mount"] = mntp / "data" / "readfile"
        files_b: dict[str, Path] = {}
        results_b: dict[str, list[dict]] = {}
        primed: dict[str, object] = {}
        with contextlib.ExitStack() as ab_stack, \
                C.TierfsMount(hot, mntp, args.options, tierfs_src=args.tierfs_src) as mnt:
            mnt_b = None
            floor_opts = floor_like_tierfs(mnt.config(), args.floor_primer) if args.floor else {}
            if args.ab_src or args.floor:  # a second mount serving the same data file from its own backing dir
                back_b, mnt_bp = base / "back-b", base / "mnt-b"
                if files:
                    (back_b / "data").mkdir(parents=True)
                    os.link(files["hot"], back_b / "data" / "readfile")
                    files_b = {**files, "back_b": back_b / "data" / "readfile", "mount": mnt_bp / "data" / "readfile"}
                    files["mount_b"] = files_b["mount"]  # evicted too before this tree's runs
                mnt_b = ab_stack.enter_context(
                    C.TierfsMount(back_b, mnt_bp, args.options, tierfs_src=args.ab_src) if args.ab_src else
                    C.FloorMount(back_b, mnt_bp, base / "floor-build", tuning=mnt.wait_tuned(),
                                 splice=args.floor == "splice",
                                 attr_timeout=float(mnt.config().get("mount.attr_timeout", 1.0)),
                                 **floor_opts))
                if args.bdi:
                    C.set_bdi(mnt_b, args.bdi)
                C.log(f"second mount at {mnt_bp} (pid {mnt_b.pid}; {mnt_b.kernel_tuning()})")
            if args.bdi:
                C.log(f"bdi settings applied: {C.set_bdi(mnt, args.bdi)}")
            tuning = mnt.kernel_tuning()
            C.log(f"mounted {hot} at {mntp} (daemon pid {mnt.pid}; {tuning})")
            for wl in args.only:
                for rep in range(args.repeat):
                    # with a second mount, each goes first every other repetition (the second one ran faster by
                    # up to 12 % on d in A/Bs of two nearly identical trees, whichever tree it was)
                    sides = [(mnt, files, prof_dir, results.setdefault(wl, []))]
                    if mnt_b is not None:
                        sides.append((mnt_b, files_b, None, results_b.setdefault(wl, [])))
                    for m, fs, prof, out in (sides if rep % 2 == 0 else sides[::-1]):
                        out.append(run_pair(wl, args, env, m, native, fs, prof, rep))
            tuning = mnt.kernel_tuning()
            with contextlib.suppress(OSError, ValueError, KeyError):
                primed = {"tierfs": mnt.status()["write_prime"]}
        if args.floor:  # the floor logs its primer's counts when it exits
            with contextlib.suppress(OSError):
                primed["C floor"] = next((ln.split(": ", 1)[-1] for ln in (base / "floor-build" / "fuse_floor.log")
                                          .read_text().splitlines() if "write primer:" in ln), "off")
    rows = [summarize(wl, reps) for wl, reps in results.items()]
    print_report(rows, results, args.options, tuning, args.seconds, args.bdi)
    if results_b:
        print_ab(results, results_b, args.ab_src or floor_label(args, floor_opts))
    if primed:
        print(f"write primer over the whole run: {'; '.join(f'{k}: {v}' for k, v in primed.items())}")
    if prof_dir:
        print("\ndaemon profiles (py-spy, share of samples):")
        for wl, reps in results.items():
            for rep in reps:
                pf = rep["mount"].get("profile")
                if pf and Path(pf).exists():
                    s = C.summarize_speedscope(Path(pf), top=12)
                    rep["mount"]["profile_summary"] = s
                    print(f"  {wl} ({pf}, {s['samples']:.0f} samples)\n    self:")
                    for n, pct in s["self_pct"]:
                        print(f"      {pct:5.1f}%  {n}")
                    print("    inclusive:")
                    for n, pct in s["inclusive_pct"]:
                        print(f"      {pct:5.1f}%  {n}")
    if args.perf:
        print("\ndaemon CPU by symbol (perf, self time, kernel + user):")
        for wl, reps in results.items():
            for rep in reps:
                pd = rep["mount"].get("perf_data")
                if pd and Path(pd).exists():
                    top = C.perf_top_symbols(Path(pd), top=20)
                    rep["mount"]["perf_top"] = top
                    print(f"  {wl} ({pd})")
                    for ln in top:
                        print("    " + ln.strip())
    if args.json:
        doc = {"seconds": args.seconds, "options": args.options, "bdi": args.bdi, "tierfs_src": args.tierfs_src, "kernel": tuning,
               "summary": rows,
               "runs": results}
        C.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
