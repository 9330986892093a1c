"""A real RocketMQ broker (5.5.0) on native disk, on tierfs, and with RocketMQ's own tiered store plug-in, in
one run with the same workload: produce throughput and p99 send latency, then a lagging consumer group reading
everything from offset 0 after a broker restart, with the data evicted (tierfs) or read from the tier
(plug-in, tieredStorageLevel=FORCE).

    python bench/broker.py [--messages 40000] [--body 1024] [--repeat 3] [--json out.json]
    python bench/broker.py --produce-only --repeat 3 [--py-spy DIR]   # produce only, native/tierfs alternated
    python bench/broker.py --group [--messages 40000] [--repeat 3]   # a master+slave group, native vs tierfs

tierfs's objects go to a throwaway Ceph RGW on 127.0.0.1 (tests/ceph_rgw.py; a memstore OSD, so objects are in
RAM but every GET and PUT is HTTP through radosgw), as in production on S3; --store file puts them in a file://
directory on the same disk instead. The plug-in runs the backend its Maven artifact has: rocketmq-tiered-store
5.5.0 ships no S3 provider (the bench lists the jar's providers and says so), so it tiers to a directory on the
local disk with its POSIX provider.

Each round runs every side once, the order rotated from round to round (native, tierfs, plug-in; then tierfs,
plug-in, native; ...), so no side always runs first on a fresh machine or right after another's writeback; the
ratios printed are the medians of the per-round paired ratios, with every round's.

With --produce-only only the produce phase runs, native and tierfs rotated --repeat times (medians), plus a
tierfs mount with continuous tiering off (tiering.rpo_seconds=0) so its cost shows in the same run; the FUSE
requests of each tierfs produce are printed. --variant NAME[@SRC]=OPTS adds a tierfs mount with other options or
from another source tree (an A/B in the same run); --py-spy DIR samples the daemon during its produce phases.

Ratios printed: produce tierfs/native (aim >= 0.9), p99 native/tierfs, lagging read tierfs/native (aim >= 0.7)
and tierfs/plug-in (aim >= 1.0). CPU seconds per phase of the broker, of the tierfs daemon with its helper
processes (flusher, write primer) and of the RGW's processes while tierfs runs (on this machine they share the
cores with the broker). The broker runs flushDiskType=SYNC_FLUSH in all three (an acknowledged message is on
disk). tierfs runs its defaults otherwise, continuous tiering included. Before the lagging read the broker is
restarted and the store's files (and tierfs's hot dir, and the plug-in's tier files) are dropped from the page
cache with POSIX_FADV_DONTNEED, so no configuration reads from memory it kept from the produce phase (the RGW's
memstore cannot be dropped: tierfs's GETs are served from its RAM).
With --group a 5.5.0 broker group in controller mode (a controller, a master and a slave, each broker its own
JVM and store root) runs on native disk (two store roots on the disk) and on tierfs (both store roots below one
mount, its objects on the RGW, the sealed segments of both stores tiered and evicted before the reads), the two
sides rotated per round: produce rate (an acknowledgement means both replicas have the message,
allAckInSyncStateSet), then both brokers are restarted with their files dropped from the page cache and a lagging
consumer reads everything from offset 0 off the master; then kill -9 of the master, and the failover time is the
time from the kill to the first acknowledged send on the member the controller promoted (each try a client JVM
of its own: its start-up is in the figure, on both sides alike); a last consumer reads everything off the new
master. Every read checks every acknowledged message by content. Ratios: produce and lagging read tierfs/native,
failover native/tierfs (above 1: tierfs fails over faster).
Needs the Maven artifacts that ./mount-scripts/test resolves (tests/brokerutil.py) and Ceph (tests/ceph_rgw.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _common as C  # noqa: E402
import brokerutil as B  # noqa: E402

VERSION = "5.5.0"
TOPIC = "BENCH"
QUEUES = 8
CACHE = "8MiB"
TIER_OPTS = (f"tiering.enabled=true,cache.max_bytes={CACHE},cache.block_bytes=256KiB,objectstore.chunk_bytes=1MiB,"
             "seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5,compaction.enabled=false,"
             f"broker.max_hash_slot_num={B.HASH_SLOTS},broker.max_index_num={B.INDEX_NUM}")
SIDES = ("native", "tierfs", "plugin")
BUCKET = "tierfs-bench-broker"
PROVIDERS = "org/apache/rocketmq/tieredstore/provider/"


class ObjectStore:
    """Where the tierfs mounts put their objects: a Ceph RGW on 127.0.0.1, or (rgw None) a file:// directory."""

    def __init__(self, rgw: object | None):
        self.rgw = rgw
        if rgw is not None:
            rgw.make_bucket(BUCKET)  # type: ignore[attr-defined]

    def describe(self) -> str:
        if self.rgw is None:
            return "tierfs objects: file:// directory on the same disk (--store file)"
        url = getattr(self.rgw, "endpoint_url", "?")
        return (f"tierfs objects: Ceph RGW at {url} (memstore OSD: objects in RAM, every PUT/GET over HTTP through "
                f"radosgw), bucket {BUCKET}")

    def options(self, run: Path, name: str) -> str:
        if self.rgw is None:
            return f"objectstore.url=file://{run / 'objects'}"
        return C.rgw_store_options(self.rgw, BUCKET, name)

    def backing(self, run: Path) -> tuple[Path, ...]:
        """Local directories holding the objects, dropped from the page cache before a lagging read."""
        return (run / "objects",) if self.rgw is None else ()

    def cpu(self) -> float:
        return C.rgw_cpu_seconds(self.rgw) if self.rgw is not None else 0.0

    def segment_sizes(self, run: Path, name: str, store_id: str) -> dict[str, int]:
        """key -> size of every segment object (seg/ and cas/) of store id `store_id` of run `name`."""
        if self.rgw is None:
            root = run / "objects"
            return {str(f.relative_to(root)): f.stat().st_size for pre in ("seg", "cas")
                    for f in (root / store_id / pre).rglob("*") if f.is_file()}
        client, out = self.rgw.client(), {}  # type: ignore[attr-defined]
        for pre in ("seg", "cas"):
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                          Prefix=f"{name}/{store_id}/{pre}/"):
                out.update({o["Key"][len(name) + 1:]: o["Size"] for o in page.get("Contents", [])})
        return out

    def forget(self, name: str) -> None:
        """Delete a finished run's objects (the memstore keeps them in RAM)."""
        if self.rgw is not None:
            C.delete_prefix(self.rgw, BUCKET, name)


