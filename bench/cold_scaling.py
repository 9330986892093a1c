#!/usr/bin/env python3
"""Cold-read scaling: MB/s and daemon CPU of concurrent sequential readers of evicted CommitLog segments, by the
number of readers (1, 2, 4, 8) and by `objectstore.max_concurrency` (8, 16, 32), against boto3 ranged GETs of the
same chunk objects at the same total concurrency, in one table.

One throwaway Ceph RGW on 127.0.0.1 (RAM-backed OSD) and one hot dir. The segments (real sealed CommitLog bytes,
bench/cold_read.py's generator) are written through the mount once, tiered and evicted; for each
max_concurrency the same hot dir is mounted again with that setting (the catalog and the objects stay). Before
every tierfs measurement the segments read are evicted to 0 resident bytes (checked). Every byte read is
checked against crc32c per MiB on both sides. The daemon's CPU includes its helper processes. Sides alternate
order per cell; with --repeat the figures are medians.

So a user on a bigger machine knows what to expect: on 2 cores the daemon, RGW and the readers share the CPU,
so the table shows where each side stops scaling and what a byte costs the daemon.

    .venv/bin/python bench/cold_scaling.py                                # 256 MiB segments, about 6 minutes
    .venv/bin/python bench/cold_scaling.py --size 128MiB --readers 1,2,4 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common as C  # noqa: E402
import cold_read as R  # noqa: E402

from tierfs.config import parse_size  # noqa: E402

GiB = 1 << 30


def write_segments(mnt: C.TierfsMount, base: Path, size: int, n: int) -> dict[str, list[int]]:
    """n sealed segments written through the mount; their per-MiB crc32c lists by path."""
    (mnt.mnt / "commitlog").mkdir(exist_ok=True)
    ref = base / "reference-segment"
    R.write_commitlog_segment(ref, size)
    crcs = {R.SEGMENT: R.piece_crcs(ref)}
    with open(ref, "rb") as src, open(mnt.mnt / R.SEGMENT, "wb") as dst:
        shutil.copyfileobj(src, dst, R.MiB)
        dst.flush()
        os.fsync(dst.fileno())
    ref.unlink()
    if n > 1:
        crcs.update(R.write_multi_segments(mnt, base, size, n))
    return crcs


def measure_cell(mnt: C.TierfsMount, client, bucket: str, crcs: dict[str, list[int]], size: int, chunk: int,
                 conc: int, parts: list[int], rep: int) -> dict:
    """One (readers, max_concurrency) cell: tierfs and boto3, alternating who goes first."""
    out: dict = {}
    for side in (("tierfs", "boto3") if rep % 2 == 0 else ("boto3", "tierfs")):
        if side == "tierfs":
            out["tierfs"] = R.run_tierfs_multi(mnt, crcs, size)
        else:
            out["boto3"] = R.run_multi_boto3(mnt, client, bucket, crcs, chunk, size, parts, conc)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB", help="size of each segment (default 256MiB)")
    ap.add_argument("--readers", default="1,2,4,8", help="numbers of concurrent readers")
    ap.add_argument("--concurrency", default="8,16,32", help="objectstore.max_concurrency values")
    ap.add_argument("--part-sizes", default="4MiB,16MiB", help="boto3 ranged-GET sizes to try (best one counts)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE[,...]")
    ap.add_argument("--bucket", default="tierfs-scaling")
    ap.add_argument("--dir", help="base dir for the temp files and mountpoints (default $TMPDIR)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    size = parse_size(args.size)
    readers = [int(x) for x in args.readers.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    parts = [parse_size(p) for p in args.part_sizes.split(",")]
    if size < 64 * R.MiB or size % R.MiB:
        ap.error("--size must be a multiple of 1 MiB, at least 64 MiB")
    C.install_signal_handlers()
    n = max(readers)
    cells: list[dict] = []
    with C.ceph_rgw(memstore_bytes=max(4 << 30, int(1.5 * n * size) + (1 << 30)), keep=args.keep) as rgw, \
            C.temp_base(args.dir, prefix="tierfs-scaling-", keep=args.keep) as base:
        bucket = rgw.make_bucket(args.bucket)
        s3 = C.rgw_store_options(rgw, bucket, "tierfs")
        crcs: dict[str, list[int]] = {}
        for ci, conc in enumerate(concs):
            opts = [R.BASE_OPTS, s3, f"objectstore.max_concurrency={conc}", *args.options]
            with C.TierfsMount(base / "hot", base / "mnt", opts) as mnt:
                cfg = mnt.config()
                chunk = int(cfg["objectstore.chunk_bytes"])
                R.check_readahead(mnt, int(cfg["mount.read_ahead_kb"]))
                if ci == 0:
                    C.log(f"writing {n} segments of {size >> 20} MiB through the mount...")
                    crcs = write_segments(mnt, base, size, n)
                client = R.s3_client(rgw.endpoint_url, rgw.access_key, rgw.secret_key, conc + 4)
                for k in readers:
                    sub = dict(list(crcs.items())[:k])
                    reps = [measure_cell(mnt, client, bucket, sub, size, chunk, conc, parts, rep)
                            for rep in range(args.repeat)]
                    gib = k * size / GiB
                    cell = {
                        "concurrency": conc, "readers": k,
                        "tierfs_MBps": C.median(r["tierfs"]["MBps"] for r in reps),
                        "boto3_MBps": C.median(r["boto3"]["MBps"] for r in reps),
                        "ratio": C.median(r["tierfs"]["MBps"] / r["boto3"]["MBps"] for r in reps),
                        "daemon_cpu_s_per_GiB": C.median(r["tierfs"]["daemon_cpu_s"] for r in reps) / gib,
                        "boto3_cpu_s_per_GiB": C.median(r["boto3"]["client_cpu_s"] for r in reps) / gib,
                        "peak_rss_mb": max(r["tierfs"]["daemon_peak_rss_mb"] or 0 for r in reps),
                        "boto3_part_mib": reps[-1]["boto3"]["part"] >> 20,
                    }
                    cells.append(cell)
                    C.log(f"c={conc} readers={k}: tierfs {cell['tierfs_MBps']:.0f} MB/s, boto3 "
                          f"{cell['boto3_MBps']:.0f} MB/s, daemon CPU {cell['daemon_cpu_s_per_GiB']:.2f} s/GiB")
    print(f"\ntierfs cold-read scaling ({size >> 20} MiB evicted segments per reader, Ceph RGW on 127.0.0.1, "
          f"{os.cpu_count()} CPUs, repeat {args.repeat}; boto3 at the same total concurrency, best part size; "
          f"{C.DAEMON_CPU_NOTE})")
    C.print_table(["max_concurrency", "readers", "tierfs MB/s", "boto3 MB/s", "tierfs/boto3", "daemon CPU s/GiB",
                   "boto3 CPU s/GiB", "CPU ratio", "daemon peak RSS MB"],
                  [[c["concurrency"], c["readers"], round(c["tierfs_MBps"]), round(c["boto3_MBps"]),
                    f"{c['ratio']:.2f}", f"{c['daemon_cpu_s_per_GiB']:.2f}", f"{c['boto3_cpu_s_per_GiB']:.2f}",
                    f"{c['daemon_cpu_s_per_GiB'] / c['boto3_cpu_s_per_GiB']:.2f}", c["peak_rss_mb"]]
                   for c in cells])
    if args.json:
        Path(args.json).write_text(json.dumps({"size": size, "cells": cells, "when": time.time()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
