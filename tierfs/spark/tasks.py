"""Executor-side task functions of the pipeline: one tiered segment in, new objects plus a result row out.

They run inside Spark executors (or the driver), reach the object store only through the `ObjectStore` they are
given, and never touch FUSE or the catalog: the daemon verifies each result row and swaps its catalog entry.
Every failure raises :class:`SegmentError` naming the segment (path, generation) and, where one is involved, the
object key. A SEG dict is a catalog entry as in the pipeline contract: path, kind, generation, size, format
("raw" | "lz4c"), chunk_bytes, block_bytes, crc32c, block_crcs, objects.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import threading
from typing import Any, Iterator

import crc32c as _crc32c

from tierfs.objectstore import ObjectStore, ObjectStoreError, format_crc32c
from tierfs.objectstore.base import spool_put
from tierfs.store import cidx
from tierfs.tier import layout, lz4c

__all__ = ["SegmentError", "read_segment", "compact_segment", "build_index_sidecar"]

_READ_BYTES = 16 << 20  # at most this much per GET while streaming a segment (rounded to whole blocks)
_READ_AHEAD = 1         # GETs in flight beyond the one being consumed (a thread overlaps them with the work)
STREAM_MAX_BYTES = 4 << 30  # compact_segment streams segments up to this size into put_stream, spools larger ones
POOL_MAX_BYTES = 512 << 20  # buffers kept for reuse by this process (an executor's Python worker runs many tasks)


class SegmentError(Exception):
    """A task could not process a segment; the message names the segment and the object involved."""


def _crc(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def _name(seg: dict) -> str:
    return f"segment {seg.get('path')!r} generation {seg.get('generation')}"


def _field(seg: dict, key: str, kind: type) -> Any:
    v = seg.get(key)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise SegmentError(f"{_name(seg)}: field {key!r} is missing or not a {kind.__name__} ({v!r})")
    return v


def _blocks_per_read(block_bytes: int) -> int:
    return max(1, _READ_BYTES // block_bytes)


class _BufferPool:
    """Buffers kept for reuse across reads and tasks of this process: a fresh 16 MiB buffer costs page faults
    and zeroing about as much as lz4 costs on the same bytes; a reused one costs neither."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A buffer of at least *size* bytes (contents undefined)."""
        with self._lock:
            fits = [b for b in self._free if len(b) >= size]
            if fits:
                buf = min(fits, key=len)
                self._free.remove(buf)
                return buf
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        """Return a buffer no view of which is used any more; the smallest are dropped beyond max_bytes."""
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len, reverse=True)
            total = 0
            for i, b in enumerate(self._free):
                total += len(b)
                if total > self.max_bytes:
                    del self._free[i:]
                    break


_POOL = _BufferPool(POOL_MAX_BYTES)


@contextlib.contextmanager
def _pooled(sizes: list[int]) -> Iterator[list[bytearray]]:
    bufs = [_POOL.take(n) for n in sizes]
    try:
        yield bufs
    finally:
        for b in bufs:
            _POOL.give(b)


def _read_ahead(store: ObjectStore, ranges: list[tuple[str, int, int]], transient: bool = False
                ) -> Iterator[tuple[bytes | memoryview, Exception | None]]:
    """(data, None) for each ranged GET (key, offset, length), in order, the next _READ_AHEAD GETs already in
    flight on a helper thread while the caller works on the current one; (b"", error) for a GET that failed (the
    caller names the object, and stops).

    *transient*: data is a view of a pooled buffer that a later GET of this call reuses, valid until the caller
    asks for the next item but one (no fresh memory per GET); else a bytes object of its own."""
    nbuf = min(len(ranges), _READ_AHEAD + 2) if transient else 0
    with _pooled([max(n for _, _, n in ranges)] * nbuf if nbuf else []) as bufs:
        def get(t: int) -> tuple[bytes | memoryview, Exception | None]:
            key, off, n = ranges[t]
            try:
                if not bufs:
                    return store.get_range(key, off, n), None
                view = memoryview(bufs[t % len(bufs)])[:n]
                store.get_range_into(key, off, [view])
                return view.toreadonly(), None
            except ObjectStoreError as e:
                return b"", e

        if len(ranges) <= 1:
            yield from map(get, range(len(ranges)))
            return
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierfs-read-ahead") as pool:
            pending: collections.deque = collections.deque(pool.submit(get, t)
                                                           for t in range(min(len(ranges), _READ_AHEAD + 1)))
            todo = iter(range(_READ_AHEAD + 1, len(ranges)))
            try:
                while pending:
                    fut = pending.popleft()
                    nxt = next(todo, None)
                    if nxt is not None:
                        pending.append(pool.submit(get, nxt))
                    yield fut.result()
            finally:
                for fut in pending:
                    fut.cancel()