@contextlib.contextmanager
def object_store(kind: str, objects: int) -> Iterator[ObjectStore]:
    if kind == "file":
        yield ObjectStore(None)
        return
    with C.ceph_rgw(memstore_bytes=max(2 << 30, 4 * objects)) as rgw:
        yield ObjectStore(rgw)


def plugin_backend() -> tuple[str, str]:
    """The plug-in's backend provider and why: the provider classes of the rocketmq-tiered-store jar on the
    broker's classpath (5.5.0: FileSegment's subclasses for memory and POSIX only; the S3 one lives in
    apache/rocketmq-externals' rocketmq-tieredstore-s3, a 0.0.1-SNAPSHOT that is not on Maven Central)."""
    jar = next((p for p in B.classpath(VERSION).split(":") if "rocketmq-tiered-store" in Path(p).name), None)
    if jar is None:
        raise SystemExit(f"no rocketmq-tiered-store jar on the {VERSION} classpath ({B.classpath_file(VERSION)})")
    with zipfile.ZipFile(jar) as z:
        found = sorted(n[len(PROVIDERS):-len(".class")] for n in z.namelist()
                       if n.startswith(PROVIDERS) and n.endswith("FileSegment.class") and n.count("/") == 5
                       and n != PROVIDERS + "FileSegment.class")  # the abstract base
    s3 = [c for c in found if "s3" in c.lower()]
    why = (f"plug-in backend: PosixFileSegment on the local disk: {Path(jar).name} has the providers "
           f"{', '.join(found)}")
    why += (f" ({', '.join(s3)} is there but not wired into this bench)" if s3 else
            "; no S3 provider resolves from Maven (apache/rocketmq-externals' rocketmq-tieredstore-s3 is an "
            "unpublished 0.0.1-SNAPSHOT)")
    return "org.apache.rocketmq.tieredstore.provider.PosixFileSegment", why


def rotation(names: Sequence[str], i: int) -> list[str]:
    """Round i's order: the list rotated by i, so each side takes every position in turn."""
    k = i % len(names)
    return [*names[k:], *names[:k]]


def drop_cache(root: Path) -> None:
    """POSIX_FADV_DONTNEED on every regular file under root (only this store's pages)."""
    for p in root.rglob("*"):
        if p.is_file() and ".tierfs" not in p.parts:
            try:
                C.evict(p)
            except OSError:
                pass


