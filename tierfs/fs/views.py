"""What the control directory shows: the renderers behind `/.tierfs/*`."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from typing import TYPE_CHECKING

from tierfs import __version__
from tierfs.config import Config
from tierfs.tier.catalog import State

if TYPE_CHECKING:
    from tierfs.fs.mount import MountPaths
    from tierfs.fs.operations import TierOperations


def files_list(ops: "TierOperations") -> list[dict]:
    """One record per cataloged segment; HOT segments never sealed have no row and are not listed."""
    eng = ops.engine
    if eng is None:
        return []
    out = []
    for e in sorted(eng.entries.values(), key=lambda e: e.path):
        resident = e.resident_bytes() if e.state is State.TIERED else e.size
        out.append({"path": e.path, "kind": e.kind, "state": e.state.value, "generation": e.generation,
                    "size": e.size, "resident_bytes": resident, "format": e.format, "objects": e.objects})
    return out


def totals(files: list[dict], eng) -> dict:
    per_kind: dict[str, dict] = defaultdict(lambda: {"files": 0, "bytes": 0, "bytes_local": 0, "bytes_remote": 0,
                                                     "tiered": 0, "backlog_files": 0, "backlog_bytes": 0})
    for f in files:
        k = per_kind[f["kind"]]
        k["files"] += 1
        k["bytes"] += f["size"]
        k["bytes_local"] += f["resident_bytes"]
        if f["state"] == "tiered":
            k["tiered"] += 1
            k["bytes_remote"] += f["size"]
        elif f["state"] in ("sealed", "uploading"):
            k["backlog_files"] += 1
            k["backlog_bytes"] += f["size"]
    bl_files, bl_bytes, bl_age = eng.upload_backlog() if eng else (0, 0, 0.0)
    return {"per_kind": dict(per_kind), "upload_backlog_files": bl_files, "upload_backlog_bytes": bl_bytes,
            "upload_backlog_age_s": round(bl_age, 1), "cache_bytes": eng.cache_bytes if eng else 0,
            "engine": dict(vars(eng.stats)) if eng else {}}


def status_dict(ops: "TierOperations", paths: "MountPaths", config: Config, with_files: bool) -> dict:
    sv = os.statvfs(paths.hot)
    blocks, free, avail = ops.capacity_blocks(sv, ops.remote_only_bytes())
    files = files_list(ops)
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
        "bytes_written": ops.stats.bytes_written,
        "totals": totals(files, ops.engine),
    }
    if with_files:
        d["files"] = files
    return d


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def render_status(d: dict) -> str:
    scalars = {k: v for k, v in d.items() if not isinstance(v, (dict, list))}
    width = max(len(k) for k in scalars)
    out = ["tierfs status"] + [f"  {k:<{width}}  {v}" for k, v in scalars.items()]
    t = d["totals"]
    out.append("")
    out.append(f"  {'kind':<18}{'files':>7}{'tiered':>8}{'MiB local':>11}{'MiB remote':>12}{'backlog':>9}")
    for kind, k in sorted(t["per_kind"].items()):
        out.append(f"  {kind:<18}{k['files']:>7}{k['tiered']:>8}{_mib(k['bytes_local']):>11}"
                   f"{_mib(k['bytes_remote']):>12}{k['backlog_files']:>9}")
    out.append(f"  upload backlog: {t['upload_backlog_files']} files, {_mib(t['upload_backlog_bytes'])} MiB, "
               f"oldest {t['upload_backlog_age_s']} s; cache {_mib(t['cache_bytes'])} MiB")
    e = t["engine"]
    if e:
        out.append(f"  uploads {e['uploads']} ({_mib(e['upload_bytes'])} MiB), fetches {e['fetches']} "
                   f"({_mib(e['fetch_bytes'])} MiB), evicted {_mib(e['evicted_bytes'])} MiB, "
                   f"reads local/waited {e['reads_local']}/{e['reads_waited']}, errors {e['fetch_errors']}")
        if e["last_error"]:
            out.append(f"  last error: {e['last_error']}")
    return "\n".join(out) + "\n"


def render_segments(ops: "TierOperations") -> str:
    lines = [f"{'path':<60} {'kind':<13} {'state':<9} {'gen':>3} {'resident%':>9}  objects"]
    for f in files_list(ops):
        pct = 100.0 * f["resident_bytes"] / f["size"] if f["size"] else 100.0
        objs = f"{len(f['objects'])}: {f['objects'][0]} .." if f["objects"] else "-"
        lines.append(f"{f['path']:<60} {f['kind']:<13} {f['state']:<9} {f['generation']:>3} {pct:>8.1f}%  {objs}")
    return "\n".join(lines) + "\n"


def install_views(ops: "TierOperations", paths: "MountPaths", config: Config) -> None:
    ops.control.add("status", lambda: render_status(status_dict(ops, paths, config, False)))
    ops.control.add("status.json", lambda: json.dumps(status_dict(ops, paths, config, True), indent=1) + "\n")
    ops.control.add("segments", lambda: render_segments(ops))
    ops.control.add("stats", ops.stats.render)
    ops.control.add("config", lambda: config.render_toml(redact=True))