# ------------------------------------------------------------------------------------------------ read


def read_segment(store: ObjectStore, seg: dict, *, transient: bool = False,
                 check_content: bool = True) -> Iterator[bytes | memoryview]:
    """Yield the segment's content block by block (``block_bytes`` each, the last maybe shorter; bytes or read-only
    memoryviews of a larger GET, never copied), from its raw chunk objects or its lz4c object, the next GET in
    flight while the caller works on the current one. Every block is checked against its crc32c before it is
    yielded, and the whole content against ``seg["crc32c"]`` after the last one (a mismatch there raises instead of
    finishing).

    *transient*: GETs land in buffers reused by later GETs of the same read (and later reads of this process), so
    a block stays valid only until the caller has used the blocks after it of one more GET (up to 16 MiB): for
    callers that copy or consume each block at once. *check_content* False (raw segments) leaves the whole-content
    check to a caller that computes the same crc32c anyway (each block is still checked)."""
    fmt = seg.get("format")
    if fmt == "raw":
        return _read_raw(store, seg, transient, check_content)
    if fmt == "lz4c":
        return _read_lz4c(store, seg, transient, check_content)
    raise SegmentError(f"{_name(seg)}: unknown format {fmt!r} (expected raw or lz4c)")


def _common(seg: dict) -> tuple[int, int, list[str]]:
    size, bb = _field(seg, "size", int), _field(seg, "block_bytes", int)
    objects = _field(seg, "objects", list)
    if size < 0 or bb <= 0:
        raise SegmentError(f"{_name(seg)}: size {size} and block_bytes {bb} must be >= 0 and > 0")
    return size, bb, objects


def _check_content(seg: dict, crc: int, size: int) -> None:
    want = seg.get("crc32c")
    if want is not None and crc != want:
        raise SegmentError(f"{_name(seg)}: content crc32c {crc:08x} of {size} bytes does not match the catalog's "
                           f"{want:08x}")


