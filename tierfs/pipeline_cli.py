"""`tierfs compact` and `tierfs query`: the operator's handles on the Spark pipeline and its key index.

`compact` asks the running daemon for a job (a request file; the daemon runs one job at a time and owns every
catalog change) and follows the job directory: one progress bar per stage, a tick per segment.

`query` answers like the broker's queryMessage (format §7.3): index files newest to oldest, only those whose time
range overlaps, stop at --max hits; a hit whose hash collides is resolved by reading the record. Tiered index files
with a current `.cidx` sidecar are looked up with two ranged GETs on the sidecar; every other file is walked like the
broker does, through the mount. Records are read through the mount, so evicted CommitLog bytes are fetched as usual.
"""

from __future__ import annotations

import argparse
import base64
import json
import mmap
import os
import sqlite3
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tierfs.store import commitlog as cl
from tierfs.store import indexfile as ix
from tierfs.store.paths import is_dledger_dir

LONG_MAX = (1 << 63) - 1


def _fail(msg: str, code: int = 2) -> int:
    print(f"tierfs: {msg}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------------------------------- compact


def cmd_compact(args: argparse.Namespace) -> int:
    from tierfs.tier.compaction import STAGES, jobs_dir, request_job, requests_dir

    from tierfs.fs.mount import NotServing, live_mount  # noqa: PLC0415  (pyfuse3 and trio, only when asked)

    try:
        mnt, hot, _ = live_mount(args.mountpoint)
    except NotServing as e:
        return _fail(str(e))
    state = hot / ".tierfs"
    stages = [args.only] if args.only else list(STAGES)
    spark = {"spark.master": args.master} if args.master else {}
    job_id = request_job(state, stages, spark, args.min_age)
    job = jobs_dir(state) / job_id
    req = requests_dir(state) / f"{job_id}.json"
    view: ProgressView = (ProgressView() if args.json else _Bars() if sys.stderr.isatty() else _Lines())
    pos = 0
    t0 = time.monotonic()
    try:
        while not (job / "applied.json").exists():
            if req.exists() and time.monotonic() - t0 > 20:
                req.unlink(missing_ok=True)
                return _fail("the daemon did not pick the job up within 20 s (is tiering.enabled false, or is "
                             f"another job running? see {mnt}/.tierfs/status)", 1)
            if not _daemon_alive(state):
                return _fail(f"the daemon of {mnt} died while job {job_id} was running; remount to recover "
                             f"(a finished job is applied at start-up)", 1)
            if args.timeout and time.monotonic() - t0 > args.timeout:
                return _fail(f"job {job_id} still running after {args.timeout} s; it goes on in the daemon "
                             f"(see {mnt}/.tierfs/status)", 1)
            pos = _follow_progress(job / "progress.jsonl", pos, view)
            time.sleep(0.2)
        _follow_progress(job / "progress.jsonl", pos, view)
    finally:
        view.close()
    summary = json.loads((job / "applied.json").read_text())
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(_render_summary(summary))
    return 0 if summary.get("ok") else 1


def _daemon_alive(state: Path) -> bool:
    from tierfs.fs.mount import pid_alive

    try:
        return pid_alive(int((state / "daemon.pid").read_text()))
    except (OSError, ValueError):
        return False


class ProgressView:
    """Shows a job's progress.jsonl as it grows: a stage starts with its task count, then one call per task
    finished (wherever the cluster ran it). This base shows nothing (--json)."""

    def start(self, stage: str, total: int) -> None:
        pass

    def item(self, stage: str, rec: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _Bars(ProgressView):
    """A terminal: one tqdm bar per stage, ticking per task."""

    def __init__(self) -> None:
        self.bars: dict = {}

    def start(self, stage: str, total: int) -> None:
        from tqdm import tqdm

        self.bars[stage] = tqdm(total=total, desc=f"{stage:<8}", unit="seg", file=sys.stderr, leave=True)

    def item(self, stage: str, rec: dict) -> None:
        bar = self.bars.get(stage)
        if bar is not None:
            bar.set_postfix_str(os.path.basename(str(rec.get("path", ""))) + ("" if rec.get("ok") else " !"))
            bar.update(1)

    def close(self) -> None:
        for b in self.bars.values():
            b.close()


class _Lines(ProgressView):
    """A log or a pipe: a line per stage when it starts, at most every LINE_SECONDS while it runs, when it ends."""

    LINE_SECONDS = 2.0

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}  # stage -> [done, failed, total]
        self.last = 0.0

    def _line(self, stage: str) -> None:
        done, failed, total = self.counts[stage]
        print(f"tierfs: {stage}: {done}/{total} segments done" + (f", {failed} failed" if failed else ""),
              file=sys.stderr, flush=True)
        self.last = time.monotonic()

    def start(self, stage: str, total: int) -> None:
        self.counts[stage] = [0, 0, total]
        self._line(stage)

    def item(self, stage: str, rec: dict) -> None:
        c = self.counts.get(stage)
        if c is None:
            return
        c[0] += 1
        c[1] += not rec.get("ok")
        if c[0] == c[2] or time.monotonic() - self.last >= self.LINE_SECONDS:
            self._line(stage)


def _follow_progress(path: Path, pos: int, view: ProgressView) -> int:
    """Hand the whole lines of progress.jsonl after byte `pos` to the view. Returns the new position."""
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            chunk = f.read()
    except FileNotFoundError:
        return pos
    end = chunk.rfind(b"\n") + 1  # only whole lines
    for line in chunk[:end].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        stage = str(rec.get("stage", "?"))
        if "total" in rec:
            view.start(stage, int(rec["total"]))
        else:
            view.item(stage, rec)
    return pos + end


def _render_summary(s: dict) -> str:
    lines = [f"job {s['job_id']}: {'ok' if s.get('ok') else 'finished with errors'}"]
    if s.get("note"):
        lines.append(f"  {s['note']}")
    a = s.get("applied") or {}
    lines.append(f"  compacted segments {a.get('segments', 0)}, index sidecars {a.get('indexes', 0)}, "
                 f"archived commitlogs {a.get('archive', 0)} ({s.get('archive_rows', 0)} rows)")
    if s.get("bytes_out"):
        lines.append(f"  compression: {s['bytes_in']} -> {s['bytes_out']} bytes, "
                     f"ratio {s['bytes_in'] / s['bytes_out']:.2f}")
    if s.get("archive_deleted"):
        lines.append(f"  archive retention removed {s['archive_deleted']} objects")
    for x in s.get("skipped") or []:
        lines.append(f"  skipped {x['path']}: {x['error']}")
    for x in s.get("errors") or []:
        lines.append(f"  error [{x.get('stage')}] {x.get('path')}: {x.get('error')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- query


@dataclass
class Sidecars:
    """Tiered index files with a current sidecar, and a counting reader of sidecar objects."""

    keys: dict[str, str]  # index file name -> sidecar object key
    headers: dict[str, bytes]  # index file name -> the sidecar's header, as verified when it was swapped in
    read_object: Callable[[str, int, int], bytes] | None
    gets: int = 0

    def reader(self, key: str) -> Callable[[int, int], bytes]:
        def read(off: int, length: int) -> bytes:
            self.gets += 1
            assert self.read_object is not None
            return self.read_object(key, off, length)
        return read


def _sidecars(state: Path, index_rel: str) -> Sidecars:
    """Which index files have a sidecar for their current generation, from the catalog (read-only)."""
    db = state / "catalog.db"
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        rows = con.execute("SELECT a.path, a.keys, a.info FROM artifacts a JOIN files f ON f.path = a.path "
                           "WHERE a.kind = 'cidx' AND a.generation = f.generation AND f.state = 'tiered'").fetchall()
        con.close()
    except sqlite3.Error:
        rows = []
    keys, headers = {}, {}
    for path, k, info in rows:
        if os.path.dirname(path) == index_rel:
            name = os.path.basename(path)
            keys[name] = json.loads(k)[0]
            hdr = json.loads(info).get("header")
            if hdr:
                headers[name] = bytes.fromhex(hdr)
    if not keys:
        return Sidecars({}, {}, None)
    from tierfs.tier import storeconfig

    store = storeconfig.load(state).open()
    return Sidecars(keys, headers, store.get_range)


def _broker_limits(mnt: Path) -> tuple[int, int]:
    try:
        cfg = tomllib.loads((mnt / ".tierfs" / "config").read_text())
        return int(cfg["broker"]["max_hash_slot_num"]), int(cfg["broker"]["max_index_num"])
    except (OSError, KeyError, ValueError):
        return ix.MAX_HASH_SLOT_NUM, ix.MAX_INDEX_NUM


def query_offsets(mnt: Path, state: Path, index_dir: Path, key: str, begin: int, end: int, max_n: int
                  ) -> tuple[list[int], dict]:
    """Hit offsets newest to oldest, as IndexService.queryOffset, using sidecars where they exist."""
    from tierfs.store import cidx

    max_slots, max_items = _broker_limits(mnt)
    max_n = min(max_n, ix.MAX_MSGS_NUM_BATCH)
    rel = os.path.relpath(index_dir, mnt)
    side = _sidecars(state, rel)
    names = sorted(n for n in os.listdir(index_dir) if n.isdigit())
    out: list[int] = []
    stats = {"files_searched": 0, "files_by_sidecar": 0, "sidecar_gets": 0}
    for name in reversed(names):
        if name in side.headers:  # a tiered file with a sidecar: two ranged GETs, nothing read through the mount
            h = cidx.parse_header(side.headers[name])
            begin_ts = h.begin_timestamp
            if ix.is_time_matched(h, begin, end):
                stats["files_searched"] += 1
                stats["files_by_sidecar"] += 1
                out += cidx.lookup(side.reader(side.keys[name]), key, begin, end, max_n - len(out), header=h)
        else:
            with open(index_dir / name, "rb") as f:
                header = ix.decode_header(f.read(ix.HEADER_SIZE))  # the first page stays resident: no fetch
                begin_ts = header.begin_timestamp
                if ix.is_time_matched(header, begin, end):
                    stats["files_searched"] += 1
                    if name in side.keys:
                        stats["files_by_sidecar"] += 1
                        out += cidx.lookup(side.reader(side.keys[name]), key, begin, end, max_n - len(out))
                    elif os.fstat(f.fileno()).st_size:
                        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as buf:
                            out += ix.lookup(buf, key, begin, end, max_n - len(out), max_slots, max_items)
        if begin_ts < begin or len(out) >= max_n:
            break
    stats["sidecar_gets"] = side.gets
    return out, stats


def default_commitlog_dir(root: Path) -> Path:
    """Where a store's messages are: `commitlog/`, or with a DLedger CommitLog (and no `commitlog/`) the data
    directory of its only `dledger-<selfId>/`, whose files the index's offsets point into (at entry bodies:
    the same records, so `read_record` reads either)."""
    plain = root / "commitlog"
    if plain.is_dir():
        return plain
    ledgers = sorted(d for d in root.glob("dledger-*/data") if is_dledger_dir(d.parent.name) and d.is_dir())
    return ledgers[0] if len(ledgers) == 1 else plain


def read_record(commitlog_dir: Path, phys: int) -> cl.Message | None:
    """The message at CommitLog offset `phys`, read through the mount, or None if there is none."""
    names = sorted(n for n in os.listdir(commitlog_dir) if n.isdigit())
    base = max((int(n) for n in names if int(n) <= phys), default=None)
    if base is None:
        return None
    with open(commitlog_dir / f"{base:020d}", "rb") as f:
        pos = phys - base
        head = os.pread(f.fileno(), 8, pos)
        if len(head) < 8:
            return None
        total = int.from_bytes(head[:4], "big", signed=True)
        if total <= 0 or total > 64 << 20:
            return None
        rec = cl.decode_record(os.pread(f.fileno(), total, pos), 0, check_crc=True)
    return rec if isinstance(rec, cl.Message) else None


def message_json(m: cl.Message, phys: int) -> dict:
    try:
        body: str = m.body.decode("utf-8")
        enc = "utf-8"
    except UnicodeDecodeError:
        body, enc = base64.b64encode(m.body).decode(), "base64"
    return {"topic": m.topic, "queue_id": m.queue_id, "queue_offset": m.queue_offset, "phys_offset": phys,
            "store_timestamp": m.store_timestamp, "born_timestamp": m.born_timestamp, "keys": m.keys,
            "tags": m.tags, "properties": m.properties, "body": body, "body_encoding": enc}


def cmd_query(args: argparse.Namespace) -> int:
    from tierfs.fs.mount import NotServing, live_mount  # noqa: PLC0415  (pyfuse3 and trio, only when asked)

    try:
        mnt, hot, _ = live_mount(args.mountpoint)
    except NotServing as e:
        return _fail(str(e))
    state = hot / ".tierfs"
    root = mnt / args.store if args.store else mnt
    if args.store and not root.is_dir():
        return _fail(f"--store {args.store}: {root} is not a directory below the mount")
    index_dir = Path(args.index_dir) if args.index_dir else root / "index"
    commitlog_dir = Path(args.commitlog_dir) if args.commitlog_dir else default_commitlog_dir(root)
    for d, flag in ((index_dir, "--index-dir"), (commitlog_dir, "--commitlog-dir")):
        if not d.is_dir():
            return _fail(f"{d} is not a directory; pass the broker's directory with {flag}")
    missing = _missing_topic(index_dir.parent / "consumequeue", args.topic)
    if missing:
        return _fail(missing, 1)
    t0 = time.monotonic()
    offsets, stats = query_offsets(mnt, state, index_dir, ix.build_key(args.topic, args.key), args.begin,
                                   args.end, args.max)
    msgs = []
    for phys in offsets:
        m = read_record(commitlog_dir, phys)
        # a hash collision or a stale index entry: keep only records that really carry the key
        if m is not None and m.topic == args.topic and (args.key in m.keys or m.uniq_key == args.key):
            msgs.append(message_json(m, phys))
    stats.update(hits=len(offsets), messages=len(msgs), seconds=round(time.monotonic() - t0, 4))
    if args.json:
        print(json.dumps({"messages": msgs, "stats": stats}, indent=1))
    else:
        for m in msgs:
            body = m["body"] if len(m["body"]) <= 120 else m["body"][:117] + "..."
            print(f"{m['phys_offset']:>14}  {m['topic']}[{m['queue_id']}]@{m['queue_offset']}  "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(m['store_timestamp'] / 1000))}  "
                  f"keys={','.join(m['keys'])} tags={m['tags'] or ''}  {body}")
        if not msgs:
            print(f"no message of topic {args.topic!r} has key {args.key!r}"
                  + (" in that time range" if args.begin or args.end != LONG_MAX else ""), file=sys.stderr)
        print(f"{_plural(len(msgs), 'message')} ({_plural(stats['hits'], 'index hit')}, "
              f"{_plural(stats['files_searched'], 'index file')}, {stats['files_by_sidecar']} by sidecar with "
              f"{_plural(stats['sidecar_gets'], 'GET')}) in {stats['seconds']} s", file=sys.stderr)
    return 0


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _missing_topic(cq_dir: Path, topic: str) -> str | None:
    """Why a topic cannot have messages here (the broker keeps a consumequeue/TOPIC dir per topic), or None."""
    if not cq_dir.is_dir() or (cq_dir / topic).is_dir():
        return None
    topics = sorted(n for n in os.listdir(cq_dir) if (cq_dir / n).is_dir())
    shown = ", ".join(topics[:20]) + (f" (and {len(topics) - 20} more)" if len(topics) > 20 else "")
    return f"topic {topic!r} does not exist in this store (no {cq_dir / topic}); its topics: {shown or 'none'}"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("compact", help="run the Spark pipeline now (compaction, index sidecars, archive) and wait")
    c.add_argument("mountpoint", metavar="MOUNTPOINT")
    c.add_argument("--only", choices=("segments", "index", "archive"), help="run one stage only")
    c.add_argument("--master", metavar="URL", help="Spark master for this run (default: spark.master)")
    c.add_argument("--min-age", type=float, default=0.0, metavar="SECONDS",
                   help="only segments tiered at least this long ago (default 0: every tiered segment)")
    c.add_argument("--timeout", type=float, default=0.0, metavar="SECONDS", help="stop waiting after this long")
    c.add_argument("--json", action="store_true", help="print the job summary as JSON (no progress bars)")
    c.set_defaults(func=cmd_compact)
    q = sub.add_parser("query", help="look messages up by key, like the broker's queryMessage")
    q.add_argument("mountpoint", metavar="MOUNTPOINT")
    q.add_argument("--topic", required=True)
    q.add_argument("--key", required=True)
    q.add_argument("--begin", type=int, default=0, metavar="MS", help="store time from (ms since epoch)")
    q.add_argument("--end", type=int, default=LONG_MAX, metavar="MS", help="store time to (ms since epoch)")
    q.add_argument("--max", type=int, default=32, metavar="N", help="at most N messages (the broker caps at 64)")
    q.add_argument("--store", metavar="SUBDIR", help="a store whose root is below the mount root (storePathRootDir "
                   "= MOUNTPOINT/SUBDIR); default: the mount root")
    q.add_argument("--index-dir", metavar="DIR", help="default MOUNTPOINT[/SUBDIR]/index")
    q.add_argument("--commitlog-dir", metavar="DIR", help="default MOUNTPOINT/commitlog (storePathCommitLog), or "
                   "the data dir of a DLedger CommitLog (dledger-<selfId>/data)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_query)
