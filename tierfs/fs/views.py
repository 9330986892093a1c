"""What the control directory shows: the renderers behind `/.tierfs/*`."""

from __future__ import annotations

import json
import re
import os
import time
from collections import defaultdict
from typing import TYPE_CHECKING

from tierfs import __version__
from tierfs.config import Config
from tierfs.store.paths import split_root
from tierfs.tier.catalog import State

if TYPE_CHECKING:
    from tierfs.fs.mount import MountPaths
    from tierfs.fs.operations import TierOperations


def files_list(ops: "TierOperations", with_hot: bool = False) -> list[dict]:
    """One record per cataloged segment and, with_hot, per hot segment with no row as of the sealer's last scan,
    with the reason each hot one is not sealed yet (so a stalled seal is visible, not silent)."""
    eng = ops.engine
    if eng is None:
        return []
    out = []
    for e in list(eng.entries.values()):
        resident = e.resident_bytes() if e.state is State.TIERED else e.size
        rec = {"path": e.path, "kind": e.kind, "state": e.state.value, "file_id": e.file_id,
               "generation": e.generation, "size": e.size, "resident_bytes": resident, "format": e.format,
               "objects": e.objects}
        if e.state is State.HOT:
            rec["not_sealed"] = eng.sealer.hot_segments.get(e.path, ("", 0, 0, "not checked yet"))[3]
        out.append(rec)
    for rel, (kind, size, local, why) in list(eng.sealer.hot_segments.items()) if with_hot else ():
        if rel not in eng.entries:
            out.append({"path": rel, "kind": kind, "state": "hot", "size": size, "resident_bytes": local,
                        "not_sealed": why})
    out.sort(key=lambda r: r["path"])
    return out


def _kind_row() -> dict:
    return {"files": 0, "hot": 0, "tiered": 0, "bytes": 0, "bytes_local": 0, "bytes_remote": 0, "backlog_files": 0,
            "backlog_bytes": 0, "backlog_age_s": 0.0}


def totals(eng) -> dict:
    """Per kind: every segment (hot ones without a catalog row come from the engine's last scan, so local bytes
    are what the disk holds), bytes in the object store, and the upload backlog with the age of its oldest.
    The same per store root ("/" or a store below the mount root, e.g. "slave"). One pass over the rows and no
    per-file records: `status` stays cheap with 100,000 segments."""
    per_kind: dict[str, dict] = defaultdict(_kind_row)
    per_store: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(_kind_row))
    since: dict[tuple[str, str], float] = {}  # per (store, kind): when its oldest segment waiting was sealed
    not_sealed: dict[str, int] = {}  # hot segments by the reason they are not sealed yet
    if eng is not None:
        tiered, waiting = State.TIERED, (State.SEALED, State.UPLOADING)
        for e in list(eng.entries.values()):
            root = split_root(e.path)[0] or "/"
            for k in (per_kind[e.kind], per_store[root][e.kind]):
                k["files"] += 1
                k["bytes"] += e.size
                if e.state is tiered:
                    k["tiered"] += 1
                    k["bytes_remote"] += e.size
                    k["bytes_local"] += e.resident_bytes()
                    continue
                k["bytes_local"] += e.size
                if e.state in waiting:
                    k["backlog_files"] += 1
                    k["backlog_bytes"] += e.size
                else:
                    k["hot"] += 1
            if e.state in waiting:
                since[(root, e.kind)] = min(since.get((root, e.kind), e.state_since), e.state_since)
        for rel, (kind, size, local, why) in list(eng.sealer.hot_segments.items()):
            why = re.sub(r"\d+", "N", why)  # one line per reason, not per size or offset
            not_sealed[why] = not_sealed.get(why, 0) + 1
            if rel not in eng.entries:
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
            "not_sealed": not_sealed, "cache_bytes": eng.cache_bytes if eng else 0, "engine": dict(vars(eng.stats)) if eng else {}}


def status_dict(ops: "TierOperations", paths: "MountPaths", config: Config, with_files: bool) -> dict:
    sv = os.statvfs(paths.hot)
    blocks, free, avail = ops.capacity_blocks(sv, ops.remote_only_bytes())
    d = {
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
        "totals": totals(ops.engine),
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
    if with_files:
        d["files"] = files_list(ops)
        d["hot_segments"] = [f for f in files_list(ops, with_hot=True) if "not_sealed" in f]
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


def render_segments(ops: "TierOperations") -> str:
    lines = [f"{'path':<60} {'kind':<13} {'state':<9} {'gen':>5} {'resident%':>9}  objects / why not sealed"]
    for f in files_list(ops, with_hot=True):
        pct = 100.0 * f["resident_bytes"] / f["size"] if f["size"] else 100.0
        objs = f"{len(f['objects'])}: {f['objects'][0]} .." if f.get("objects") else "-"
        if "not_sealed" in f:
            objs = f"not sealed: {f['not_sealed']}"
        lines.append(f"{f['path']:<60} {f['kind']:<13} {f['state']:<9} {f.get('generation', '-'):>5} {pct:>8.1f}%  "
                     f"{objs}")
    return "\n".join(lines) + "\n"


def render_status_json(d: dict) -> str:
    """status.json: the summary indented, the file records compact. json.dumps with an indent runs the pure-Python
    encoder, 8x slower than the C one: with 100,000 segments that took seconds, all of them on the FUSE loop."""
    files = d.pop("files", None)
    hot = d.pop("hot_segments", None)
    head = json.dumps(d, indent=1)
    if files is None:
        return head + "\n"
    return (head[:-2] + ',\n "files": ' + json.dumps(files, separators=(",", ":"))
            + ',\n "hot_segments": ' + json.dumps(hot or [], separators=(",", ":")) + "\n}\n")


def install_views(ops: "TierOperations", paths: "MountPaths", config: Config) -> None:
    ops.control.add("status", lambda: render_status(status_dict(ops, paths, config, False)))
    ops.control.add("status.json", lambda: render_status_json(status_dict(ops, paths, config, True)))
    ops.control.add("segments", lambda: render_segments(ops))
    ops.control.add("stats", ops.stats.render)
    ops.control.add("config", lambda: config.render_toml(redact=True))