def mostly_evicted(mount: C.TierfsMount) -> bool:
    st = mount.status()
    cl = [f for f in st["files"] if f["kind"] == "commitlog" and f["state"] == "tiered"]
    return bool(cl) and st["totals"]["upload_backlog_files"] == 0 and \
        sum(f["resident_bytes"] < f["size"] for f in cl) * 4 >= len(cl) * 3


def tiering_progress(mount: C.TierfsMount) -> str:
    st = mount.status()
    cl = [f for f in st["files"] if f["kind"] == "commitlog"]
    tiered = [f for f in cl if f["state"] == "tiered"]
    return (f"{len(tiered)} of {len(cl)} CommitLog files tiered, {sum(f['resident_bytes'] < f['size'] for f in tiered)}"
            f" evicted, upload backlog {st['totals']['upload_backlog_files']} files")


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


class Meter:
    """CPU seconds of the broker, of the tierfs daemon with its helpers and of the object store's servers over a
    phase (the last two only for a tierfs side)."""

    def __init__(self, rmq: B.RocketMQ, mount: C.TierfsMount | None, store: ObjectStore | None):
        self.rmq, self.mount, self.store = rmq, mount, store
        self.b0 = B.cpu_seconds(rmq.broker.pid)
        self.d0 = C.daemon_cpu_seconds(mount.pid) if mount else 0.0
        self.s0 = store.cpu() if mount and store else 0.0

    def read(self, phase: str) -> dict[str, float]:
        out = {f"{phase}_broker_cpu_s": B.cpu_seconds(self.rmq.broker.pid) - self.b0}
        if self.mount:
            out[f"{phase}_daemon_cpu_s"] = C.daemon_cpu_seconds(self.mount.pid) - self.d0
            if self.store is not None and self.store.rgw is not None:
                out[f"{phase}_rgw_cpu_s"] = self.store.cpu() - self.s0
        return out


def produce(name: str, rmq: B.RocketMQ, store: Path, args: argparse.Namespace, base: Path,
            extra: dict[str, object], mount: C.TierfsMount | None = None,
            objects: ObjectStore | None = None) -> tuple[dict, Path]:
    """Start the broker on `store`, create the topic and send args.messages synchronously (64 threads)."""
    conf = rmq.broker_conf(store, **extra)
    rmq.start_broker(conf)
    rmq.client("topics", rmq.ns_addr, rmq.broker_addr, QUEUES, TOPIC)
    meter = Meter(rmq, mount, objects)
    s0 = mount.stats() if mount else {}
    spy = C.py_spy_record(mount.pid, Path(args.py_spy) / f"{name}.speedscope.json") \
        if mount and args.py_spy else contextlib.nullcontext()
    with spy:
        prod = rmq.client("produce", rmq.ns_addr, B.BROKER_NAME, TOPIC, QUEUES, 0, args.messages, args.body, 64,
                          base / f"acked-{name}", timeout=600)
    if prod["acked"] != args.messages:
        raise SystemExit(f"{name}: only {prod['acked']} of {args.messages} sends acknowledged: {prod}")
    out = {"produce_msgs_s": args.messages / prod["secs"], "produce_MB_s": args.messages * args.body / prod["secs"]
           / 1e6, "p99_ms": prod["p99_ms"], **meter.read("produce")}
    if mount:
        out["fuse_ops"] = {k: f"{v['count']}x{v['mean_us']:.0f}us"
                           for k, v in C.stats_delta(s0, mount.stats())["ops"].items() if v["count"] >= 100}
    return out, conf


