"""What the control directory shows: the renderers behind `/.tierfs/*`.

The views that list every segment (status, status.json, segments) are made off the trio loop (tierfs.fs.control
`add_snapshot`): on the loop, `take` copies the small head of the status and the fields the views need of each
catalog entry (one C call per entry), ROW_STEP entries per step with the loop running between steps (no await
inside an entry's copy, so each row is consistent); a worker thread makes the text from the copy in slices of
SLICE rows, and offers the GIL to the loop between slices (one C call over every row, a sort or a json.dumps of
100,000 records, held it ~0.2 s).
"""

from __future__ import annotations

import heapq
import json
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Generator, Iterator, Sequence

from tierfs import __version__
from tierfs.config import Config
from tierfs.store.paths import split_root
from tierfs.tier.catalog import State

if TYPE_CHECKING:
    from tierfs.fs.mount import MountPaths
    from tierfs.fs.operations import TierOperations

ROW_STEP = 1000  # catalog entries copied on the loop per step (~1 ms)
SLICE = 500  # rows per slice of the render thread's work (well under the interpreter's 5 ms switch interval)
_NOT_CHECKED = ("", 0, 0, "not checked yet")


# what take() copies of each catalog entry: plain values, and two objects the engine never changes in place, only
# replaces: its objects list (shared with the row copies it commits), and its resident bitmap, read whole in the
# render thread (one C call: atomic under the GIL) for a count as of that moment
_FIELDS = attrgetter("path", "kind", "state", "file_id", "generation", "size", "format", "objects", "state_since",
                     "block_bytes", "resident")


@dataclass(frozen=True)
class Snapshot:
    """What the segment views need, copied on the loop; no live engine object in it but those _FIELDS names."""

    head: str  # status_head() as JSON ("{}" for a view without it)
    entries: list[tuple]  # _FIELDS of each catalog entry
    hot: dict[str, tuple[str, int, int, str]]  # the sealer's last scan: path -> (kind, size, local bytes, why)
    cache_bytes: int
    engine: dict  # the engine's counters


def take(ops: "TierOperations", paths: "MountPaths", config: Config, with_head: bool
         ) -> Generator[None, None, Snapshot]:
    """On the loop: the copy, ROW_STEP entries per step (a bare `yield` between steps). An entry is copied only
    if it is still the one of its path when copied: a file deleted or replaced meanwhile is not listed."""
    eng = ops.engine
    head = json.dumps(status_head(ops, paths, config)) if with_head else "{}"
    if eng is None:
        return Snapshot(head, [], {}, 0, {})
    hot = dict(eng.sealer.hot_segments)
    cache_bytes, counters = eng.cache_bytes, dict(vars(eng.stats))
    live = list(eng.entries.values())
    copied: list[tuple] = []
    for i in range(0, len(live), ROW_STEP):
        if i:
            yield
        entries = eng.entries
        copied += [_FIELDS(e) for e in live[i:i + ROW_STEP] if entries.get(e.path) is e]
    return Snapshot(head, copied, hot, cache_bytes, counters)


