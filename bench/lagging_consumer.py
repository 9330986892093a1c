#!/usr/bin/env python3
"""Lagging-consumer benchmark: a consumer of one small topic reading fully evicted segments through the mount.

A store is written natively by examples/producer.py: --topics topics of equal traffic (20 topics: each carries 5%),
one queue each, small ConsumeQueue files so the queue's files seal and tier too. It is copied into a tierfs mount
(posix object store, or Ceph RGW with --s3; small cache budget) and waited for until every sealed segment is tiered and the cache holds
no more than its pinned pages. Then the consumer of topic 0 does what a broker serving a lagging pull does:

  opens every CommitLog file (the broker keeps them mapped), reads its ConsumeQueue files 200 units (4000 bytes)
  at a time, and for every 20-byte unit preads the CommitLog record it names
  (fadvise RANDOM on the CommitLog: page faults of the broker's mmap read around, they do not read a stream).

Every record is checked against the native store. Figures: bytes the daemon fetched from the object store
(engine fetch_bytes) over the bytes the consumer needed (ConsumeQueue pages read + record bytes), aim <= 1.5;
wall time; reads that waited on a fetch. With --ab-src DIR the same is measured on a daemon from another tree
(e.g. main, which has no layout-aware prefetch) in the same run.

    .venv/bin/python bench/lagging_consumer.py
    .venv/bin/python bench/lagging_consumer.py --s3 --ab-src /work/wt/base13 -o cache.block_bytes=4KiB
"""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
UNIT = struct.Struct(">qiq")
PAGE = 4096
CQ_READ = 4000  # the consumer reads its queue 200 units at a time (a multiple of the 20-byte unit)
BASE_OPTS = ("tiering.enabled=true,cache.max_bytes=256KiB,seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5,"
             "delete.grace_seconds=0,compaction.enabled=false,broker.max_hash_slot_num=500,broker.max_index_num=2000")


def produce(ref: Path, args: argparse.Namespace) -> None:
    r = subprocess.run([sys.executable, str(REPO / "examples" / "producer.py"), str(ref), "--commitlog-size",
                        str(args.commitlog_size), "--cq-size", str(args.cq_units * 20), "--index-slots", "500",
                        "--index-items", "2000", "--messages", str(args.messages), "--body-size", str(args.body_size),
                        "--topics", str(args.topics), "--queues", "1", "--topic-prefix", args.topic_prefix], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"producer failed: {r.stderr[-2000:]}")


def wait_evicted(m: C.TierfsMount, ref: Path, topic: str) -> int:
    """Every sealed CommitLog segment and ConsumeQueue file of `topic` tiered (the last of each stays hot), and
    nothing of them resident beyond pinned pages. Returns how many files are tiered."""
    cl = sorted(p.name for p in (ref / "commitlog").iterdir())
    cq = sorted(p.name for p in (ref / "consumequeue" / topic / "0").iterdir())
    want = [f"commitlog/{n}" for n in cl[:-1]] + [f"consumequeue/{topic}/0/{n}" for n in cq[:-1]]

    def done() -> bool:
        files = {f["path"]: f for f in m.status()["files"]}
        return all(files.get(p, {}).get("state") == "tiered" and files[p]["resident_bytes"] <= 2 * PAGE
                   for p in want)
    C.wait_until(done, 300, "sealed segments tiered and evicted")
    return sum(1 for f in m.status()["files"] if f["state"] == "tiered")