def run_config(name: str, rmq: B.RocketMQ, store: Path, args: argparse.Namespace, base: Path,
               extra: dict[str, object], mount: C.TierfsMount | None = None, tier_dir: Path | None = None,
               backing: tuple[Path, ...] = (), objects: ObjectStore | None = None) -> dict:
    out, conf = produce(name, rmq, store, args, base, extra, mount, objects)
    if mount:
        C.wait_until(lambda: mostly_evicted(mount), 120, "3/4 of the CommitLog segments tiered and evicted",
                     progress=lambda: tiering_progress(mount))
    if tier_dir is not None:  # the plug-in uploads in the background: wait until its CommitLog stops growing
        sizes = [-1]

        def settled() -> bool:
            sizes.append(tree_bytes(tier_dir))
            return sizes[-1] >= args.messages * args.body and sizes[-1] == sizes[-2]
        C.wait_until(settled, 120, "the tiered store plug-in holding every message")
    rmq.stop_broker(signal.SIGTERM)
    for root in (store, *backing, *((tier_dir,) if tier_dir is not None else ())):
        drop_cache(root)  # tierfs: also its hot dir (and a file:// object store), so no side reads from memory
    rmq.start_broker(conf)
    meter = Meter(rmq, mount, objects)
    cons = rmq.client("consume", rmq.ns_addr, B.BROKER_NAME, TOPIC, QUEUES, 0, args.messages, args.body,
                      f"lagging-{name}", base / f"acked-{name}", timeout=600)
    if cons["bad"] or cons["missing"]:
        raise SystemExit(f"{name}: the lagging read got wrong or missing messages: {cons}")
    out.update(read_msgs_s=args.messages / cons["secs"], read_MB_s=cons["body_bytes"] / cons["secs"] / 1e6,
               **meter.read("read"))
    rmq.stop_broker(signal.SIGKILL)
    C.log(f"{name}: {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=40_000)
    ap.add_argument("--body", type=int, default=1024, help="message body bytes")
    ap.add_argument("--tmp", default=None, help="parent of the bench's temp dir (default $TMPDIR)")
    ap.add_argument("--json", default="", help="write the figures here too")
    ap.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE[,...]",
                    help="extra tierfs mount options (e.g. tiering.rpo_seconds=0)")
    ap.add_argument("--store", choices=("rgw", "file"), default="rgw",
                    help="tierfs's object store: a throwaway Ceph RGW on 127.0.0.1 (default) or a file:// directory")
    ap.add_argument("--produce-only", action="store_true", help="only the produce phase, native/tierfs rotated")
    ap.add_argument("--repeat", type=int, default=None,
                    help="rounds, medians and per-round ratios (default 1; 3 with --produce-only)")
    ap.add_argument("--py-spy", default="", metavar="DIR", help="sample the tierfs daemon while it produces")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME[@SRC]=KEY=VALUE,...",
                    help="--produce-only: one more tierfs mount with these options (and this source tree)")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME",
                    help="--produce-only: leave out a default variant (tierfs, tierfs-rpo0)")
    ap.add_argument("--group", action="store_true",
                    help="a master+slave group (5.5.0 controller mode) on native and on tierfs, with a failover")
    args = ap.parse_args()
    C.install_signal_handlers()
    if args.group:
        group_bench(args)
        return
    if args.py_spy:
        Path(args.py_spy).mkdir(parents=True, exist_ok=True)
    if args.produce_only:
        args.repeat = args.repeat or 3
        produce_only(args)
        return
    provider, why = plugin_backend()
    rounds: list[dict[str, dict]] = []
    t0 = time.monotonic()
    with C.temp_base(args.tmp, "tierfs-bench-broker-") as base, \
            object_store(args.store, 3 * args.messages * args.body) as objects:
        rmq = B.RocketMQ(VERSION, base / "home")
        try:
            rmq.start_namesrv()
            for i in range(args.repeat or 1):
                rounds.append(full_round(rmq, base / f"round-{i}", args, objects, provider, i))
                shutil.rmtree(base / f"round-{i}", ignore_errors=True)
        finally:
            rmq.close()
    per_round = [round_ratios(r) for r in rounds]
    ratios = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    results = {k: {c: statistics.median(r[k][c] for r in rounds) for c in rounds[0][k] if c not in ("fuse_ops",
                                                                                                    "position")}
               for k in SIDES}
    cols = ["produce_msgs_s", "produce_MB_s", "p99_ms", "read_msgs_s", "read_MB_s", "produce_broker_cpu_s",
            "read_broker_cpu_s", "produce_daemon_cpu_s", "read_daemon_cpu_s", "produce_rgw_cpu_s", "read_rgw_cpu_s"]
    C.print_table(["config", *cols], [[k, *(C.fmt_num(v.get(c, "")) for c in cols)] for k, v in results.items()])
    print(f"(medians over rounds; {C.DAEMON_CPU_NOTE}; rgw CPU: the RGW's processes during tierfs's phases)")
    C.print_table(["ratio (median of per-round paired ratios)", "median", "per round", "aim"],
                  [[k, f"{v:.2f}", ", ".join(f"{r[k]:.2f}" for r in per_round), a]
                   for (k, v), a in zip(ratios.items(), (">= 0.9", "", ">= 0.7", ">= 1.0"))])
    print(f"{args.messages} messages of {args.body} B, broker {VERSION}, {len(rounds)} round(s), order per round: "
          + "; ".join(", ".join(rotation(SIDES, i)) for i in range(len(rounds)))
          + f", {time.monotonic() - t0:.0f} s")
    print(objects.describe())
    print(why)
    if args.json:
        C.write_json(args.json, {"messages": args.messages, "body": args.body, "version": VERSION,
                                 "store": args.store, "plugin_backend": provider, "plugin_backend_why": why,
                                 "rounds": rounds, "results": results, "ratios": ratios, "per_round": per_round})


