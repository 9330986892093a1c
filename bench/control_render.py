#!/usr/bin/env python3
"""The control dir's segment views on a store of N catalog rows (default 100,000): how long `status.json`,
`status` and `segments` take to read, and how long an unrelated FUSE request waits while they render.

The store is bench/scale.py's tree of N tiny sealed ConsumeQueue files, mounted once until every file is tiered
(N catalog rows); `--store DIR` keeps it there for later runs (built on the first). Then, for each
`--variant NAME=SRC` (the daemon from that source tree; default: this one), the same hot dir is mounted and:

  1. a probe times `statvfs` of the mount (a STATFS request, answered on the daemon's trio loop like every
     other request) every --probe-interval-ms for --idle-seconds: the latency with nothing rendering;
  2. each view is read --repeat times back to back while the probe runs: read seconds (median), size, and the
     probe's latency for the requests sent while a read was in flight (p50, p99, max);
  3. the daemon's peak RSS (VmHWM) before and after the reads.

Variants see the same catalog, so `files` of status.json and the whole `segments` text must be identical across
variants: the report says so.

    .venv/bin/python bench/control_render.py --store /tmp/ctl-100k --variant before=/tmp/src-before --variant after=.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import scale  # noqa: E402

VIEWS = ("status.json", "status", "segments")
BUILT = "control-render-built"  # marker in --store: the tree is written and every file tiered


def vm_hwm(pid: int) -> int:
    """The daemon's peak resident set (bytes)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmHWM"].split()[0]) * 1024


class Probe:
    """statvfs of the mount every `interval` s from a thread: (start time, latency) of each."""

    def __init__(self, mnt: Path, interval: float):
        self.mnt, self.interval = str(mnt), interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            os.statvfs(self.mnt)
            self.samples.append((t, time.perf_counter() - t))
            self._stop.wait(self.interval)

    def __enter__(self) -> "Probe":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def summary(latencies: list[float]) -> dict:
    s = sorted(latencies)
    if not s:
        return {"n": 0}
    return {"n": len(s), "p50_ms": C.percentile(s, .5) * 1e3, "p99_ms": C.percentile(s, .99) * 1e3,
            "max_ms": s[-1] * 1e3}


def build(hot: Path, mnt: Path, args: argparse.Namespace, src: str | None) -> None:
    paths = scale.tree_paths(args.n, 4, 2, 50)
    t = time.perf_counter()
    scale.write_tree([hot], paths, 50, time.time() - 3600)
    C.log(f"wrote {args.n} files in {time.perf_counter() - t:.0f}s; mounting until all are tiered")
    with C.TierfsMount(hot, mnt, [scale.BASE_OPTS], tierfs_src=src) as m:
        assert m.pid is not None
        res = scale.wait_tiered(hot / ".tierfs" / "catalog.db", args.n, args.tier_timeout, m.pid)
        if res.get("timed_out"):
            raise SystemExit(f"not all tiered after {args.tier_timeout}s: {res}")
        C.log(f"all {args.n} tiered after {res['tiered_s']:.0f}s")


def measure(name: str, src: str | None, hot: Path, mnt: Path, args: argparse.Namespace) -> dict:
    res: dict = {"variant": name, "src": src, "views": {}}
    with C.TierfsMount(hot, mnt, [scale.BASE_OPTS], tierfs_src=src) as m:
        assert m.pid is not None
        ctl = m.mnt / ".tierfs"
        C.wait_until(lambda: len(json.loads((ctl / "status.json").read_bytes())["files"]) >= args.n, 120,
                     f"{args.n} catalog rows in status.json")
        with Probe(m.mnt, args.probe_interval_ms / 1e3) as idle:
            time.sleep(args.idle_seconds)
        res["idle"] = summary([lat for _, lat in idle.samples])
        res["hwm_before"] = vm_hwm(m.pid)
        for view in VIEWS:
            windows, times, content = [], [], b""
            with Probe(m.mnt, args.probe_interval_ms / 1e3) as busy:
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    content = (ctl / view).read_bytes()
                    windows.append((t, time.perf_counter()))
                    times.append(windows[-1][1] - t)
            during = [lat for t0, lat in busy.samples if any(a <= t0 < b for a, b in windows)]
            res["views"][view] = {"read_s": C.median(times), "bytes": len(content), **summary(during)}
            if view == "status.json":
                res["files"] = json.loads(content)["files"]
            elif view == "segments":
                res["segments"] = content
        res["hwm_after"] = vm_hwm(m.pid)
    return res


def report(results: list[dict], n: int) -> None:
    print(f"\ncontrol-dir views, {n} catalog rows; FUSE probe = statvfs through the mount, ms")
    rows = []
    for r in results:
        i = r["idle"]
        rows.append([r["variant"], "(idle)", "", "", i["n"], i["p50_ms"], i["p99_ms"], i["max_ms"]])
        for view, v in r["views"].items():
            rows.append([r["variant"], view, v["read_s"], v["bytes"] / (1 << 20), v["n"], v.get("p50_ms"),
                         v.get("p99_ms"), v.get("max_ms")])
    C.print_table(["variant", "view", "read s", "MiB", "probes", "p50", "p99", "max"], rows)
    for r in results:
        print(f"  {r['variant']}: daemon peak RSS {r['hwm_before'] / (1 << 20):.0f} -> "
              f"{r['hwm_after'] / (1 << 20):.0f} MiB")
    first = results[0]
    for r in results[1:]:
        same = r["files"] == first["files"] and r["segments"] == first["segments"]
        print(f"  {r['variant']}: status.json files and segments identical to {first['variant']}'s: "
              f"{'yes' if same else 'NO'}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="catalog rows (tiny tiered files; default 100,000)")
    ap.add_argument("--store", help="keep the built store here and reuse it in later runs (default: a temp dir)")
    ap.add_argument("--dir", help="parent of the temp dir when there is no --store (default $TMPDIR)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SRC",
                    help="a daemon from source tree SRC (repeatable; default: this tree)")
    ap.add_argument("--repeat", type=int, default=5, help="reads of each view (default 5)")
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--probe-interval-ms", type=float, default=2.0)
    ap.add_argument("--tier-timeout", type=float, default=3600, help="longest wait for the build's tiering (s)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures (without contents) to FILE")
    args = ap.parse_args(argv)
    args.variants = [(v.split("=", 1)[0], v.split("=", 1)[1] or None) if "=" in v else (v, None)
                     for v in args.variant] or [("this", None)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    C.install_signal_handlers()
    with contextlib.ExitStack() as stack:
        base = Path(args.store).resolve() if args.store else \
            stack.enter_context(C.temp_base(args.dir, prefix="tierfs-ctl-"))
        hot, mnt = base / "hot", base / "mnt"
        if not (base / BUILT).exists():
            hot.mkdir(parents=True, exist_ok=True)
            build(hot, mnt, args, args.variants[0][1])
            (base / BUILT).write_text(f"{args.n}\n")
        results = [measure(name, src, hot, mnt, args) for name, src in args.variants]
    report(results, args.n)
    if args.json:
        C.write_json(args.json, {"n": args.n, "results": [{k: v for k, v in r.items() if k not in ("files", "segments")}
                                                          for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