def _resident_bytes(size: int, block_bytes: int, bitmap: bytearray) -> int:
    """Entry.resident_bytes() of a TIERED entry, from its copied fields."""
    nb = -(-size // block_bytes) if block_bytes else 0
    if not nb:
        return 0
    bits = int.from_bytes(bitmap, "little") & ((1 << nb) - 1)
    n = bits.bit_count() * block_bytes
    return n - (nb * block_bytes - size) if bits >> (nb - 1) & 1 else n


def _slices(seq: Sequence) -> Iterator[Sequence]:
    """`seq` in SLICE-long slices, the GIL offered to the loop between two (a thread that wants it otherwise waits
    for the interpreter's switch interval)."""
    for i in range(0, len(seq), SLICE):
        if i:
            time.sleep(0)
        yield seq[i:i + SLICE]


def _merged(*runs: list[tuple]) -> list[tuple]:
    """Rows of several runs sorted by path, merged into one sorted list."""
    out = []
    for n, row in enumerate(heapq.merge(*runs, key=itemgetter(0)), 1):
        out.append(row)
        if n % SLICE == 0:
            time.sleep(0)
    return out


def _rows(snap: Snapshot) -> list[tuple]:
    """In the render thread: (path, kind, state, file id, generation, size, resident bytes, format, objects,
    state since) of each copied entry, sorted by path (sorted runs of a slice each, then merged)."""
    def row(path, kind, state, file_id, gen, size, fmt, objects, since, block_bytes, bitmap) -> tuple:
        resident = _resident_bytes(size, block_bytes, bitmap) if state is State.TIERED else size
        return (path, kind, state.value, file_id, gen, size, resident, fmt, objects, since)

    return _merged(*(sorted((row(*e) for e in part), key=itemgetter(0)) for part in _slices(snap.entries)))


def _rowless(snap: Snapshot, rows: list[tuple]) -> list[tuple]:
    """The hot segments with no catalog row (never sealed) as rows alike, without file id, generation, format,
    objects: sorted by path."""
    listed = {r[0] for r in rows}
    out = []
    for part in _slices(list(snap.hot.items())):
        out += [(rel, kind, State.HOT.value, None, None, size, local, None, None, 0.0)
                for rel, (kind, size, local, _) in part if rel not in listed]
    return _merged(*(sorted(p, key=itemgetter(0)) for p in _slices(out)))


def _record(row: tuple, hot: dict[str, tuple[str, int, int, str]]) -> dict:
    """A row as status.json lists it, with the reason a hot one is not sealed yet (so a stalled seal is visible,
    not silent)."""
    path, kind, state, file_id, gen, size, resident, fmt, objects, _ = row
    if file_id is None:
        return {"path": path, "kind": kind, "state": state, "size": size, "resident_bytes": resident,
                "not_sealed": hot[path][3]}
    rec = {"path": path, "kind": kind, "state": state, "file_id": file_id, "generation": gen, "size": size,
           "resident_bytes": resident, "format": fmt, "objects": objects}
    if state == State.HOT.value:
        rec["not_sealed"] = hot.get(path, _NOT_CHECKED)[3]
    return rec


def _kind_row() -> dict:
    return {"files": 0, "hot": 0, "tiered": 0, "bytes": 0, "bytes_local": 0, "bytes_remote": 0, "backlog_files": 0,
            "backlog_bytes": 0, "backlog_age_s": 0.0}


def totals(snap: Snapshot, rows: list[tuple]) -> dict:
    """Per kind: every segment (hot ones without a catalog row come from the engine's last scan, so local bytes
    are what the disk holds), bytes in the object store, and the upload backlog with the age of its oldest.
    The same per store root ("/" or a store below the mount root, e.g. "slave"). One pass over the rows and no
    per-file records: `status` stays cheap with 100,000 segments."""
    per_kind: dict[str, dict] = defaultdict(_kind_row)
    per_store: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(_kind_row))
    since: dict[tuple[str, str], float] = {}  # per (store, kind): when its oldest segment waiting was sealed
    not_sealed: dict[str, int] = {}  # hot segments by the reason they are not sealed yet
    tiered, waiting = State.TIERED.value, (State.SEALED.value, State.UPLOADING.value)
    listed: set[str] = set()
    for part in _slices(rows):
        for path, kind, state, _, _, size, resident, _, _, state_since in part:
            listed.add(path)
            root = split_root(path)[0] or "/"
            for k in (per_kind[kind], per_store[root][kind]):
                k["files"] += 1
                k["bytes"] += size
                if state == tiered:
                    k["tiered"] += 1
                    k["bytes_remote"] += size
                    k["bytes_local"] += resident
                    continue
                k["bytes_local"] += size
                if state in waiting:
                    k["backlog_files"] += 1
                    k["backlog_bytes"] += size
                else:
                    k["hot"] += 1
            if state in waiting:
                since[(root, kind)] = min(since.get((root, kind), state_since), state_since)
    for part in _slices(list(snap.hot.items())):
        for rel, (kind, size, local, why) in part:
            why = re.sub(r"\d+", "N", why)  # one line per reason, not per size or offset
            not_sealed[why] = not_sealed.get(why, 0) + 1
            if rel not in listed:
                for k in (per_kind[kind], per_store[split_root(rel)[0] or "/"][kind]):
                    k["files"] += 1
                    k["hot"] += 1
                    k["bytes"] += size
                    k["bytes_local"] += local
    now = time.time()
    for (root, kind), t in since.items():
        age = round(now - t, 1)
        per_store[root][kind]["backlog_age_s"] = age
        per_kind[kind]["backlog_age_s"] = max(per_kind[kind]["backlog_age_s"], age)
    return {"per_kind": dict(per_kind),
            "stores": {root: dict(kinds) for root, kinds in sorted(per_store.items())},
            "upload_backlog_files": sum(k["backlog_files"] for k in per_kind.values()),
            "upload_backlog_bytes": sum(k["backlog_bytes"] for k in per_kind.values()),
            "upload_backlog_age_s": round(now - min(since.values()), 1) if since else 0.0,
            "not_sealed": not_sealed, "cache_bytes": snap.cache_bytes, "engine": snap.engine}