def full_round(rmq: B.RocketMQ, base: Path, args: argparse.Namespace, objects: ObjectStore, provider: str,
               i: int) -> dict[str, dict]:
    """One round of the full bench: native, tierfs and the plug-in, each produce then lagging read, in round i's
    order (rotation)."""
    results: dict[str, dict] = {}
    for pos, side in enumerate(rotation(SIDES, i)):
        if side == "native":
            native = base / "native"
            native.mkdir(parents=True)
            results["native"] = run_config("native", rmq, native, args, base, {})
        elif side == "tierfs":
            hot, mnt, name = base / "hot", base / "mnt", f"round-{i}"
            opts = [TIER_OPTS, objects.options(base, name), *args.options]
            with C.TierfsMount(hot, mnt, opts) as mount:
                results["tierfs"] = run_config("tierfs", rmq, mnt, args, base, {}, mount=mount,
                                               backing=(hot, *objects.backing(base)), objects=objects)
            objects.forget(name)
        else:
            plug_store, tier = base / "plugin-store", base / "plugin-tier"
            plug_store.mkdir(parents=True)
            tier.mkdir()
            results["plugin"] = run_config("plugin", rmq, plug_store, args, base, {
                "messageStorePlugIn": "org.apache.rocketmq.tieredstore.TieredMessageStore",
                "tieredBackendServiceProvider": provider,
                "tieredStoreFilePath": tier, "tieredStorageLevel": "FORCE", "tieredStoreGroupCommitTimeout": 1000,
                "tieredStoreGroupCommitCount": 1000, "commitLogRollingInterval": 1}, tier_dir=tier)
        results[side]["position"] = pos
    return results


def round_ratios(results: dict[str, dict]) -> dict[str, float]:
    n, t, p = results["native"], results["tierfs"], results["plugin"]
    return {"produce tierfs/native": t["produce_msgs_s"] / n["produce_msgs_s"],
            "p99 native/tierfs": n["p99_ms"] / t["p99_ms"] if t["p99_ms"] else 0.0,
            "lagging read tierfs/native": t["read_msgs_s"] / n["read_msgs_s"],
            "lagging read tierfs/plugin": t["read_msgs_s"] / p["read_msgs_s"]}