def consume(mnt: Path, ref: Path, topic: str, seg: int) -> dict:
    """Read the topic's queue 0 and every record it names through the mount; check each against `ref`."""
    qdir = mnt / "consumequeue" / topic / "0"
    needed = records = 0
    fds: dict[int, tuple[int, int]] = {}  # CommitLog base -> (mount fd, reference fd)
    t0 = time.perf_counter()
    try:
        for name in sorted(os.listdir(mnt / "commitlog")):  # all open, as the broker keeps its CommitLog mapped
            mfd = os.open(mnt / "commitlog" / name, os.O_RDONLY)
            os.posix_fadvise(mfd, 0, 0, os.POSIX_FADV_RANDOM)
            fds[int(name)] = (mfd, os.open(ref / "commitlog" / name, os.O_RDONLY))
        for name in sorted(os.listdir(qdir)):
            fd = os.open(qdir / name, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                end = False
                for off in range(0, size, CQ_READ):
                    page = os.pread(fd, CQ_READ, off)
                    needed += len(page)
                    for phys, n, _ in UNIT.iter_unpack(page[:len(page) // 20 * 20]):
                        if phys < 0 or n <= 0:
                            end = True
                            break
                        base = phys - phys % seg
                        if base not in fds:
                            mfd = os.open(mnt / "commitlog" / f"{base:020d}", os.O_RDONLY)
                            os.posix_fadvise(mfd, 0, 0, os.POSIX_FADV_RANDOM)
                            fds[base] = (mfd, os.open(ref / "commitlog" / f"{base:020d}", os.O_RDONLY))
                        mfd, rfd = fds[base]
                        got = os.pread(mfd, n, phys - base)
                        if got != os.pread(rfd, n, phys - base):
                            raise RuntimeError(f"record at CommitLog offset {phys} ({n} bytes) differs")
                        needed += n
                        records += 1
                    if end:
                        break
            finally:
                os.close(fd)
            if end:
                break
    finally:
        for a, b in fds.values():
            os.close(a)
            os.close(b)
    return {"seconds": time.perf_counter() - t0, "needed_bytes": needed, "records": records}


def measure(m: C.TierfsMount, ref: Path, args: argparse.Namespace) -> dict:
    tiered = wait_evicted(m, ref, f"{args.topic_prefix}0")
    for p in (m.mnt / "commitlog").iterdir():
        C.evict(p)
    for p in (m.mnt / "consumequeue").rglob("*"):
        if p.is_file():
            C.evict(p)
    e0, cpu0 = dict(m.status()["totals"]["engine"]), C.daemon_cpu_seconds(m.pid)
    res = consume(m.mnt, ref, f"{args.topic_prefix}0", args.commitlog_size)
    e1 = m.status()["totals"]["engine"]
    d = {k: e1[k] - e0.get(k, 0) for k in e1 if isinstance(e1[k], int)}
    res.update(tiered_files=tiered, daemon_cpu_s=round(C.daemon_cpu_seconds(m.pid) - cpu0, 2),
               fetch_bytes=d.get("fetch_bytes", 0), fetches=d.get("fetches", 0),
               named_prefetch_bytes=d.get("named_prefetch_bytes", 0), reads_waited=d.get("reads_waited", 0),
               reads_local=d.get("reads_local", 0))
    res["fetched_per_needed"] = res["fetch_bytes"] / res["needed_bytes"] if res["needed_bytes"] else float("nan")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=60_000)
    ap.add_argument("--body-size", type=int, default=1024)
    ap.add_argument("--topics", type=int, default=20, help="topics of equal traffic; topic 0 is consumed")
    ap.add_argument("--topic-prefix", default="BenchTopic")
    ap.add_argument("--commitlog-size", type=int, default=16 * MiB)
    ap.add_argument("--cq-units", type=int, default=1000, help="units per ConsumeQueue file")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE[,...]")
    ap.add_argument("--ab-src", metavar="DIR", help="also measure a daemon from this tree in the same run")
    ap.add_argument("--s3", action="store_true", help="a Ceph RGW on 127.0.0.1 as the object store (default: posix)")
    ap.add_argument("--dir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.ab_src and not (Path(args.ab_src) / "tierfs" / "__init__.py").is_file():
        ap.error(f"--ab-src {args.ab_src}: no tierfs/ package there")
    C.install_signal_handlers()
    sides = [("this tree", None)] + ([("--ab-src", args.ab_src)] if args.ab_src else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in sides}
    with C.temp_base(args.dir, prefix="tierfs-lag-", keep=args.keep) as base, contextlib.ExitStack() as stack:
        ref = base / "ref"
        C.log("producing the native store...")
        produce(ref, args)
        store = [""] * len(sides)  # the default posix object store in each state dir
        if args.s3:
            rgw = stack.enter_context(C.ceph_rgw(memstore_bytes=2 << 30, keep=args.keep))
            bucket = rgw.make_bucket("tierfs-lag")
            store = [C.rgw_store_options(rgw, bucket, f"side{i}") for i in range(len(sides))]
        mounts = {}
        for i, (name, src) in enumerate(sides):
            opts = [BASE_OPTS, *([store[i]] if store[i] else []), *args.options]
            mounts[name] = stack.enter_context(C.TierfsMount(base / f"hot{i}", base / f"mnt{i}", opts,
                                                             tierfs_src=src))
            C.copy_tree_in(ref, mounts[name].mnt)
        for rep in range(args.repeat):
            for name, _ in (sides if rep % 2 == 0 else sides[::-1]):
                r = measure(mounts[name], ref, args)
                runs[name].append(r)
                C.log(f"rep{rep} {name}: fetched/needed {r['fetched_per_needed']:.2f} "
                      f"({r['fetch_bytes'] / 1e6:.1f} / {r['needed_bytes'] / 1e6:.2f} MB), {r['seconds']:.2f} s, "
                      f"{r['records']} records, {r['fetches']} GETs, waited reads {r['reads_waited']}, named prefetch "
                      f"{r['named_prefetch_bytes'] / 1e6:.1f} MB, daemon CPU {r['daemon_cpu_s']} s")
    print(f"\nlagging consumer of 1 of {args.topics} topics ({100 / args.topics:.0f}% of the traffic), "
          f"{args.messages} messages of {args.body_size} B, CommitLog {args.commitlog_size >> 20} MiB; "
          f"-o {','.join(args.options) or '(bench defaults)'}")
    rows = []
    for name, rs in runs.items():
        rows.append([name, round(C.median(r["fetched_per_needed"] for r in rs), 2), "<= 1.5",
                     round(C.median(r["seconds"] for r in rs), 2), round(C.median(r["fetches"] for r in rs)),
                     round(C.median(r["daemon_cpu_s"] for r in rs), 2),
                     round(C.median(r["fetch_bytes"] for r in rs) / 1e6, 1),
                     round(C.median(r["needed_bytes"] for r in rs) / 1e6, 2)])
    C.print_table(["daemon", "fetched/needed", "aim", "seconds", "GETs", "daemon CPU s", "fetched MB", "needed MB"], rows)
    print(f"({C.DAEMON_CPU_NOTE})")
    if args.json:
        C.write_json(args.json, {"options": args.options, "ab_src": args.ab_src, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