def status_head(ops: "TierOperations", paths: "MountPaths", config: Config) -> dict:
    """The status without its per-segment parts ("totals" keeps their place): small, made on the loop."""
    sv = os.statvfs(paths.hot)
    blocks, free, avail = ops.capacity_blocks(sv, ops.remote_only_bytes())
    return {
        "version": __version__,
        "pid": os.getpid(),
        "hot_dir": str(paths.hot),
        "mountpoint": str(paths.mountpoint),
        "store_id": ops.engine.store_id if ops.engine else "",
        "uptime_s": round(time.time() - ops.stats.started, 1),
        "open_files": len(ops._fh_inode),
        "known_inodes": len(ops.inodes.paths),
        "hot_dir_bytes_used": (sv.f_blocks - sv.f_bfree) * sv.f_frsize,
        "hot_dir_bytes_free": sv.f_bavail * sv.f_frsize,
        "statfs_capacity_bytes": blocks * sv.f_frsize,
        "statfs_available_bytes": avail * sv.f_frsize,
        "bytes_read": ops.stats.bytes_read,
        "bytes_read_from_holes": ops.local.bytes_from_holes,
        "reads_threaded": ops.local.reads_threaded,
        "write_prime": ops.engine.primer.status() if ops.engine is not None else {},
        "evict_now": ops.engine.evictor.now_status() if ops.engine is not None else {},
        "bytes_written": ops.stats.bytes_written,
        "totals": None,
        "compaction": ops.engine.compactor.status() if ops.engine else {"running": None, "last": []},
        "read_only": ops.read_only,
        "snapshot": snapshot_status(ops.engine),
        "lease": ops.engine.lease.status() if ops.engine is not None and ops.engine.lease is not None else {},
        "rpo": ops.engine.appendlog.status() if ops.engine is not None and getattr(ops.engine, "appendlog", None)
        is not None else {},
        "takeover": dict(getattr(ops.engine, "takeover_info", {}) or {}) if ops.engine is not None else {},
        "follow": ops.engine.follower.status() if ops.engine is not None and getattr(ops.engine, "follower", None)
        is not None else {},
        "workers": {"restarts": dict(ops.engine.workers.restarts), "last_error": dict(ops.engine.workers.last_error)}
        if ops.engine is not None else {},
    }


def status_dict(snap: Snapshot, rows: list[tuple]) -> dict:
    """In the render thread: the head with its totals."""
    d = json.loads(snap.head)
    d["totals"] = totals(snap, rows)
    return d


def snapshot_status(eng) -> dict:
    """Read-only mounts: the snapshot served. Writable ones: the last snapshot uploaded (tierfs.tier.snapshot)."""
    if eng is None:
        return {}
    if eng.read_only:
        return dict(eng.snapshot_info)
    return eng.snapshotter.status() if eng.snapshotter is not None else {}