def produce_only(args: argparse.Namespace) -> None:
    """Produce phases only, native and each tierfs variant rotated per round; medians of each, and per variant the
    median of its per-round ratios to native."""
    variants: dict[str, tuple[list[str], str | None]] = {"tierfs": ([], None),
                                                         "tierfs-rpo0": (["tiering.rpo_seconds=0"], None)}
    for v in args.variant:
        name, _, opts = v.partition("=")
        name, _, src = name.partition("@")
        variants[name] = ([o for o in opts.split(",") if o], src or None)
    for name in args.skip:
        variants.pop(name, None)
    runs: dict[str, list[dict]] = {"native": [], **{k: [] for k in variants}}
    t0 = time.monotonic()
    with C.temp_base(args.tmp, "tierfs-bench-broker-") as base, \
            object_store(args.store, 2 * len(variants) * args.messages * args.body) as objects:
        rmq = B.RocketMQ(VERSION, base / "home")
        try:
            rmq.start_namesrv()
            for i in range(args.repeat):
                for name in rotation(list(runs), i):
                    run = base / f"{name}-{i}"
                    store = run / "store"
                    store.mkdir(parents=True)
                    if name == "native":
                        out, _ = produce(f"{name}-{i}", rmq, store, args, base, {})
                        rmq.stop_broker(signal.SIGKILL)
                    else:
                        extra, src = variants[name]
                        opts = [TIER_OPTS, objects.options(run, f"{name}-{i}"), *args.options, *extra]
                        with C.TierfsMount(run / "hot", run / "mnt", opts, tierfs_src=src) as mount:
                            out, _ = produce(f"{name}-{i}", rmq, run / "mnt", args, base, {}, mount=mount,
                                             objects=objects)
                            rmq.stop_broker(signal.SIGKILL)
                            out["status"] = {k: v for k, v in mount.status().items() if k != "files"}
                            if args.py_spy:  # the daemon's log beside its profile
                                shutil.copy(run / "hot" / ".tierfs" / "tierfs.log",
                                            Path(args.py_spy) / f"{name}-{i}.log")
                        objects.forget(f"{name}-{i}")
                    C.log(f"{name} #{i}: { {k: v for k, v in out.items() if k != 'status'} }")
                    runs[name].append(out)
                    shutil.rmtree(run, ignore_errors=True)
        finally:
            rmq.close()
        store_desc = objects.describe()
    cols = ("produce_msgs_s", "p99_ms", "produce_broker_cpu_s", "produce_daemon_cpu_s", "produce_rgw_cpu_s")
    med = {k: {c: statistics.median(r[c] for r in v) for c in cols if c in v[0]} for k, v in runs.items()}
    C.print_table(["config", "msgs/s", "p99 ms", "broker cpu s", "daemon cpu s", "rgw cpu s"],
                  [[k, *(C.fmt_num(v.get(c, "")) for c in cols)] for k, v in med.items()])
    print(f"(medians over rounds; {C.DAEMON_CPU_NOTE})")
    for k in variants:
        per = [a["produce_msgs_s"] / b["produce_msgs_s"] for a, b in zip(runs[k], runs["native"])]
        print(f"produce {k}/native: {statistics.median(per):.2f} (median of per-round ratios: "
              + ", ".join(f"{r:.2f}" for r in per) + f"); FUSE requests of the last run: {runs[k][-1]['fuse_ops']}")
    print(f"{args.messages} messages of {args.body} B, broker {VERSION}, {args.repeat} rounds, order rotated per "
          f"round, {time.monotonic() - t0:.0f} s; {store_desc}")
    if args.json:
        C.write_json(args.json, {"messages": args.messages, "body": args.body, "version": VERSION,
                                 "store": args.store, "runs": runs, "medians": med})


GROUP_SIDES = ("native", "tierfs")
GROUP_ROOTS = ("node0", "node1")
PROBE = "PROBE"  # the one-message sends that find the master
# as in tests/test_broker.py: an eviction pass goes down to a fifth of the budget, so both stores' segments go
GROUP_TIER_OPTS = TIER_OPTS + ",cache.low_watermark=0.2"


def group_bench(args: argparse.Namespace) -> None:
    """--group: rounds of a broker group on native disk and on tierfs, sides rotated; medians and the medians of
    the per-round paired ratios."""
    rounds: list[dict[str, dict]] = []
    t0 = time.monotonic()
    with C.temp_base(args.tmp, "tierfs-bench-group-") as base, \
            object_store(args.store, 3 * args.messages * args.body) as objects:
        for i in range(args.repeat or 1):
            results: dict[str, dict] = {}
            for pos, side in enumerate(rotation(GROUP_SIDES, i)):
                run = base / f"{side}-{i}"
                if side == "native":
                    results[side] = run_group(side, run, run / "disk", args)
                else:
                    opts = [GROUP_TIER_OPTS, objects.options(run, f"group-{i}"), *args.options]
                    with C.TierfsMount(run / "hot", run / "mnt", opts) as mount:
                        results[side] = run_group(side, run, run / "mnt", args, mount,
                                                  (run / "hot", *objects.backing(run)),
                                                  lambda sid, run=run, i=i: objects.segment_sizes(run, f"group-{i}",
                                                                                                  sid))
                    objects.forget(f"group-{i}")
                results[side]["position"] = pos
                shutil.rmtree(run, ignore_errors=True)
            rounds.append(results)
        store_desc = objects.describe()
    per_round = [{"produce tierfs/native": r["tierfs"]["produce_msgs_s"] / r["native"]["produce_msgs_s"],
                  "lagging read tierfs/native": r["tierfs"]["read_msgs_s"] / r["native"]["read_msgs_s"],
                  "failover native/tierfs": r["native"]["failover_s"] / r["tierfs"]["failover_s"]}
                 for r in rounds]
    ratios = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    cols = ["produce_msgs_s", "p99_ms", "read_msgs_s", "read_fetch_MiB", "failover_s", "new_master_read_msgs_s",
            "produce_broker_cpu_s", "produce_daemon_cpu_s", "read_daemon_cpu_s"]
    results = {k: {c: statistics.median(r[k][c] for r in rounds) for c in cols if c in rounds[0][k]}
               for k in GROUP_SIDES}
    C.print_table(["group", *cols], [[k, *(C.fmt_num(v.get(c, "")) for c in cols)] for k, v in results.items()])
    print(f"(medians over rounds; broker CPU: master + slave; {C.DAEMON_CPU_NOTE}; read_fetch_MiB: what tierfs "
          f"fetched from the tier during the lagging read)")
    print("tierfs before the reads, per store root [CommitLog segments, tiered, evicted]: "
          + "; ".join(f"round {i}: {r['tierfs']['tiered_evicted']}" for i, r in enumerate(rounds)))
    print("stored bytes group/master (one mount: the replicas' identical chunks are one content-addressed object): "
          + "; ".join(f"round {i}: {r['tierfs']['stored_group_master']:.3f}" for i, r in enumerate(rounds)))
    C.print_table(["ratio (median of per-round paired ratios)", "median", "per round"],
                  [[k, f"{v:.2f}", ", ".join(f"{r[k]:.2f}" for r in per_round)] for k, v in ratios.items()])
    print(f"broker group {VERSION} controller mode, master+slave, {args.messages} messages of {args.body} B, "
          f"{len(rounds)} round(s), order per round: "
          + "; ".join(", ".join(rotation(GROUP_SIDES, i)) for i in range(len(rounds)))
          + f", {time.monotonic() - t0:.0f} s; {store_desc}")
    if args.json:
        C.write_json(args.json, {"messages": args.messages, "body": args.body, "version": VERSION, "group": True,
                                 "store": args.store, "rounds": rounds, "results": results, "ratios": ratios,
                                 "per_round": per_round})


