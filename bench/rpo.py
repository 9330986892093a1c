#!/usr/bin/env python3
"""Continuous tiering (tiering.rpo_seconds) and takeover benchmark: one run, figures from the same run.

With the posix object store in the temp base dir (`--dir`, default $TMPDIR) and the example producer
(examples/producer.py, the broker's own file behaviour: mmap'd CommitLog, ConsumeQueue, IndexFile, checkpoint):

1. hot writes, continuous tiering OFF then ON: the producer unlimited for `--seconds` each, on a fresh mount and
   store each time; figure: messages/s on / off (aim >= 0.95). The ON run goes on until the store holds
   `--store-gib` (default 1) for step 3;
2. achieved RPO under a steady producer (`--rate` messages/s) on the ON mount: every 0.5 s, the achieved RPO as
   the daemon reports it (age of the oldest write the bucket lacks, max over kinds) and the age of the bucket's
   newest consistent point (now - its snapshot time, read from the bucket itself); p50 / p99 of both (aim p99 <=
   rpo_seconds + 5 s); PUT requests per minute (append objects, snapshot blobs, .db and pointer; sealed segment
   objects separately) and bytes uploaded per byte written (also counting the bytes of segments sealed meanwhile
   that were sent, not composed in the store from their append objects);
3. takeover: kill -9 of the daemon, the hot dir removed, `tierfs mount --takeover --force HOLDER` on a new hot dir;
   figure: seconds from the command to the mount answering, and to the consumer's first complete read of the
   recovered store (the "broker accepting reads" point: checkpoint, ConsumeQueue and CommitLog tail read).

    .venv/bin/python bench/rpo.py                       # rpo 10 s, 30 s per hot-write run, 60 s steady, 1 GiB
    .venv/bin/python bench/rpo.py --rpo 5 --seconds 20 --steady 40 --store-gib 0.5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PRODUCER = REPO / "examples" / "producer.py"
CONSUMER = REPO / "examples" / "consumer.py"
MiB = 1 << 20


def status(mnt: Path) -> dict:
    return json.loads((mnt / ".tierfs" / "status.json").read_text())


def producer(store: Path, args: argparse.Namespace, rate: float) -> subprocess.Popen:
    return subprocess.Popen([C.PY, str(PRODUCER), str(store), "--commitlog-size", str(args.segment_mib * MiB),
                             "--messages", "0", "--topics", "4", "--queues", "4", "--body-size", str(args.body),
                             "--rate", str(rate)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_producer(p: subprocess.Popen) -> dict:
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"producer exited {p.returncode}: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def options(objects: Path, sid: str, rpo: float, extra: list[str]) -> list[str]:
    return [f"objectstore.url=file://{objects},store.id={sid},tiering.rpo_seconds={rpo},lease.ttl_seconds=300"
            ] + extra


def store_bytes(mnt: Path) -> int:
    return sum(f.stat().st_size for f in (mnt / "commitlog").glob("0*"))


def hot_writes(base: Path, name: str, rpo: float, args: argparse.Namespace, until_bytes: int = 0
               ) -> tuple[dict, C.TierfsMount | None]:
    """Unlimited producer for args.seconds (and on until the store holds until_bytes); the mount is kept open
    (returned) when until_bytes is set, for the steady phase."""
    objects = base / f"objects-{name}"
    objects.mkdir()
    m = C.TierfsMount(base / f"hot-{name}", base / f"mnt-{name}", options(objects, name, rpo, args.options))
    m.__enter__()
    try:
        p = producer(m.mnt, args, 0)
        t0 = time.monotonic()
        time.sleep(args.seconds)
        while until_bytes and store_bytes(m.mnt) < until_bytes:
            time.sleep(0.5)
        summary = stop_producer(p)
        elapsed = time.monotonic() - t0
        res = {"messages": summary["messages"], "seconds": round(elapsed, 2),
               "msgs_per_s": round(summary["messages"] / elapsed, 1),
               "MB_per_s": round(summary.get("bytes", summary["messages"] * args.body) / elapsed / 1e6, 2)}
        C.log(f"hot writes rpo={rpo}: {res}")
        if not until_bytes:
            m.__exit__(None, None, None)
            return res, None
        res["objects"] = str(objects)
        return res, m
    except BaseException:
        m.__exit__(None, None, None)
        raise


def pointer_time(objects: Path, sid: str) -> float | None:
    """The time of the bucket's newest consistent point, read from the bucket (the posix store's objects carry a
    header: read them through the object store API)."""
    from tierfs.objectstore import open_store  # noqa: PLC0415

    try:
        return float(json.loads(open_store(f"file://{objects}").get(f"{sid}/meta/catalog-latest.json"))["time"])
    except Exception:  # noqa: BLE001 - not there yet
        return None


def pct(values: list[float], q: float) -> float:
    return round(C.percentile(sorted(values), q / 100), 2) if values else float("nan")


def quiesce(m: C.TierfsMount, timeout: float = 300) -> float:
    """Wait until the hot-write phase's backlog is gone (nothing left to seal or upload, a round with no new
    bytes), so the steady phase measures only its own cost. Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = status(m.mnt)
        last = st["rpo"].get("last_round") or {}
        if st["totals"]["upload_backlog_files"] == 0 and last.get("append_bytes", 1) == 0 \
                and not st.get("hot_segments_sealable"):
            break
        time.sleep(1)
    return round(time.monotonic() - t0, 1)


