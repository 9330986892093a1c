#!/usr/bin/env python3
"""Ranged-GET benchmark: S3ObjectStore.get_range vs. raw boto3 get_object(Range=...) on the same objects.

Both sides read the same objects through the same HTTP server, alternating case by case, so the ratio shows what
the tierfs layer (key mapping, error mapping, exact-length checks, client configuration) costs or saves.
The raw side is a plain boto3 client as an application would make it (path-style addressing, the same pool size
and timeouts, botocore's default checksum settings).

For each read size: single-thread latency (p50 / p99, ms) and multi-thread throughput (MB/s) with --threads
readers, each side for --seconds. Random offsets, aligned to the read size, across --objects objects.

Server: --endpoint URL (with --bucket, --access-key, --secret-key), or by default a throwaway single-node Ceph RGW
started with tests/ceph_rgw.py (needs ceph-mon ceph-osd radosgw ceph-common) and stopped at the end.

    .venv/bin/python bench/objectstore_io.py
    .venv/bin/python bench/objectstore_io.py --sizes 4k,1m --seconds 5 --threads 16 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common as C  # noqa: E402

from tierfs.config import parse_size  # noqa: E402
from tierfs.objectstore import open_store  # noqa: E402


def latency(read: Callable[[int, int, int], bytes], n_objects: int, obj_size: int, size: int,
            seconds: float) -> list[float]:
    rnd = random.Random(1)
    slots = obj_size // size
    out: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        i, off = rnd.randrange(n_objects), rnd.randrange(slots) * size
        t = time.perf_counter()
        data = read(i, off, size)
        out.append(time.perf_counter() - t)
        assert len(data) == size
    out.sort()
    return out


def throughput(read: Callable[[int, int, int], bytes], n_objects: int, obj_size: int, size: int, seconds: float,
               threads: int) -> float:
    total = [0] * threads
    stop = threading.Event()

    def worker(w: int) -> None:
        rnd = random.Random(100 + w)
        slots = obj_size // size
        while not stop.is_set():
            total[w] += len(read(rnd.randrange(n_objects), rnd.randrange(slots) * size, size))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        futs = [pool.submit(worker, w) for w in range(threads)]
        time.sleep(seconds)
        stop.set()
        for f in futs:
            f.result()
        elapsed = time.perf_counter() - t0
    return sum(total) / elapsed / 1e6


@contextlib.contextmanager
def server(args):
    if args.endpoint:
        yield args.endpoint, args.access_key, args.secret_key
        return
    import ceph_rgw

    missing = ceph_rgw.missing_binaries()
    if missing:
        sys.exit(f"no --endpoint and Ceph binaries missing ({', '.join(missing)}); apt-get install -y "
                 f"--no-install-recommends {' '.join(ceph_rgw.APT_PACKAGES)}")
    run_dir = Path(tempfile.mkdtemp(prefix="tierfs-bench-ceph-"))
    r = ceph_rgw.RGW(run_dir)
    C.log(f"starting ceph + radosgw in {run_dir}")
    r.start()
    C.log(f"radosgw up in {r.startup_seconds:.1f}s at {r.endpoint_url}")
    try:
        r.make_bucket(args.bucket)
        yield r.endpoint_url, r.access_key, r.secret_key
    finally:
        r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", help="S3 endpoint URL (default: start a throwaway Ceph RGW)")
    ap.add_argument("--bucket", default="tierfs-bench")
    ap.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID"))
    ap.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    ap.add_argument("--objects", type=int, default=4)
    ap.add_argument("--object-size", default="64MiB")
    ap.add_argument("--sizes", default="4KiB,128KiB,1MiB,4MiB", help="read sizes, comma separated")
    ap.add_argument("--seconds", type=float, default=3.0, help="per case and side")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    C.install_signal_handlers()
    obj_size = parse_size(args.object_size)
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    with server(args) as (endpoint, ak, sk):
        store = open_store(f"s3://{args.bucket}/bench", endpoint_url=endpoint, access_key=ak, secret_key=sk,
                           max_pool_connections=max(16, args.threads * 2))
        import boto3
        from botocore.config import Config

        raw = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ak, aws_secret_access_key=sk,
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=max(16, args.threads * 2),
                          connect_timeout=5, read_timeout=30))
        keys = [f"obj-{i}" for i in range(args.objects)]
        C.log(f"uploading {args.objects} x {obj_size >> 20} MiB")
        with tempfile.NamedTemporaryFile() as tmp:
            C.write_data_file(Path(tmp.name), obj_size)
            for k in keys:
                if (info := store.head(k)) is None or info.size != obj_size:
                    store.put_file(k, tmp.name)
        full = [f"bench/{k}" for k in keys]

        def via_store(i: int, off: int, n: int) -> bytes:
            return store.get_range(keys[i], off, n)

        def via_boto3(i: int, off: int, n: int) -> bytes:
            r = raw.get_object(Bucket=args.bucket, Key=full[i], Range=f"bytes={off}-{off + n - 1}")
            return r["Body"].read()

        assert via_store(0, 4096, 100) == via_boto3(0, 4096, 100)
        rows, results = [], []
        for size in sizes:
            res: dict = {"size": size}
            for name, fn in (("boto3", via_boto3), ("store", via_store)):
                lat = latency(fn, len(keys), obj_size, size, args.seconds)
                res[name] = {"p50_ms": C.percentile(lat, 0.5) * 1e3, "p99_ms": C.percentile(lat, 0.99) * 1e3,
                             "n": len(lat),
                             "mb_s": throughput(fn, len(keys), obj_size, size, args.seconds, args.threads)}
            b, s = res["boto3"], res["store"]
            res["ratio_mb_s"] = s["mb_s"] / b["mb_s"] if b["mb_s"] else float("nan")
            res["ratio_p50"] = s["p50_ms"] / b["p50_ms"] if b["p50_ms"] else float("nan")
            results.append(res)
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            rows.append([label, b["p50_ms"], s["p50_ms"], b["p99_ms"], s["p99_ms"], b["mb_s"], s["mb_s"],
                         f"{res['ratio_mb_s']:.2f}", f"{res['ratio_p50']:.2f}"])
            C.log(f"{label}: done")
        store.delete_many(keys)
        store.close()
    print()
    print(f"ranged GET, {args.objects} x {obj_size >> 20} MiB objects, {args.threads} threads for MB/s, "
          f"{args.seconds:g} s per case and side")
    C.print_table(["read", "p50 boto3", "p50 store", "p99 boto3", "p99 store", "MB/s boto3", "MB/s store",
                   "MB/s ratio", "p50 ratio"], rows)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