def run_group(name: str, run: Path, root: Path, args: argparse.Namespace, mount: C.TierfsMount | None = None,
              backing: tuple[Path, ...] = (), sizes: Callable[[str], dict[str, int]] | None = None) -> dict:
    """One side: the group on store roots below `root`; produce, (tierfs: wait until both stores' sealed
    CommitLog segments are tiered and evicted), restart both brokers with their files dropped from the page
    cache, the lagging read off the master, kill -9 of the master, the failover time, the read off the new
    master. Every read checks every acknowledged message."""
    stores = [root / r for r in GROUP_ROOTS]
    for s in stores:
        s.mkdir(parents=True)
    g = B.BrokerGroup(VERSION, run / "home", stores, controller=True)
    master, slave = g.members
    acked = run / "acked"
    try:
        g.start()
        wait_in_sync(g, 1)
        master.client("topics", g.ns_addr, master.broker_addr, QUEUES, TOPIC, f"{PROBE}:1")
        g.first_ack(run / "probe-start", PROBE, args.body)
        C.wait_until(lambda: all(t in _text(stores[1] / "config" / "topics.json") for t in (TOPIC, PROBE)), 60,
                     "the slave synchronising the topic configs")
        cpu0 = group_cpu(g, mount)
        prod = master.client("produce", g.ns_addr, B.BROKER_NAME, TOPIC, QUEUES, 0, args.messages, args.body, 64,
                             acked, timeout=600)
        if prod["acked"] != args.messages:
            raise SystemExit(f"{name}: only {prod['acked']} of {args.messages} sends acknowledged: {prod}")
        out = {"produce_msgs_s": args.messages / prod["secs"], "p99_ms": prod["p99_ms"],
               **cpu_delta("produce", cpu0, group_cpu(g, mount))}
        C.wait_until(lambda: B.caught_up(stores[1], stores[0], [TOPIC], QUEUES), 120,
                     "the slave dispatching every message")
        if mount:
            out["tiered_evicted"] = group_evicted(mount, root)
            if sizes is not None:
                out["stored_group_master"] = stored_group_master(mount, sizes)
        syncs = B.sync_sets(master)
        slave.stop_broker(signal.SIGTERM)  # the slave first: the controller must not promote it
        master.stop_broker(signal.SIGTERM)
        for d in (*stores, *backing):
            drop_cache(d)
        master.start_broker(g.conf(0))
        g.first_ack(run / "probe-restart", PROBE, args.body)
        slave.start_broker(g.conf(1))
        wait_in_sync(g, syncs + 1)
        g.first_ack(run / "probe-rejoin", PROBE, args.body)  # acknowledged by both
        cpu0 = group_cpu(g, mount)
        cons = check_read(name, master.client("consume", g.ns_addr, B.BROKER_NAME, TOPIC, QUEUES, 0, args.messages,
                                               args.body, f"lagging-{name}", acked, timeout=600))
        out.update(read_msgs_s=args.messages / cons["secs"], **cpu_delta("read", cpu0, group_cpu(g, mount)))
        if mount:
            out["read_fetch_MiB"] = (fetched(mount) - cpu0["fetched"]) / (1 << 20)
        killed_ms = int(time.time() * 1000)
        master.stop_broker(signal.SIGKILL)
        out["failover_s"] = (g.first_ack(run / "probe-failover", PROBE, args.body) - killed_ms) / 1000
        cons = check_read(name, slave.client("consume", g.ns_addr, B.BROKER_NAME, TOPIC, QUEUES, 0, args.messages,
                                             args.body, f"after-failover-{name}", acked, timeout=600))
        out["new_master_read_msgs_s"] = args.messages / cons["secs"]
    finally:
        g.close()
    C.log(f"group {name}: {out}")
    return out