def steady(m: C.TierfsMount, objects: Path, sid: str, args: argparse.Namespace) -> dict:
    waited = quiesce(m)
    C.log(f"backlog of the hot-write phase drained in {waited} s")
    st0 = status(m.mnt)
    p = producer(m.mnt / "steady", args, args.rate)
    lag, age = [], []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.steady:
            time.sleep(0.5)
            st = status(m.mnt)
            lag.append(float(st["rpo"]["lag_max_s"]))
            pt = pointer_time(objects, sid)
            if pt is not None:
                age.append(time.time() - pt)
    finally:
        summary = stop_producer(p)
    elapsed = time.monotonic() - t0
    st1 = status(m.mnt)
    written = summary["bytes"]  # CommitLog bytes the producer wrote (ConsumeQueue and IndexFile bytes come on top)
    fuse_written = st1["bytes_written"] - st0["bytes_written"]
    r0, r1, s0, s1 = st0["rpo"], st1["rpo"], st0["snapshot"], st1["snapshot"]
    e0, e1 = st0["totals"]["engine"], st1["totals"]["engine"]
    cont_puts = (r1["append_puts"] - r0["append_puts"]) + (s1.get("puts_total", 0) - s0.get("puts_total", 0))
    cont_bytes = (r1["append_bytes"] - r0["append_bytes"]) + (s1.get("put_bytes_total", 0)
                                                               - s0.get("put_bytes_total", 0))
    seg_bytes = e1["upload_bytes"] - e0["upload_bytes"]
    seg_copied = e1.get("upload_copied_bytes", 0) - e0.get("upload_copied_bytes", 0)  # composed from append objects
    res = {"seconds": round(elapsed, 1), "messages": summary["messages"], "commitlog_bytes_written": written,
           "fuse_bytes_written": fuse_written,
           "rpo_lag_p50_s": pct(lag, 50), "rpo_lag_p99_s": pct(lag, 99), "rpo_lag_max_s": round(max(lag), 2),
           "point_age_p50_s": pct(age, 50), "point_age_p99_s": pct(age, 99),
           "continuous_puts_per_min": round(cont_puts / elapsed * 60, 1),
           "append_puts_per_min": round((r1["append_puts"] - r0["append_puts"]) / elapsed * 60, 1),
           "continuous_bytes_per_commitlog_byte": round(cont_bytes / written, 3) if written else None,
           "continuous_bytes_per_fuse_byte_written": round(cont_bytes / fuse_written, 3) if fuse_written else None,
           "append_bytes_per_commitlog_byte": round((r1["append_bytes"] - r0["append_bytes"]) / written, 3)
           if written else None,
           "sealed_segment_bytes_during_steady": seg_bytes,
           "sealed_segment_bytes_composed_in_store": seg_copied,
           "sent_bytes_per_commitlog_byte_with_seals": round((cont_bytes + seg_bytes - seg_copied) / written, 3)
           if written else None,
           "rounds": r1["rounds"] - r0["rounds"], "failed_rounds": r1["failed_rounds"] - r0["failed_rounds"],
           "last_round": r1.get("last_round"), "last_error": r1.get("last_error")}
    C.log(f"steady: {res}")
    return res