def render_snapshot(d: dict) -> list[str]:
    s, lease = d.get("snapshot") or {}, d.get("lease") or {}
    out = []
    if s.get("seq"):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["time"]))
        what = "serving" if d.get("read_only") else "last uploaded"
        out.append(f"  catalog snapshot: {what} seq {s['seq']} taken {when}"
                   + (f" by {s['writer']}" if s.get("writer") else ""))
    if s.get("last_error"):
        out.append(f"  snapshot error: {s['last_error']}")
    rpo = d.get("rpo") or {}
    if rpo:
        lag = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(rpo.get("lag_s", {}).items())) or "all in the bucket"
        out.append(f"  continuous tiering: every {rpo['rpo_seconds']:g} s; achieved RPO (oldest write not in the "
                   f"bucket): {lag}; {rpo['rounds']} rounds, {rpo['append_puts']} append objects")
        if rpo.get("last_error"):
            out.append(f"  continuous tiering error: {rpo['last_error']}")
    if lease:
        state = "held" if lease.get("held") else "NOT HELD (uploads stopped)"
        out.append(f"  writer lease: {state}, epoch {lease.get('epoch')}"
                   + (f", held by {lease['held_by']}" if lease.get("held_by") else ""))
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': what a person reads (status.json keeps exact byte counts)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _scalar(key: str, value: object) -> str:
    if "bytes" in key.split("_") and isinstance(value, int) and not isinstance(value, bool):
        return human_bytes(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render_status(d: dict) -> str:
    scalars = {k: v for k, v in d.items() if not isinstance(v, (dict, list))}
    width = max(len(k) for k in scalars)
    out = ["tierfs status"] + [f"  {k:<{width}}  {_scalar(k, v)}" for k, v in scalars.items()]
    t = d["totals"]
    stores = t.get("stores") or {}
    sections = sorted(stores.items()) if len(stores) > 1 or set(stores) - {"/"} else [("", t["per_kind"])]
    for root, kinds in sections:
        out.append("")
        if root:
            out.append(f"  store {root}" + ("" if root == "/" else "  (a store root below the mount root)"))
        out.append(f"  {'kind':<18}{'files':>7}{'hot':>6}{'tiered':>8}{'MiB local':>11}{'MiB remote':>12}"
                   f"{'backlog':>9}{'MiB':>9}{'oldest s':>10}")
        for kind, k in sorted(kinds.items()):
            out.append(f"  {kind:<18}{k['files']:>7}{k['hot']:>6}{k['tiered']:>8}{_mib(k['bytes_local']):>11}"
                       f"{_mib(k['bytes_remote']):>12}{k['backlog_files']:>9}{_mib(k['backlog_bytes']):>9}"
                       f"{k['backlog_age_s']:>10.1f}")
    out.append(f"  upload backlog: {t['upload_backlog_files']} files, {_mib(t['upload_backlog_bytes'])} MiB, "
               f"oldest {t['upload_backlog_age_s']} s; cache {_mib(t['cache_bytes'])} MiB")
    e = t["engine"]
    if e:
        out.append(f"  uploads {e['uploads']} ({_mib(e['upload_bytes'])} MiB), fetches {e['fetches']} "
                   f"({_mib(e['fetch_bytes'])} MiB), evicted {_mib(e['evicted_bytes'])} MiB, "
                   f"reads local/waited {e['reads_local']}/{e['reads_waited']}, errors {e['fetch_errors']}")
        if e["last_error"]:
            out.append(f"  last error: {e['last_error']}")
    hot = t.get("not_sealed") or {}
    if hot:
        out.append("  hot segments not sealed yet, by reason: "
                   + "; ".join(f"{why} ({n})" for why, n in sorted(hot.items(), key=lambda kv: -kv[1])))
    w = d.get("workers") or {}
    for name, n in sorted((w.get("restarts") or {}).items()):
        out.append(f"  worker {name} restarted {n} times; last failure {w['last_error'].get(name, '')}")
    out += render_compaction(d.get("compaction") or {})
    out += render_snapshot(d)
    return "\n".join(out) + "\n"


def render_compaction(c: dict) -> list[str]:
    out = []
    r = c.get("running")
    if r:
        out.append(f"  compaction: job {r['job_id']} running ({','.join(r['stages'])}, {r['trigger']}), "
                   f"{r['done']}/{r['total']} items, {r['seconds']} s")
        for stage, p in (r.get("progress") or {}).items():
            mark = " <- running" if stage == r.get("stage") and p["done"] < p["total"] else ""
            out.append(f"    stage {stage}: {p['done']}/{p['total']} segments done, {p['failed']} failed{mark}")
    if c.get("archive_lag_seconds") is not None:
        last = c.get("archive_last_lag_seconds")
        out.append(f"  archive lag: {c['archive_lag_seconds']:.0f} s now (oldest sealed segment not archived), "
                   f"max {c.get('archive_max_lag_seconds', 0):.0f} s"
                   + ("" if last is None else f"; last job's worst {last:.0f} s"))
    jobs = list((c.get("last") or [])[:3])
    useful = c.get("last_useful")
    if useful and all(j.get("job_id") != useful.get("job_id") for j in jobs):
        jobs.append(useful)  # the newest job that changed something, however many no-op runs came after it
    for j in jobs:
        ratio = f", ratio {j['bytes_in'] / j['bytes_out']:.2f}" if j.get("bytes_out") else ""
        state = "ok" if j.get("ok") else f"{len(j.get('errors') or [])} errors"
        what = applied_text(j.get("applied"))
        if j.get("note"):
            what = j["note"] if what == "nothing applied" else f"{what}, {j['note']}"
        out.append(f"  compaction: job {j['job_id']} {state}: {what}{ratio}")
    return out


def applied_text(applied: dict | None) -> str:
    """{'segments': 18, 'indexes': 10, 'archive': 4} -> '18 segments compacted, 10 index sidecars, ...'."""
    a = applied or {}
    parts = [f"{a[k]} {what}" for k, what in (("segments", "segments compacted"), ("indexes", "index sidecars"),
                                              ("archive", "commitlogs archived")) if a.get(k)]
    return ", ".join(parts) if parts else "nothing applied"


def render_segments(snap: Snapshot) -> list[str]:
    """The segments view, as pieces of text (one per slice: no single copy of the whole text but the last)."""
    pieces = [f"{'path':<60} {'kind':<13} {'state':<9} {'gen':>5} {'resident%':>9}  objects / why not sealed\n"]
    rows = _rows(snap)
    for part in _slices(_merged(rows, _rowless(snap, rows))):
        lines = []
        for path, kind, state, file_id, gen, size, resident, _, objects, _ in part:
            pct = 100.0 * resident / size if size else 100.0
            if file_id is None or state == State.HOT.value:
                what = f"not sealed: {snap.hot.get(path, _NOT_CHECKED)[3]}"
            else:
                what = f"{len(objects)}: {objects[0]} .." if objects else "-"
            lines.append(f"{path:<60} {kind:<13} {state:<9} {'-' if gen is None else gen:>5} {pct:>8.1f}%  {what}\n")
        pieces.append("".join(lines))
    return pieces


def _json_list(rows: list[tuple], hot: dict[str, tuple[str, int, int, str]]) -> list[str]:
    """json.dumps([_record(r) ...], separators=(",", ":")) in pieces of a slice each: only a slice's records
    exist at once, not one dict per row."""
    pieces = []
    for s in _slices(rows):
        pieces += [",", json.dumps([_record(r, hot) for r in s], separators=(",", ":"))[1:-1]]
    return ["[", *pieces[1:], "]"]


def render_status_json(snap: Snapshot) -> list[str]:
    """status.json: the summary indented, the file records compact (json.dumps with an indent runs the
    pure-Python encoder, 8x slower than the C one), as pieces of text."""
    rows = _rows(snap)
    head = json.dumps(status_dict(snap, rows), indent=1)
    hot = _merged([r for r in rows if r[2] == State.HOT.value], _rowless(snap, rows))
    return [head[:-2], ',\n "files": ', *_json_list(rows, snap.hot), ',\n "hot_segments": ',
            *_json_list(hot, snap.hot), "\n}\n"]


def install_views(ops: "TierOperations", paths: "MountPaths", config: Config) -> None:
    def take_with(head: bool):
        return lambda: take(ops, paths, config, head)

    ops.control.add_snapshot("status", take_with(True), lambda snap: render_status(status_dict(snap, _rows(snap))))
    ops.control.add_snapshot("status.json", take_with(True), render_status_json)
    ops.control.add_snapshot("segments", take_with(False), render_segments)
    ops.control.add("stats", ops.stats.render)
    ops.control.add("config", lambda: config.render_toml(redact=True))