def stored_group_master(mount: C.TierfsMount, sizes: Callable[[str], dict[str, int]]) -> float:
    """Bytes of every segment object of the group's mount over those the master's rows name (what the master
    alone would store): 2.00 when each replica's bytes are stored, 1.00 when stored once."""
    have = sizes(mount.status()["store_id"])
    db = sqlite3.connect(f"file:{mount.hot / '.tierfs' / 'catalog.db'}?mode=ro", uri=True, timeout=30)
    try:
        rows = db.execute("SELECT objects, unit_ref FROM files WHERE path LIKE ?", (f"{GROUP_ROOTS[0]}/%",)).fetchall()
    finally:
        db.close()
    keys = {k for objs, _ in rows for k in json.loads(objs)} | {r.split(":", 2)[2] for _, r in rows if r}
    return sum(have.values()) / max(1, sum(have.get(k, 0) for k in keys))


def wait_in_sync(g: B.BrokerGroup, syncs: int) -> None:
    """The master has logged `syncs` sync state sets of two members: the slave is in it."""
    C.wait_until(lambda: B.in_sync(g.members[0], syncs), 90, "the slave joining the sync state set")


def check_read(name: str, cons: dict) -> dict:
    if cons["bad"] or cons["missing"]:
        raise SystemExit(f"{name}: a read got wrong or missing messages: {cons}")
    return cons


def group_cpu(g: B.BrokerGroup, mount: C.TierfsMount | None) -> dict[str, float]:
    """CPU seconds of both brokers (and the tierfs daemon), and the bytes tierfs has fetched from the tier."""
    return {"broker": sum(B.cpu_seconds(m.broker.pid) for m in g.members if m.broker and B.pid_alive(m.broker.pid)),
            **({"daemon": C.daemon_cpu_seconds(mount.pid), "fetched": fetched(mount)} if mount else {})}


def fetched(mount: C.TierfsMount) -> float:
    return float(mount.status()["totals"]["engine"]["fetch_bytes"])


def cpu_delta(phase: str, a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {f"{phase}_{k}_cpu_s": b[k] - a[k] for k in a if k != "fetched"}


def group_evicted(mount: C.TierfsMount, root: Path) -> dict[str, list[int]]:
    """Each store root has tiered CommitLog segments, all but at most its newest tiered one evicted, and the
    upload backlog is empty; once it is, `tierfs evict` makes a pass every 5 s (as tests/test_broker.py does).
    Per store root: [CommitLog segments, tiered, evicted]."""
    pressed, seen = [0.0], {}

    def done() -> bool:
        st = mount.status()
        rows = [f for f in st["files"] if f["kind"] == "commitlog"]
        good = st["totals"]["upload_backlog_files"] == 0
        for r in GROUP_ROOTS:
            mine = [f for f in rows if f["path"].startswith(f"{r}/")]
            tiered = [f for f in mine if f["state"] == "tiered"]
            evicted = sum(f["resident_bytes"] < f["size"] for f in tiered)
            seen[r] = [len(mine), len(tiered), evicted]
            good = good and bool(tiered) and evicted >= max(1, len(tiered) - 1)
        if not good and st["totals"]["upload_backlog_files"] == 0 and time.monotonic() - pressed[0] > 5:
            subprocess.run([C.PY, "-m", "tierfs", "evict", str(root)], capture_output=True, timeout=60, cwd="/",
                           env=mount.env, check=True)
            pressed[0] = time.monotonic()
        return good

    C.wait_until(done, 180, "both stores' CommitLog segments tiered and evicted",
                 progress=lambda: tiering_progress(mount))
    return seen


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
