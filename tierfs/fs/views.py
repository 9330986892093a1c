"""What the control directory shows: the renderers behind `/.tierfs/{status,status.json,stats,config}`."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from tierfs import __version__
from tierfs.config import Config

if TYPE_CHECKING:
    from tierfs.fs.mount import MountPaths
    from tierfs.fs.operations import TierOperations


def status_dict(ops: "TierOperations", paths: "MountPaths", config: Config) -> dict:
    sv = os.statvfs(paths.hot)
    blocks, free, avail = ops.capacity_blocks(sv)
    return {
        "version": __version__,
        "pid": os.getpid(),
        "hot_dir": str(paths.hot),
        "mountpoint": str(paths.mountpoint),
        "uptime_s": round(time.time() - ops.stats.started, 1),
        "open_files": len(ops._fh_inode),
        "known_inodes": len(ops.inodes.paths),
        "hot_dir_bytes_used": (sv.f_blocks - sv.f_bfree) * sv.f_frsize,
        "hot_dir_bytes_free": sv.f_bavail * sv.f_frsize,
        "statfs_capacity_bytes": blocks * sv.f_frsize,
        "statfs_available_bytes": avail * sv.f_frsize,
        "bytes_read": ops.stats.bytes_read,
        "bytes_written": ops.stats.bytes_written,
    }


def render_status(d: dict) -> str:
    width = max(len(k) for k in d)
    return "tierfs status\n" + "".join(f"  {k:<{width}}  {v}\n" for k, v in d.items())


def install_views(ops: "TierOperations", paths: "MountPaths", config: Config) -> None:
    ops.control.add("status", lambda: render_status(status_dict(ops, paths, config)))
    ops.control.add("status.json", lambda: json.dumps(status_dict(ops, paths, config), indent=1) + "\n")
    ops.control.add("stats", ops.stats.render)
    ops.control.add("config", lambda: config.render_toml(redact=True))
