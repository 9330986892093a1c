"""The effective object store settings of a hot dir, for offline tools (`tierfs fsck`).

The daemon writes HOT/.tierfs/store.json at mount with the store URL, the options it opened the store with and the
store id, so a tool that runs while the store is unmounted (or on a hot dir without its config file) reaches the
same bucket and prefix. The file holds credentials when the config has them: it is created mode 0600 and replaced
atomically (a reader never sees half a file), and never printed by the tools.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierfs.objectstore import ObjectStore, open_store

FILE_NAME = "store.json"


@dataclass(frozen=True)
class StoreConfig:
    url: str
    store_id: str
    options: dict[str, Any] = field(default_factory=dict)
    group: str = ""  # upload.dedup_group: the broker group whose shared chunks this store names

    def open(self) -> ObjectStore:
        return open_store(self.url, **self.options)


def save(state_dir: Path, url: str, options: dict[str, Any], store_id: str, group: str = "") -> None:
    """Write STATE_DIR/store.json (mode 0600, atomic replace)."""
    path = Path(state_dir) / FILE_NAME
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    body = json.dumps({"url": url, "store_id": store_id, "options": options, "group": group}, indent=1,
                      sort_keys=True) + "\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may be 0 in the daemon, and an old file may have had other bits
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load(state_dir: Path) -> StoreConfig:
    """Read STATE_DIR/store.json. FileNotFoundError / ValueError name the file and what is wrong."""
    path = Path(state_dir) / FILE_NAME
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: this hot dir was never mounted by a tierfs that records "
                                f"its object store settings; mount it once, then run the tool again") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("url"), str) or not isinstance(d.get("store_id"), str) \
            or not isinstance(d.get("options", {}), dict):
        raise ValueError(f"{path}: expected an object with string 'url', string 'store_id' and object 'options'")
    return StoreConfig(d["url"], d["store_id"], dict(d.get("options") or {}), str(d.get("group") or ""))