def _read_raw(store: ObjectStore, seg: dict, transient: bool, check_content: bool) -> Iterator[bytes | memoryview]:
    size, bb, objects = _common(seg)
    chunk = _field(seg, "chunk_bytes", int)
    crcs = _field(seg, "block_crcs", list)
    if chunk <= 0 or chunk % bb:
        raise SegmentError(f"{_name(seg)}: chunk_bytes {chunk} is not a positive multiple of block_bytes {bb}")
    nchunks, nblocks = max(-(-size // chunk), 1), -(-size // bb)
    if len(objects) != nchunks:
        raise SegmentError(f"{_name(seg)}: {len(objects)} chunk objects listed, {size} bytes in chunks of {chunk} "
                           f"need {nchunks}")
    if len(crcs) != nblocks:
        raise SegmentError(f"{_name(seg)}: {len(crcs)} block crc32c values listed, {size} bytes need {nblocks}")
    step = _blocks_per_read(bb) * bb
    ranges = [(key, rel, min(step, min(chunk, size - i * chunk) - rel))
              for i, key in enumerate(objects) for rel in range(0, min(chunk, size - i * chunk), step)]
    crc, b = 0, 0
    for (key, rel, n), (data, err) in zip(ranges, _read_ahead(store, ranges, transient)):
        if err is not None:
            raise SegmentError(f"{_name(seg)}: chunk object {key!r}: {type(err).__name__}: {err}") from err
        if len(data) != n:
            raise SegmentError(f"{_name(seg)}: chunk object {key!r} returned {len(data)} bytes at {rel}, "
                               f"expected {n}")
        mv = memoryview(data)
        for pos in range(0, n, bb):
            block = mv[pos:pos + bb]
            got = _crc(block)
            if got != crcs[b]:
                raise SegmentError(f"{_name(seg)}: chunk object {key!r} is corrupt: block {b} (object bytes "
                                   f"[{rel + pos}, {rel + pos + len(block)})) has crc32c {got:08x}, the "
                                   f"catalog says {crcs[b]:08x}")
            if check_content:
                crc = _crc(block, crc)
            b += 1
            yield block
    if check_content:
        _check_content(seg, crc, size)


def _read_lz4c(store: ObjectStore, seg: dict, transient: bool, check_content: bool) -> Iterator[bytes]:
    size, bb, objects = _common(seg)
    if len(objects) != 1:
        raise SegmentError(f"{_name(seg)}: an lz4c segment has exactly one object, {len(objects)} are listed")
    key = objects[0]

    try:
        try:
            f = lz4c.read_object_footer(store, key)
        except lz4c.ObjectMissing:
            raise SegmentError(f"{_name(seg)}: lz4c object {key!r} does not exist") from None
        t = f.trailer
        if (t.size, t.block_bytes) != (size, bb):
            raise SegmentError(f"{_name(seg)}: lz4c object {key!r} holds {t.size} bytes in blocks of {t.block_bytes}, "
                               f"the catalog says {size} bytes in blocks of {bb}")
        want = seg.get("crc32c")
        if want is not None and t.content_crc32c != want:
            raise SegmentError(f"{_name(seg)}: lz4c object {key!r} says content crc32c {t.content_crc32c:08x}, "
                               f"the catalog says {want:08x}")
        crcs = seg.get("block_crcs") or []
        if crcs and list(crcs) != f.crcs:
            bad = next((i for i, (a, c) in enumerate(zip(crcs, f.crcs)) if a != c), min(len(crcs), len(f.crcs)))
            raise SegmentError(f"{_name(seg)}: lz4c object {key!r}: block {bad}'s crc32c differs from the catalog's")
        per = _blocks_per_read(bb)
        crc = 0
        firsts = range(0, t.nblocks, per)
        spans = [lz4c.block_span(f, first, min(per, t.nblocks - first)) for first in firsts]
        reads = _read_ahead(store, [(key, *sp) for sp in spans], transient)
        for first, (off, length), (raw, err) in zip(firsts, spans, reads):
            if err is not None:
                raise err
            data = memoryview(raw)
            if len(data) != length:
                raise SegmentError(f"{_name(seg)}: lz4c object {key!r} returned {len(data)} bytes at {off}, "
                                   f"expected {length}")
            for b in range(first, min(first + per, t.nblocks)):
                rel = f.coff[b] - off
                block = lz4c.decode_blocks(f, b, 1, data[rel:rel + f.clen[b]])
                crc = _crc(block, crc)
                yield block
    except lz4c.Lz4cError as e:
        raise SegmentError(f"{_name(seg)}: lz4c object {key!r} is corrupt: {e}") from e
    except ObjectStoreError as e:
        raise SegmentError(f"{_name(seg)}: lz4c object {key!r}: {type(e).__name__}: {e}") from e
    _check_content(seg, crc, size)
    if crc != t.content_crc32c:
        raise SegmentError(f"{_name(seg)}: lz4c object {key!r} is corrupt: content crc32c {crc:08x}, its trailer "
                           f"says {t.content_crc32c:08x}")


# ------------------------------------------------------------------------------------------------ compact


def compact_segment(store: ObjectStore, store_id: str, seg: dict, tmp_dir: str | None = None) -> dict:
    """Rewrite a raw segment as one lz4c object (``layout.lz4c_key``); return its ``segments[]`` result row.

    Reads run one GET ahead of the encoder, into reused buffers, and the compressed blocks stream into
    ``store.put_stream`` as they are produced (on S3, parts upload while the encoder works; posix writes them into
    the object's temp file). Nothing is stored unless the whole content matched the catalog's size and crc32c.
    """
    path, gen = _field(seg, "path", str), _field(seg, "generation", int)
    if seg.get("format") != "raw":
        raise SegmentError(f"{_name(seg)}: format is {seg.get('format')!r}; only raw segments are compacted")
    want = _field(seg, "crc32c", int)
    size, bb, _ = _common(seg)
    key = layout.lz4c_key(store_id, path, gen)
    w = lz4c.Lz4cWriter(bb)

    def produce() -> Iterator[bytes]:
        for block in read_segment(store, seg, transient=True, check_content=False):
            out = w.add(block)
            if out:
                yield out
        yield w.finish()
        if w.size != size or w.content_crc32c != want:  # the reader left this check to the writer's crc32c
            raise SegmentError(f"{_name(seg)}: compacted content is {w.size} bytes with crc32c "
                               f"{w.content_crc32c:08x}; the catalog's size is {size} bytes, its crc32c {want:08x}")

    def meta() -> dict[str, str]:  # called when the stream has ended: the content crc32c is known then
        return {"tierfs-format": "lz4c", "tierfs-size": str(size),
                "tierfs-content-crc32c": format_crc32c(w.content_crc32c)}

    # S3 sets the crc32c metadata by a copy onto itself, limited to 5 GiB: larger segments are spooled
    put = store.put_stream if size <= STREAM_MAX_BYTES else functools.partial(spool_put, store)
    try:
        info = put(key, produce(), metadata=meta, spool_dir=tmp_dir)
    except ObjectStoreError as e:
        raise SegmentError(f"{_name(seg)}: upload of lz4c object {key!r}: {type(e).__name__}: {e}") from e
    if info.size != w.compressed_size:
        raise SegmentError(f"{_name(seg)}: lz4c object {key!r} was stored with {info.size} bytes, "
                           f"{w.compressed_size} were uploaded")
    return {"path": path, "generation": gen, "format": "lz4c", "key": key, "size": size,
            "compressed_bytes": w.compressed_size, "crc32c": w.content_crc32c, "block_bytes": bb}


# ------------------------------------------------------------------------------------------------ index sidecar


def build_index_sidecar(store: ObjectStore, store_id: str, seg: dict, max_hash_slot_num: int,
                        max_index_num: int) -> dict:
    """Build the ``.cidx`` sidecar of a tiered IndexFile (``layout.cidx_key``); return its ``indexes[]`` row."""
    path, gen = _field(seg, "path", str), _field(seg, "generation", int)
    size = _field(seg, "size", int)
    buf = bytearray(size)
    pos = 0
    for block in read_segment(store, seg):
        buf[pos:pos + len(block)] = block
        pos += len(block)
    if pos != size:
        raise SegmentError(f"{_name(seg)}: read {pos} bytes, the catalog says {size}")
    try:
        data = cidx.build(buf, max_hash_slot_num, max_index_num)
    except cidx.CidxError as e:
        raise SegmentError(f"{_name(seg)}: no index sidecar: {e}") from e
    del buf
    key = layout.cidx_key(store_id, path, gen)
    crc = _crc(data)
    try:
        info = store.put(key, data, metadata={"tierfs-format": "cidx", "crc32c": format_crc32c(crc)})
    except ObjectStoreError as e:
        raise SegmentError(f"{_name(seg)}: upload of index sidecar {key!r}: {type(e).__name__}: {e}") from e
    if info.size != len(data):
        raise SegmentError(f"{_name(seg)}: index sidecar {key!r} was stored with {info.size} bytes, "
                           f"{len(data)} were uploaded")
    return {"path": path, "generation": gen, "key": key, "bytes": len(data), "crc32c": crc}