def takeover(m: C.TierfsMount, base: Path, objects: Path, sid: str, args: argparse.Namespace) -> dict:
    size = store_bytes(m.mnt) + store_bytes(m.mnt / "steady")
    pid = m.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # by pid, never by name
    while C._alive(pid):
        time.sleep(0.05)
    subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], capture_output=True)
    shutil.rmtree(m.hot)
    hot, mnt = base / "hot-takeover", base / "mnt-takeover"
    hot.mkdir()
    mnt.mkdir()
    url = f"file://{objects}/{sid}"
    r = subprocess.run([C.PY, "-m", "tierfs", "mount", "--takeover", "--from", url, str(hot), str(mnt)],
                       capture_output=True, text=True, timeout=120, cwd="/")
    holder = re.search(r"--force '([^']+)'", r.stderr)
    if not holder:
        raise RuntimeError(f"takeover was not refused with the holder named: {r.stderr}")
    shutil.rmtree(hot / ".tierfs", ignore_errors=True)
    t0 = time.monotonic()
    r = subprocess.run([C.PY, "-m", "tierfs", "mount", "--takeover", "--force", holder.group(1), "--from", url,
                        str(hot), str(mnt), *sum((["-o", o] for o in args.options), [])],
                       capture_output=True, text=True, timeout=900, cwd="/")
    mounted = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"takeover failed: {r.stderr}")
    t = C.TierfsMount(hot, mnt)
    t.pid = int((hot / ".tierfs" / "daemon.pid").read_text())
    try:
        c = subprocess.run([C.PY, str(CONSUMER), str(mnt / "steady"), "--redispatch", "--check-keys", "0", "--json"],
                           capture_output=True, text=True, timeout=900)
        readable = time.monotonic() - t0
        got = json.loads(c.stdout.strip().splitlines()[-1]) if c.stdout.strip() else {"error": c.stderr[-500:]}
        info = status(mnt)["takeover"]
    finally:
        t.__exit__(None, None, None)
    res = {"store_bytes": size, "mount_s": round(mounted, 2), "until_readable_s": round(readable, 2),
           "prepare_s": info.get("seconds"), "files_local": info.get("files_local"),
           "files_tiered": info.get("files_tiered"), "bytes_local": info.get("bytes_local"),
           "point_age_s": info.get("age_s"), "messages_recovered_steady": got.get("messages"),
           "consumer_ok": got.get("ok", False), "consumer_error": got.get("error", "")[:300]}
    C.log(f"takeover: {res}")
    return res


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="base dir for the temp dirs (default $TMPDIR)")
    ap.add_argument("--rpo", type=float, default=10.0, help="tiering.rpo_seconds of the ON runs")
    ap.add_argument("--seconds", type=float, default=30.0, help="each hot-write run (off, on)")
    ap.add_argument("--steady", type=float, default=60.0, help="the steady-producer phase")
    ap.add_argument("--rate", type=float, default=2000.0, help="messages/s of the steady producer")
    ap.add_argument("--body", type=int, default=1024, help="message body bytes")
    ap.add_argument("--segment-mib", type=int, default=256, help="mappedFileSizeCommitLog in MiB")
    ap.add_argument("--store-gib", type=float, default=1.0, help="store size before the takeover")
    ap.add_argument("-o", dest="options", action="append", default=[], help="extra mount options")
    ap.add_argument("--repeat", type=int, default=1,
                    help="hot-write off/on pairs (alternating which goes first); the ratio is their median")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    C.install_signal_handlers()
    with C.temp_base(args.dir, "tierfs-bench-rpo-") as base:
        ratios = []
        for i in range(args.repeat - 1):  # extra pairs, order alternating; the last pair feeds the takeover
            first, second = (("off", 0), (f"on{i}", args.rpo)) if i % 2 else ((f"on{i}", args.rpo), ("off", 0))
            r1, _ = hot_writes(base, f"{first[0]}{i}", first[1], args)
            r2, _ = hot_writes(base, f"{second[0]}{i}", second[1], args)
            on_r, off_r = (r1, r2) if first[1] else (r2, r1)
            ratios.append(on_r["msgs_per_s"] / off_r["msgs_per_s"])
        off, _ = hot_writes(base, "off", 0, args)
        on, m = hot_writes(base, "on", args.rpo, args, until_bytes=int(args.store_gib * (1 << 30)))
        assert m is not None
        ratios.append(on["msgs_per_s"] / off["msgs_per_s"])
        try:
            st = steady(m, Path(on["objects"]), "on", args)
            tk = takeover(m, base, Path(on["objects"]), "on", args)
        finally:
            m.__exit__(None, None, None)
    res = {"rpo_seconds": args.rpo, "hot_writes_off": off, "hot_writes_on": on,
           "hot_writes_on_over_off": round(C.median(ratios), 3), "hot_writes_ratios": [round(r, 3) for r in ratios],
           "steady": st, "takeover": tk}
    res["hot_writes_on"].pop("objects", None)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
