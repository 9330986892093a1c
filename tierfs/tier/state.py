"""Small shared types of the tiering engine: the TIERED index, counters, and the errors its parts raise."""

from __future__ import annotations

import errno
from dataclasses import dataclass, field

from tierfs.tier.catalog import Entry


class TieredIndex(dict):
    """TIERED entries by hot-dir st_ino, keeping the sum of their sizes: statfs asks for the store's remote-only
    bytes on every call, and a sum over 100,000 entries per call would make `df` (and the broker's disk check)
    cost O(files). A tiered entry's size never changes while it is in here (a write or truncate takes it out)."""

    def __init__(self) -> None:
        super().__init__()
        self.total_bytes = 0

    def __setitem__(self, ino: int, e: Entry) -> None:
        old = super().get(ino)
        if old is not None:
            self.total_bytes -= old.size
        super().__setitem__(ino, e)
        self.total_bytes += e.size

    def __delitem__(self, ino: int) -> None:
        self.total_bytes -= super().__getitem__(ino).size
        super().__delitem__(ino)

    _MISSING = object()

    def pop(self, ino: int, default=_MISSING):  # type: ignore[override]
        e = super().pop(ino, None) if default is not TieredIndex._MISSING else super().pop(ino)
        if e is None:
            return None if default is TieredIndex._MISSING else default
        self.total_bytes -= e.size
        return e

    def clear(self) -> None:
        super().clear()
        self.total_bytes = 0


@dataclass
class WorkerStats:
    """Restarts of supervised background workers, for `tierfs status` and tierfs_worker_restarts_total."""

    restarts: dict = field(default_factory=dict)  # worker name -> count
    last_error: dict = field(default_factory=dict)  # worker name -> "when: what"


@dataclass
class EngineStats:
    uploads: int = 0
    upload_bytes: int = 0
    upload_copied_bytes: int = 0  # of upload_bytes: composed in the store from append objects, not sent again
    upload_dedup_bytes: int = 0  # of upload_bytes: content-addressed chunks another row had stored already
    upload_failures: int = 0
    fetches: int = 0
    fetch_bytes: int = 0
    fetch_errors: int = 0
    corrupt_objects: int = 0
    evicted_bytes: int = 0
    evicted_blocks: int = 0
    reads_local: int = 0
    reads_waited: int = 0
    reads_from_memory: int = 0  # reads answered (at least partly) from fetched buffers, not the hot file
    install_bytes: int = 0  # fetched bytes written into hot files (kept in the local cache)
    memory_only_bytes: int = 0  # fetched bytes served from memory only (a scan beyond the cache budget)
    named_prefetch_bytes: int = 0  # prefetched because a tiered ConsumeQueue page named them (layout-aware)
    prefetch_bytes: int = 0
    unit_fetch_bytes: int = 0  # of fetch_bytes: verification units a random read fetched (not whole blocks)
    unit_table_loads: int = 0  # verification table objects fetched into the daemon's LRU
    unit_tables_refused: int = 0  # table objects refused (reference mismatch) or found wrong by block crc32c
    rewrites: int = 0
    identical_rewrites: int = 0
    last_error: str = ""


class ShortRead(OSError):
    """The hot file no longer holds what was sealed (it shrank, or was replaced): not an upload failure to
    retry forever, but a changed file to seal again."""

    def __init__(self, keys: list[str], msg: str):
        super().__init__(errno.EIO, msg)
        self.keys = keys


class ReadFailed(OSError):
    """A read of evicted bytes that cannot be served (object store down past the bound, corrupt object)."""

    def __init__(self, msg: str):
        super().__init__(errno.EIO, msg)
