#!/usr/bin/env python3
"""Soak: a writer, two verifying readers, tiering, eviction and compaction, all at once, for a while.

One run mounts tierfs (small cache budget, quick seals, short segments: every path runs many times) and starts
three child processes on the mount, each in its own interpreter:

  writer  A continuous RocketMQ-style writer (examples/producer.py's message content: KEYS k-<seq>, UNIQ_KEY,
          TAGS, bodies cut from a seeded pool): CommitLog records memcpy'd into MAP_SHARED mappings of ftruncate'd
          segments with the next one preallocated, msync every --flush-ms, a BLANK at each roll; one 20-byte
          ConsumeQueue pwrite per message (5.3.1+ FileChannel mode) with fdatasync every --cq-flush-ms; IndexFiles
          filled through their mapping, the previous one header-flushed and msynced at each roll. It keeps the
          crc32c of every file as it writes it (records and units as they are put, zeros as far as the file size;
          an IndexFile's own mapping just before its msync, so before it can be sealed): the reference for the end.
          Segments more than --keep-mapped behind are unmapped and closed so readers can drop their pages.
          (examples/producer.py itself cannot serve: it only writes fresh stores and keeps every segment mapped.)
  tail    A consumer right behind the writer: follows every ConsumeQueue, reads each record it points at through
          the mount (pread) and checks it byte for byte against the record the writer must have written (body,
          BODYCRC, properties, queue id and offset, physical offset; timestamps taken from the record and checked
          to never go backwards per queue). A unit read while it was being written (torn) is read again.
  replay  A lagging consumer: passes over every complete CommitLog segment from the first one (a consumer
          group reset to the earliest offset), pages dropped first (posix_fadvise DONTNEED on that file only), so
          reads of evicted blocks go to the object store; every record checked the same way, plus its
          ConsumeQueue unit (offset, size, tags hash), at --replay-rate messages/s.

Meanwhile `tierfs compact MNT --json` runs --compactions times, evenly spaced (lz4c rewrite, .cidx sidecars,
Parquet archive of tiered segments while they are read; a run that falls due while the previous one still runs
starts when it ends), and MNT/.tierfs/status.json is polled every
--sample-interval seconds. A line every --interval seconds: messages/s written and read by each reader, MB/s
uploaded and fetched, the upload backlog (largest in the interval), cache bytes, the engine's local-read share.

At the end: the writer stops and reports its crc32c list; the tail reader must have verified every message; the
upload backlog must drain (every complete segment tiered) within --drain-timeout; every file the writer made is
read back through the mount with its pages dropped and its crc32c must equal the writer's; examples/consumer.py
verifies the whole store (every record, every ConsumeQueue unit, --check-keys look-ups through the IndexFiles);
`tierfs fsck MNT --deep` must find nothing. Reported: the largest upload backlog, the cache hit ratio
(reads_local / (reads_local + reads_waited), status.json totals.engine), and, measured in the same run before the
soak, the writer's unthrottled throughput through a fresh mount vs. the same writer on the native filesystem
(--baseline-repeat alternating pairs of --baseline-seconds; the ratio is the median of the paired ratios).

    .venv/bin/python bench/soak.py                              # 10 minutes of soak, about 14 in all on 2 cores
    .venv/bin/python bench/soak.py --seconds 300 --json out.json
    .venv/bin/python bench/soak.py --rate 5000 --cache-bytes 32MiB -o upload.concurrency=4 --keep
    .venv/bin/python bench/soak.py --mountpoint /mnt/store     # soak an existing, empty tierfs mount

tests/test_soak.py runs the same thing for 120 s in CI (`run_soak` on a mount made by the test fixtures).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import crc32c

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
import _common as C  # noqa: E402
import producer as P  # noqa: E402  examples/producer.py: the deterministic message content, MappedFile

from tierfs.store import commitlog as cl  # noqa: E402
from tierfs.store import consumequeue as cq  # noqa: E402
from tierfs.store import indexfile as ix  # noqa: E402
from tierfs.store.javahash import java_string_hash, tags_hash_code  # noqa: E402
from tierfs.store.names import index_file_name, offset_to_name  # noqa: E402

MiB = 1 << 20
CONSUMER = REPO / "examples" / "consumer.py"
UNIT = struct.Struct(">qiq")  # ConsumeQueue unit: commitlog offset, size, tags hash
HEAD = struct.Struct(">ii")  # record TOTALSIZE, MAGIC
TS = struct.Struct(">q")
BORN_TS_AT, STORE_TS_AT = 40, 56  # record offsets of BORNTIMESTAMP and STORETIMESTAMP (IPv4 hosts)
TOPIC_PREFIX = "SoakTopic"
TAGS = ("TagA", "TagB", "TagC")
PROGRESS_EVERY = 1.0  # seconds between the children's progress lines
MAX_FAILURES_KEPT = 20


@dataclass
class SoakParams:
    """Everything a soak run needs besides the mount (the CLI flags of the same names)."""

    seconds: float = 600.0
    interval: float = 10.0
    sample_interval: float = 1.0
    rate: float = 3000.0
    replay_rate: float = 6000.0
    body_min: int = 256
    body_max: int = 2048
    topics: int = 2
    queues: int = 4
    commitlog_size: int = 8 * MiB
    cq_units: int = 20_000
    index_slots: int = 5_000
    index_items: int = 20_000
    flush_ms: int = 500
    cq_flush_ms: int = 1000
    keep_mapped: int = 2
    seed: int = 1
    compactions: int = 2
    compact_timeout: float = 900.0
    drain_timeout: float = 180.0
    check_keys: int = 2000
    final_consumer: bool = True
    fsck: bool = True

    def child_params(self, **over: Any) -> dict:
        """What the writer and readers need to agree on the store's content."""
        keys = ("rate", "replay_rate", "body_min", "body_max", "topics", "queues", "commitlog_size", "cq_units",
                "index_slots", "index_items", "flush_ms", "cq_flush_ms", "keep_mapped", "seed")
        d = {k: getattr(self, k) for k in keys}
        d["seconds"] = 0.0  # run until told to stop
        d.update(over)
        return d


def mount_options(p: SoakParams, cache_bytes: str = "64MiB") -> str:
    """Quick seals, a cache budget far below the data written (so eviction and fetches run all the time), the
    IndexFile geometry the writer uses (the seal rule needs it), and no scheduled compaction (the soak runs it)."""
    return ",".join([
        "tiering.enabled=true", f"cache.max_bytes={cache_bytes}", "cache.block_bytes=256KiB",
        "objectstore.chunk_bytes=4MiB", "seal.quiet_seconds=1", "seal.scan_interval_seconds=2",
        f"broker.max_hash_slot_num={p.index_slots}", f"broker.max_index_num={p.index_items}",
        "delete.grace_seconds=30", "compaction.enabled=false", "spark.master=local[2]"])


# ======================================================================================== message content


class MessageModel:
    """Message `seq`: where it goes (topic, queue, queue offset) and its exact record bytes, given the physical
    offset and the two timestamps (the only fields that depend on when and where it was written). Shared by the
    writer and both readers, so a reader knows every byte the writer must have written."""

    def __init__(self, p: dict):
        self.seed = p["seed"]
        self.ntopics, self.nqueues = p["topics"], p["queues"]
        self.body_min, self.body_max = p["body_min"], p["body_max"]
        if not 16 <= self.body_min <= self.body_max <= P.MAX_BODY:
            raise ValueError(f"need 16 <= body_min <= body_max <= {P.MAX_BODY}")
        self.pool = P.body_pool(self.seed)
        self.topics = P.topic_names(TOPIC_PREFIX, self.ntopics, False)
        born = (b"\x7f\x00\x00\x01", 54321)
        store = (b"\x7f\x00\x00\x01", 10911)
        self.packers = [cl.RecordPacker(t.encode(), 0, 1, born, store) for t in self.topics]
        self.base = [pk.size(0, 0) for pk in self.packers]
        upfx = P.uniq_prefix(self.seed)
        # the 5.x producer's properties: KEYS, UNIQ_KEY, TAGS, WAIT, trailing separator
        self.props_fmt = b"KEYS\x01k-%d\x02UNIQ_KEY\x01" + upfx.encode() + b"%012X\x02TAGS\x01%s\x02WAIT\x01true\x02"
        self.tags = [t.encode() for t in TAGS]
        self.tag_codes = [tags_hash_code(t) for t in TAGS]
        self.key_hashers = []
        for t in self.topics:
            h = java_string_hash(t + "#")
            self.key_hashers.append((P.SuffixHasher(java_string_hash(upfx, h), 16, 3, pad=12).index_hash,
                                     P.SuffixHasher(java_string_hash("k-", h), 10, 3).index_hash))
        self.scratch = bytearray(self.base[0] + 4096 + self.body_max + 512)
        self.scratch_mv = memoryview(self.scratch)

    def place(self, seq: int) -> tuple[int, int, int]:
        """(topic index, queue id, queue offset): round robin over topics, then over each topic's queues."""
        t = self.ntopics
        return seq % t, (seq // t) % self.nqueues, seq // (t * self.nqueues)

    def seq_of(self, ti: int, qi: int, qo: int) -> int:
        return (qo * self.nqueues + qi) * self.ntopics + ti

    def body(self, seq: int) -> bytes:
        return P.expected_body(seq, self.seed, P.body_length(seq, self.body_min, self.body_max), self.pool)

    def props(self, seq: int) -> bytes:
        return self.props_fmt % (seq, seq, self.tags[seq % len(self.tags)])

    def tags_code(self, seq: int) -> int:
        return self.tag_codes[seq % len(self.tag_codes)]

    def size(self, seq: int) -> int:
        return (self.base[seq % self.ntopics] + P.body_length(seq, self.body_min, self.body_max)
                + len(self.props(seq)))

    def record(self, seq: int, phys: int, store_ts: int, born_ts: int) -> memoryview:
        """The record bytes of message `seq` (a view of a scratch buffer, valid until the next call)."""
        ti, qi, qo = self.place(seq)
        body = self.body(seq)
        n = self.packers[ti].pack_into(self.scratch, 0, body, self.props(seq), qi, qo, phys, store_ts, born_ts)
        return self.scratch_mv[:n]

    def index_hashes(self, seq: int) -> tuple[int, int]:
        """Index hashes of the message's UNIQ_KEY and its KEYS token, as the broker computes them."""
        uh, kh = self.key_hashers[seq % self.ntopics]
        return uh(seq), kh(seq)

    def check(self, seq: int, data: bytes | memoryview, phys: int) -> str | None:
        """None when `data` (read at CommitLog offset `phys`) is exactly message seq's record, else what differs."""
        size = self.size(seq)
        if len(data) < size:
            return f"short read: {len(data)} of {size} bytes"
        born_ts = TS.unpack_from(data, BORN_TS_AT)[0]
        store_ts = TS.unpack_from(data, STORE_TS_AT)[0]
        want = self.record(seq, phys, store_ts, born_ts)
        if want == memoryview(data)[:size]:
            return None
        return self.describe(seq, bytes(data[:size]), bytes(want), phys)

    def describe(self, seq: int, got: bytes, want: bytes, phys: int) -> str:
        rec = cl.decode_record(got, 0, check_crc=True)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if rec is None:
            crc_only = cl.decode_record(got, 0) is not None
            why = "BODYCRC does not match the body" if crc_only else "not a valid record"
        elif not isinstance(rec, cl.Message):
            why = "a BLANK where a message belongs"
        elif rec.keys[:1] != [f"k-{seq}"]:
            why = f"message {rec.keys[:1]} where k-{seq} belongs"
        elif rec.body != self.body(seq):
            why = "body differs from the writer's"
        else:
            why = "a header field differs"
        return f"{why} (first differing byte at record offset {first}, CommitLog offset {phys + first})"


def crc_zeros(crc: int, n: int, _zeros: bytes = bytes(MiB)) -> int:
    """crc32c continued over n zero bytes (the unwritten rest of a preallocated file)."""
    mv = memoryview(_zeros)
    while n > 0:
        k = min(n, len(_zeros))
        crc = crc32c.crc32c(mv[:k], crc)
        n -= k
    return crc


# ======================================================================================== child: the writer


class _Segment:
    __slots__ = ("mf", "rel", "crc")

    def __init__(self, mf: P.MappedFile, rel: str):
        self.mf, self.rel, self.crc = mf, rel, 0


class _CqFile:
    __slots__ = ("rel", "fd", "size", "wrote", "flushed", "crc")

    def __init__(self, root: Path, rel: str, size: int):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        self.rel, self.size = rel, size
        # MappedFile's create path (O_RDWR|O_CREAT, ftruncate to the full size); then FileChannel writes
        self.fd = os.open(root / rel, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self.fd, size)
        self.wrote = self.flushed = self.crc = 0


class SoakWriter:
    """The continuous writer. The put loop runs in the main thread; a flush thread msyncs, fdatasyncs, unmaps and
    closes behind it, like the broker's flush services. Every file's crc32c is kept as it is written."""

    def __init__(self, root: Path, p: dict):
        self.root, self.p = root, p
        self.m = MessageModel(p)
        self.cl_size = p["commitlog_size"]
        self.cq_size = p["cq_units"] * cq.UNIT_SIZE
        self.slots, self.items = p["index_slots"], p["index_items"]
        self.stop = threading.Event()
        self.flusher_stop = threading.Event()
        self.lock = threading.Lock()
        self.mapped: list[_Segment] = []  # CommitLog segments still mapped, oldest first
        self.prealloc: P.MappedFile | None = None
        self.cur: _Segment | None = None
        self.cq_open: list[_CqFile] = []  # ConsumeQueue files still open
        self.cq_cur: dict[tuple[int, int], _CqFile] = {}
        self.ix_cur: tuple[P.MappedFile, ix.IndexWriter, str] | None = None
        self.ix_pending: list[P.MappedFile] = []  # rolled IndexFiles waiting for their msync
        self.last_ix_ms = 0
        self.files: dict[str, dict] = {}  # rel -> {size, crc32c, sealed}
        self.errors: list[str] = []
        self.seq = self.nbytes = 0
        self.elapsed = 0.0

    def _done(self, rel: str, size: int, crc: int, sealed: bool) -> None:
        self.files[rel] = {"size": size, "crc32c": crc, "sealed": sealed}

    # ---------------------------------------------------------------- CommitLog
    def _new_segment(self, start: int) -> P.MappedFile:
        return P.MappedFile(self.root / "commitlog" / offset_to_name(start), self.cl_size, start)

    def _roll(self, wpos: int) -> None:
        """END_OF_FILE: a BLANK over the rest of the segment, then the preallocated next one (and queue the one
        after it, like AllocateMappedFileService)."""
        s = self.cur
        start = 0
        if s is not None:
            blank = cl.encode_blank(self.cl_size - wpos)
            s.mf.mm[wpos:wpos + cl.BLANK_SIZE] = blank
            s.crc = crc_zeros(crc32c.crc32c(blank, s.crc), self.cl_size - wpos - cl.BLANK_SIZE)
            s.mf.wrote = self.cl_size
            self._done(s.rel, self.cl_size, s.crc, True)
            start = s.mf.start + self.cl_size
        mf = self.prealloc if self.prealloc is not None and self.prealloc.start == start else self._new_segment(start)
        self.prealloc = self._new_segment(start + self.cl_size)
        self.cur = _Segment(mf, f"commitlog/{offset_to_name(start)}")
        with self.lock:
            self.mapped.append(self.cur)

    # ---------------------------------------------------------------- ConsumeQueue
    def _cq_put(self, ti: int, qi: int, qo: int, phys: int, size: int, tags_code: int) -> None:
        f = self.cq_cur.get((ti, qi))
        if f is None or f.wrote == f.size:
            pos = qo * cq.UNIT_SIZE
            start = pos - pos % self.cq_size
            f = _CqFile(self.root, f"consumequeue/{self.m.topics[ti]}/{qi}/{offset_to_name(start)}", self.cq_size)
            self.cq_cur[(ti, qi)] = f
            with self.lock:
                self.cq_open.append(f)
        unit = cq.encode_unit(phys, size, tags_code)
        os.pwrite(f.fd, unit, f.wrote)
        f.crc = crc32c.crc32c(unit, f.crc)
        f.wrote += cq.UNIT_SIZE
        if f.wrote == f.size:
            self._done(f.rel, f.size, f.crc, True)

    # ---------------------------------------------------------------- IndexFile
    def _index_roll(self) -> ix.IndexWriter:
        now = time.time_ns() // 1_000_000
        while now <= self.last_ix_ms:  # names are creation-time millis: never reuse one
            time.sleep(0.0005)
            now = time.time_ns() // 1_000_000
        self.last_ix_ms = now
        (self.root / "index").mkdir(exist_ok=True)
        name = index_file_name(now)
        mf = P.MappedFile(self.root / "index" / name, ix.index_file_size(self.slots, self.items))
        prev = self.ix_cur
        end_phy = prev[1].header.end_phy_offset if prev else 0
        end_ts = prev[1].header.end_timestamp if prev else 0
        w = ix.IndexWriter(mf.mm, self.slots, self.items, end_phy, end_ts)
        self.ix_cur = (mf, w, f"index/{name}")
        if prev is not None:
            self._index_finish(prev)
            with self.lock:
                self.ix_pending.append(prev[0])
        return w

    def _index_finish(self, cur: tuple[P.MappedFile, ix.IndexWriter, str]) -> None:
        """Header rewrite, then the crc32c of the mapping: taken before the msync that lets tierfs seal it."""
        mf, w, rel = cur
        w.flush_header()
        self._done(rel, mf.size, crc32c.crc32c(mf.mm), w.is_full)

    # ---------------------------------------------------------------- loops
    def run(self) -> None:
        m = self.m
        rate, seconds = self.p["rate"], self.p["seconds"]
        limit = self.p.get("messages", 0)  # stop after this many (0: by time, or when told)
        for d in ("commitlog", "consumequeue", "index"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        flusher = threading.Thread(target=self._flush_loop, name="flush", daemon=True)
        flusher.start()
        cl_size = self.cl_size
        wpos = cl_size  # no segment yet: the first message rolls one in
        iw = None
        t0 = time.monotonic()
        next_progress = t0 + PROGRESS_EVERY
        seq = 0
        try:
            while not self.stop.is_set():
                if seq % 64 == 0:
                    now = time.monotonic()
                    if seconds and now - t0 >= seconds:
                        break
                if limit and seq >= limit:
                    break
                    if now >= next_progress:
                        self.seq = seq
                        self._progress(now - t0)
                        next_progress = now + PROGRESS_EVERY
                    if rate:
                        delay = t0 + seq / rate - now
                        if delay > 0:
                            time.sleep(delay)
                ti, qi, qo = m.place(seq)
                size = m.size(seq)
                if size + cl.BLANK_SIZE > cl_size - wpos:
                    self._roll(wpos)
                    wpos = 0
                seg = self.cur
                phys = seg.mf.start + wpos
                now_ms = time.time_ns() // 1_000_000
                rec = m.record(seq, phys, now_ms, now_ms)
                seg.mf.mm[wpos:wpos + size] = rec
                seg.crc = crc32c.crc32c(rec, seg.crc)
                wpos += size
                seg.mf.wrote = wpos
                # dispatch: ConsumeQueue unit, then the index keys (UNIQ_KEY, then KEYS)
                self._cq_put(ti, qi, qo, phys, size, m.tags_code(seq))
                if iw is None:
                    iw = self._index_roll()
                for h in m.index_hashes(seq):
                    if not iw.put_key(h, phys, now_ms):
                        iw = self._index_roll()
                        iw.put_key(h, phys, now_ms)
                seq += 1
                self.nbytes += size
                if self.errors:
                    break
        finally:
            self.seq = seq
            self.elapsed = time.monotonic() - t0
            self.flusher_stop.set()
            flusher.join()
            self._shutdown(wpos)

    def _progress(self, elapsed: float) -> None:
        print(json.dumps({"progress": {"messages": self.seq, "bytes": self.nbytes, "elapsed_s": round(elapsed, 3),
                                       "sealed_files": sum(f["sealed"] for f in self.files.values()),
                                       "errors": self.errors[:3]}}), flush=True)

    def _flush_loop(self) -> None:
        try:
            next_cl = next_cq = time.monotonic()
            while not self.flusher_stop.wait(0.05):
                now = time.monotonic()
                if now >= next_cl:
                    self._flush_commitlog()
                    next_cl = now + self.p["flush_ms"] / 1000
                if now >= next_cq:
                    self._flush_cq()
                    next_cq = now + self.p["cq_flush_ms"] / 1000
                self._flush_index()
        except Exception as e:  # surfaces in the put loop, which stops
            self.errors.append(f"flush thread: {e!r}")

    def _flush_commitlog(self) -> None:
        with self.lock:
            segs = list(self.mapped)
        for s in segs:
            w = s.mf.wrote
            if s.mf.flushed < w:
                s.mf.msync()
                s.mf.flushed = w
        keep = max(1, self.p["keep_mapped"])
        old = [s for s in segs[:-keep] if s.mf.flushed == s.mf.size]
        if old:
            with self.lock:
                self.mapped = [s for s in self.mapped if s not in old]
            for s in old:
                s.mf.close()

    def _flush_cq(self) -> None:
        with self.lock:
            files = list(self.cq_open)
        for f in files:
            w = f.wrote
            if f.flushed < w:
                os.fdatasync(f.fd)
                f.flushed = w
        full = [f for f in files if f.flushed == f.size]
        if full:
            with self.lock:
                self.cq_open = [f for f in self.cq_open if f not in full]
            for f in full:
                os.close(f.fd)

    def _flush_index(self) -> None:
        with self.lock:
            pending, self.ix_pending = self.ix_pending, []
        for mf in pending:
            mf.msync()
            mf.close()

    def _shutdown(self, wpos: int) -> None:
        """Flush and close everything; the active files' crc32c runs over zeros to their full size."""
        self._flush_commitlog()
        self._flush_cq()
        self._flush_index()
        if self.cur is not None and self.cur.rel not in self.files:
            self._done(self.cur.rel, self.cl_size, crc_zeros(self.cur.crc, self.cl_size - wpos), False)
        for s in self.mapped:
            s.mf.close()
        self.mapped = []
        if self.prealloc is not None:  # the broker destroys queued preallocated files at shutdown
            self.prealloc.close(unlink=True)
        for f in self.cq_open:
            if f.rel not in self.files:
                self._done(f.rel, f.size, crc_zeros(f.crc, f.size - f.wrote), False)
            os.close(f.fd)
        self.cq_open = []
        if self.ix_cur is not None:
            self._index_finish(self.ix_cur)
            self.ix_cur[0].msync()
            self.ix_cur[0].close()

    def summary(self) -> dict:
        el = self.elapsed
        return {"messages": self.seq, "bytes": self.nbytes, "elapsed_s": round(el, 3),
                "msgs_per_s": round(self.seq / el, 1) if el else 0.0,
                "mb_per_s": round(self.nbytes / el / 1e6, 2) if el else 0.0,
                "files": self.files, "errors": self.errors}


# ======================================================================================== child: the readers


class Failures:
    """Verification failures of one reader: a count, and the first few with where and what."""

    def __init__(self, reader: str):
        self.reader = reader
        self.count = 0
        self.first: list[dict] = []

    def add(self, seq: int | None, where: str, what: str) -> None:
        self.count += 1
        if len(self.first) < MAX_FAILURES_KEPT:
            self.first.append({"reader": self.reader, "seq": seq, "where": where, "what": what})


class _Stopper:
    """Reads commands from stdin (the parent): `stop` or `stop N` (N: messages to reach first); EOF means stop."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.target: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            parts = line.split()
            if parts and parts[0] == "stop":
                self.target = int(parts[1]) if len(parts) > 1 else None
                self.stop.set()
        self.stop.set()


class TailReader:
    """Follows every ConsumeQueue right behind the writer and verifies each message its units point at."""

    def __init__(self, root: Path, p: dict):
        self.root, self.m = root, MessageModel(p)
        self.cl_size, self.cq_size = p["commitlog_size"], p["cq_units"] * cq.UNIT_SIZE
        self.queues = [(ti, qi) for ti in range(self.m.ntopics) for qi in range(self.m.nqueues)]
        self.next = dict.fromkeys(self.queues, 0)
        self.last_phys = dict.fromkeys(self.queues, -1)
        self.last_ts = dict.fromkeys(self.queues, 0)
        self.cq_fds: dict[tuple[int, int], tuple[int, int]] = {}  # queue -> (file start, fd)
        self.cl_fds: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.fail = Failures("tail")
        self.read = self.bytes = self.torn = 0
        self.torn_examples: list[dict] = []

    def _cq_fd(self, q: tuple[int, int], start: int) -> int | None:
        have = self.cq_fds.get(q)
        if have and have[0] == start:
            return have[1]
        try:
            fd = os.open(self.root / "consumequeue" / self.m.topics[q[0]] / str(q[1]) / offset_to_name(start),
                         os.O_RDONLY)
        except FileNotFoundError:
            return None
        if have:
            os.close(have[1])
        self.cq_fds[q] = (start, fd)
        return fd

    def _cl_fd(self, start: int) -> int:
        fd = self.cl_fds.get(start)
        if fd is None:
            fd = self.cl_fds[start] = os.open(self.root / "commitlog" / offset_to_name(start), os.O_RDONLY)
            while len(self.cl_fds) > 8:
                os.close(self.cl_fds.popitem(last=False)[1])
        return fd

    def poll(self, q: tuple[int, int]) -> int:
        """Consume what is new in one queue (up to 256 units); returns how many."""
        qo = self.next[q]
        pos = qo * cq.UNIT_SIZE
        start = pos - pos % self.cq_size
        fd = self._cq_fd(q, start)
        if fd is None:
            return 0
        n = min((start + self.cq_size - pos) // cq.UNIT_SIZE, 256)
        data = os.pread(fd, n * cq.UNIT_SIZE, pos - start)
        done = 0
        for i in range(len(data) // cq.UNIT_SIZE):
            unit = UNIT.unpack_from(data, i * cq.UNIT_SIZE)
            if unit[1] <= 0:
                break  # not written yet
            self._consume(q, qo + i, unit, fd, pos - start + i * cq.UNIT_SIZE)
            done += 1
        self.next[q] = qo + done
        return done

    def _consume(self, q: tuple[int, int], qo: int, unit: tuple, fd: int, fpos: int) -> None:
        """Verify the message a unit points at. A unit read while the writer was putting it can be torn (reads and
        writes of a file are not atomic with respect to each other, natively too), so a mismatch is retried with
        the unit read again, a few times over about half a second (a writer may be preempted mid-copy)."""
        seq = self.m.seq_of(q[0], q[1], qo)
        err = self._check(q, seq, unit)
        for delay in (0.0, 0.01, 0.1, 0.5):
            if err is None:
                return
            time.sleep(delay)
            again = UNIT.unpack(os.pread(fd, cq.UNIT_SIZE, fpos))
            if again != unit:
                self.torn += 1  # read while the writer was writing it: use what it holds now
                if len(self.torn_examples) < 5:
                    self.torn_examples.append({"queue": f"{self.m.topics[q[0]]}/{q[1]}", "file_pos": fpos,
                                               "first": unit, "again": again})
                unit = again
            err = self._check(q, seq, unit)
        if err is None:
            return
        self.fail.add(seq, f"{self.m.topics[q[0]]}/{q[1]} queue offset {qo} -> CommitLog {unit[0]}", err)

    def _check(self, q: tuple[int, int], seq: int, unit: tuple) -> str | None:
        phys, size, tags_code = unit
        want = self.m.size(seq)
        if size != want:
            return f"ConsumeQueue unit size {size}, message {seq} is {want} bytes"
        if tags_code != self.m.tags_code(seq):
            return f"ConsumeQueue unit tags hash {tags_code} != {self.m.tags_code(seq)}"
        if phys <= self.last_phys[q]:
            return f"ConsumeQueue unit offset {phys} not past the previous {self.last_phys[q]}"
        start = phys - phys % self.cl_size
        if phys - start + size > self.cl_size:
            return f"record at {phys} ({size} bytes) crosses the segment end"
        try:
            data = os.pread(self._cl_fd(start), size, phys - start)
        except OSError as e:
            return f"read error at CommitLog offset {phys}: {e}"
        err = self.m.check(seq, data, phys)
        if err:
            return err
        ts = TS.unpack_from(data, STORE_TS_AT)[0]
        if ts < self.last_ts[q]:
            return f"STORETIMESTAMP {ts} went backwards (previous {self.last_ts[q]})"
        self.last_ts[q] = ts
        self.last_phys[q] = phys
        self.read += 1
        self.bytes += size
        return None

    def run(self, stopper: _Stopper) -> None:
        next_progress = time.monotonic() + PROGRESS_EVERY
        while True:
            got = sum(self.poll(q) for q in self.queues)
            if stopper.stop.is_set():
                if stopper.target is None or self.read + self.fail.count >= stopper.target:
                    break
            now = time.monotonic()
            if now >= next_progress:
                print(json.dumps({"progress": self.summary()}), flush=True)
                next_progress = now + PROGRESS_EVERY
            if not got:
                time.sleep(0.005)

    def summary(self) -> dict:
        return {"read": self.read, "bytes": self.bytes, "torn_rereads": self.torn, "torn_examples": self.torn_examples,
                "failures": self.fail.count,
                "first_failures": self.fail.first}


class _CqUnits:
    """ConsumeQueue units for the replay reader: 64 KiB preads, each file's pages dropped when first opened in a
    pass (so the reads reach the daemon, and the object store for evicted blocks)."""

    CHUNK = 3276 * cq.UNIT_SIZE

    def __init__(self, root: Path, m: MessageModel, cq_size: int):
        self.root, self.m, self.cq_size = root, m, cq_size
        self.fds: dict[tuple[int, int], tuple[int, int]] = {}
        self.chunks: dict[tuple[int, int], tuple[int, int, bytes]] = {}

    def new_pass(self) -> None:
        for _, fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.chunks.clear()

    def unit(self, ti: int, qi: int, qo: int) -> tuple[int, int, int]:
        q = (ti, qi)
        pos = qo * cq.UNIT_SIZE
        start = pos - pos % self.cq_size
        off = (pos - start) - (pos - start) % self.CHUNK
        have = self.chunks.get(q)
        if have is None or have[0] != start or have[1] != off:
            fd = self._fd(q, start)
            have = self.chunks[q] = (start, off, os.pread(fd, self.CHUNK, off))
        i = pos - start - off
        if i + cq.UNIT_SIZE > len(have[2]):
            raise OSError(f"ConsumeQueue file {start} of {self.m.topics[ti]}/{qi} ends before unit {qo}")
        return UNIT.unpack_from(have[2], i)

    def _fd(self, q: tuple[int, int], start: int) -> int:
        have = self.fds.get(q)
        if have and have[0] == start:
            return have[1]
        path = self.root / "consumequeue" / self.m.topics[q[0]] / str(q[1]) / offset_to_name(start)
        C.evict(path)
        fd = os.open(path, os.O_RDONLY)
        if have:
            os.close(have[1])
        self.fds[q] = (start, fd)
        return fd


class ReplayReader:
    """Passes over every complete CommitLog segment from the first, pages dropped first, verifying every record
    and its ConsumeQueue unit. A segment is complete once the next one holds a record (the writer put the BLANK
    before that), so the active segment is never read half-written."""

    def __init__(self, root: Path, p: dict):
        self.root, self.m = root, MessageModel(p)
        self.cl_size = p["commitlog_size"]
        self.rate = p["replay_rate"]
        self.cqs = _CqUnits(root, self.m, p["cq_units"] * cq.UNIT_SIZE)
        self.fail = Failures("replay")
        self.read = self.bytes = self.passes = self.segments = 0
        self.read_seconds = 0.0
        self.stop = threading.Event()
        self.next_progress = 0.0
        self.t_rate = 0.0
        self.n_rate = 0

    def _complete(self) -> list[int]:
        starts = sorted(int(n) for n in os.listdir(self.root / "commitlog") if n.isdigit())
        out = []
        for a, b in zip(starts, starts[1:]):
            with open(self.root / "commitlog" / offset_to_name(b), "rb") as f:
                head = f.read(8)
            if len(head) < 8 or HEAD.unpack(head)[1] not in (cl.MAGIC_V1, cl.MAGIC_V2):
                break
            out.append(a)
        return out

    def run(self, stopper: _Stopper) -> None:
        self.stop = stopper.stop
        self.next_progress = time.monotonic() + PROGRESS_EVERY
        while not self.stop.is_set():
            try:
                starts = self._complete()
            except FileNotFoundError:
                starts = []
            if not starts:
                time.sleep(0.2)
                self._tick()
                continue
            self.cqs.new_pass()
            self.t_rate, self.n_rate = time.monotonic(), 0
            seq: int | None = 0
            for start in starts:
                if self.stop.is_set():
                    return
                seq = self._segment(start, seq)
            self.passes += 1

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self.next_progress:
            print(json.dumps({"progress": self.summary()}), flush=True)
            self.next_progress = now + PROGRESS_EVERY

    def _read_segment(self, path: Path) -> bytes:
        C.evict(path)
        t = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            parts = []
            for off in range(0, self.cl_size, MiB):
                parts.append(os.pread(fd, min(MiB, self.cl_size - off), off))
        finally:
            os.close(fd)
        self.read_seconds += time.perf_counter() - t
        data = b"".join(parts)
        if len(data) != self.cl_size:
            raise OSError(f"read {len(data)} of {self.cl_size} bytes")
        return data

    def _segment(self, start: int, seq: int | None) -> int | None:
        """Verify one segment whose first message should be `seq` (None: unknown after a failure, taken from the
        record's KEYS). Returns the next segment's first message number, or None after a failure."""
        name = offset_to_name(start)
        try:
            data = self._read_segment(self.root / "commitlog" / name)
        except OSError as e:
            self.fail.add(seq, f"commitlog/{name}", f"read error: {e}")
            return None
        self.segments += 1
        if seq is None:
            rec = cl.decode_record(data, 0)
            seq = P.parse_seq(rec.keys[0]) if isinstance(rec, cl.Message) and rec.keys else None
            if seq is None:
                self.fail.add(None, f"commitlog/{name}@0", "no message k-<seq> at the start of the segment")
                return None
        pos = 0
        mv = memoryview(data)
        while pos + cl.BLANK_SIZE <= self.cl_size:
            total, magic = HEAD.unpack_from(data, pos)
            if magic == cl.BLANK_MAGIC:
                if total != self.cl_size - pos:
                    self.fail.add(seq, f"commitlog/{name}@{pos}", f"BLANK of {total} bytes, {self.cl_size - pos} left")
                    return None
                return seq
            err = self.m.check(seq, mv[pos:], start + pos)
            if err is None:
                ti, qi, qo = self.m.place(seq)
                size = self.m.size(seq)
                try:
                    unit = self.cqs.unit(ti, qi, qo)
                    if unit != (start + pos, size, self.m.tags_code(seq)):
                        err = f"ConsumeQueue {self.m.topics[ti]}/{qi} unit {qo} is {unit}"
                except OSError as e:
                    err = f"ConsumeQueue read error: {e}"
            if err:
                self.fail.add(seq, f"commitlog/{name}@{pos}", err)
                return None
            self.read += 1
            self.bytes += size
            pos += size
            seq += 1
            self._pace()
            if self.stop.is_set():
                return None
        self.fail.add(seq, f"commitlog/{name}", "no BLANK at the end of a complete segment")
        return None

    def _pace(self) -> None:
        self.n_rate += 1
        if self.n_rate % 64 == 0:
            self._tick()
            if self.rate:
                delay = self.t_rate + self.n_rate / self.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)

    def summary(self) -> dict:
        return {"read": self.read, "bytes": self.bytes, "passes": self.passes, "segments": self.segments,
                "segment_read_mb_per_s": round(self.segments * self.cl_size / self.read_seconds / 1e6, 1)
                if self.read_seconds else 0.0,
                "failures": self.fail.count, "first_failures": self.fail.first}


def child_main(role: str, root: str, params: str) -> int:
    p = json.loads(params)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if role == "writer":
        w = SoakWriter(Path(root), p)

        def watch() -> None:
            for line in sys.stdin:
                if line.split()[:1] == ["stop"]:
                    break
            w.stop.set()
        threading.Thread(target=watch, daemon=True).start()
        w.run()
        print(json.dumps({"final": w.summary()}), flush=True)
        return 0
    reader = TailReader(Path(root), p) if role == "tail" else ReplayReader(Path(root), p)
    reader.run(_Stopper())
    print(json.dumps({"final": reader.summary()}), flush=True)
    return 0


# ======================================================================================== parent: orchestration


class Child:
    """One workload process (own session, killed by its pid): JSON lines on stdout, commands on stdin."""

    def __init__(self, role: str, root: Path, params: dict, workdir: Path):
        self.role = role
        self.err_path = workdir / f"{role}.stderr"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([C.PY, str(Path(__file__).resolve()), "--child", role, str(root),
                                          json.dumps(params)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, bufsize=1, start_new_session=True)
        self.progress: dict = {}
        self.final: dict | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if "progress" in msg:
                    self.progress = msg["progress"]
                elif "final" in msg:
                    self.final = msg["final"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def wait_final(self, timeout: float) -> dict:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.role} did not finish within {timeout:.0f} s; {self.stderr_tail()}") from None
        self._reader.join(timeout=10)
        if self.final is None:
            raise RuntimeError(f"{self.role} exited {self.proc.returncode} without a summary; {self.stderr_tail()}")
        return self.final

    def stderr_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return "stderr: " + self.err_path.read_text()[-n:].strip()
        return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class Compactor:
    """`tierfs compact MNT --json` in the background (own session), one at a time; summaries collected."""

    def __init__(self, mnt: Path, workdir: Path, timeout: float):
        self.mnt, self.workdir, self.timeout = mnt, workdir, timeout
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.started_at = 0.0
        self.runs: list[dict] = []

    def start(self, at_s: float) -> bool:
        if self.proc is not None:
            return False
        n = len(self.runs)
        self.out = open(self.workdir / f"compact-{n}.out", "w+")
        self.err = open(self.workdir / f"compact-{n}.err", "w+")
        self.proc = subprocess.Popen([C.PY, "-m", "tierfs", "compact", str(self.mnt), "--json"], stdout=self.out,
                                     stderr=self.err, text=True, cwd="/", start_new_session=True)
        self.started, self.started_at = time.monotonic(), at_s
        return True

    def poll(self, block: bool = False) -> bool:
        """True when a run just finished (its summary is the last of self.runs)."""
        if self.proc is None:
            return False
        if block:
            try:
                self.proc.wait(timeout=max(1.0, self.timeout - (time.monotonic() - self.started)))
            except subprocess.TimeoutExpired:
                self.kill_process()
        elif self.proc.poll() is None:
            if time.monotonic() - self.started > self.timeout:
                self.kill_process()
            return False
        rc = self.proc.wait()
        self.out.seek(0)
        self.err.seek(0)
        text, err = self.out.read(), self.err.read()
        self.out.close()
        self.err.close()
        try:
            summary = json.loads(text)
        except ValueError:
            summary = {"ok": False, "errors": [{"error": f"exit {rc}: {err.strip()[-1000:]}"}]}
        self.runs.append({"at_s": round(self.started_at, 1), "seconds": round(time.monotonic() - self.started, 1),
                          "ok": bool(summary.get("ok")), "applied": summary.get("applied"),
                          "bytes_in": summary.get("bytes_in"), "bytes_out": summary.get("bytes_out"),
                          "note": summary.get("note"), "errors": (summary.get("errors") or [])[:5]})
        self.proc = None
        return True

    def kill_process(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.out.close()
            self.err.close()


ENGINE_KEYS = ("uploads", "upload_bytes", "fetches", "fetch_bytes", "reads_local", "reads_waited", "evicted_bytes",
               "prefetch_bytes", "fetch_errors", "corrupt_objects", "upload_failures")


def read_status(mnt: Path) -> dict:
    return json.loads((mnt / ".tierfs" / "status.json").read_text())


def snapshot(st: dict, children: dict[str, Child]) -> dict:
    t = st["totals"]
    eng = t.get("engine") or {}
    s = {"t": time.monotonic(), "backlog_files": t["upload_backlog_files"], "backlog_bytes": t["upload_backlog_bytes"],
         "backlog_age_s": t["upload_backlog_age_s"], "cache_bytes": t["cache_bytes"]}
    s.update({k: eng.get(k, 0) for k in ENGINE_KEYS})
    s["written"] = children["writer"].progress.get("messages", 0)
    for r in ("tail", "replay"):
        s[r] = children[r].progress.get("read", 0)
        s[r + "_failures"] = children[r].progress.get("failures", 0)
    return s


def hit_ratio(local: int, waited: int) -> float | None:
    return local / (local + waited) if local + waited else None


def interval_row(a: dict, b: dict, t0: float, bl_max: tuple[int, int]) -> dict:
    dt = max(b["t"] - a["t"], 1e-9)
    return {"t_s": round(b["t"] - t0, 1),
            "written_per_s": round((b["written"] - a["written"]) / dt),
            "tail_per_s": round((b["tail"] - a["tail"]) / dt),
            "replay_per_s": round((b["replay"] - a["replay"]) / dt),
            "upload_mb_per_s": round((b["upload_bytes"] - a["upload_bytes"]) / dt / 1e6, 2),
            "fetch_mb_per_s": round((b["fetch_bytes"] - a["fetch_bytes"]) / dt / 1e6, 2),
            "backlog_files_max": bl_max[0], "backlog_mib_max": round(bl_max[1] / MiB, 1),
            "cache_mib": round(b["cache_bytes"] / MiB, 1),
            "hit_ratio": hit_ratio(b["reads_local"] - a["reads_local"], b["reads_waited"] - a["reads_waited"]),
            "failures": b["tail_failures"] + b["replay_failures"]}


ROW_HEADERS = ["t s", "written/s", "tail/s", "replay/s", "up MB/s", "fetch MB/s", "backlog", "bl MiB", "cache MiB",
               "local %", "fail", "compact"]


def row_cells(r: dict) -> list[str]:
    hr = r["hit_ratio"]
    return [f"{r['t_s']:.0f}", str(r["written_per_s"]), str(r["tail_per_s"]), str(r["replay_per_s"]),
            f"{r['upload_mb_per_s']:.1f}", f"{r['fetch_mb_per_s']:.1f}", str(r["backlog_files_max"]),
            f"{r['backlog_mib_max']:.1f}", f"{r['cache_mib']:.1f}", "-" if hr is None else f"{100 * hr:.1f}",
            str(r["failures"]), "yes" if r.get("compacting") else ""]


def format_row(r: dict, widths: list[int]) -> str:
    return "  ".join(c.rjust(w) for c, w in zip(row_cells(r), widths))


def crc_of(path: Path) -> tuple[int, int, float]:
    """(size, crc32c, seconds) of a file read through the mount with its pages dropped first."""
    C.evict(path)
    t = time.perf_counter()
    crc = n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.pread(fd, MiB, n):
            crc = crc32c.crc32c(chunk, crc)
            n += len(chunk)
    finally:
        os.close(fd)
    return n, crc, time.perf_counter() - t


def check_crcs(mnt: Path, files: dict[str, dict], formats: dict[str, str], workers: int = 4) -> dict:
    """Every file the writer made, read back through the mount (pages dropped) by `workers` threads: its size and
    crc32c must be the writer's. Read rates are also given per object format (raw, lz4c, or hot: never tiered)."""
    import concurrent.futures

    t = time.perf_counter()
    bad: list[dict] = []
    per_format: dict[str, dict] = {}

    def one(rel: str) -> tuple[str, tuple[int, int, float] | OSError]:
        try:
            return rel, crc_of(mnt / rel)
        except OSError as e:
            return rel, e

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for rel, got in pool.map(one, sorted(files)):
            ref = files[rel]
            if isinstance(got, OSError):
                bad.append({"path": rel, "error": str(got)})
                continue
            size, crc, secs = got
            fmt = per_format.setdefault(formats.get(rel, "hot"), {"files": 0, "bytes": 0, "file_seconds": 0.0})
            fmt["files"] += 1
            fmt["bytes"] += size
            fmt["file_seconds"] += secs
            if (size, crc) != (ref["size"], ref["crc32c"]):
                bad.append({"path": rel, "size": size, "crc32c": f"{crc:08x}", "writer_size": ref["size"],
                            "writer_crc32c": f"{ref['crc32c']:08x}", "sealed": ref["sealed"]})
    el = time.perf_counter() - t
    nbytes = sum(f["bytes"] for f in per_format.values())
    for f in per_format.values():
        f["mb_per_s_per_reader"] = round(f["bytes"] / f["file_seconds"] / 1e6, 1) if f["file_seconds"] else None
        f["file_seconds"] = round(f["file_seconds"], 1)
    return {"files": len(files), "sealed_files": sum(f["sealed"] for f in files.values()), "bytes": nbytes,
            "seconds": round(el, 1), "mb_per_s": round(nbytes / el / 1e6, 1) if el else 0.0, "readers": workers,
            "per_format": per_format, "mismatches": len(bad), "first_mismatches": bad[:MAX_FAILURES_KEPT]}


def wait_drained(mnt: Path, sealed: list[str], timeout: float) -> dict:
    """Until the upload backlog is empty and every segment the writer completed is tiered."""
    t = time.monotonic()
    left: list[str] = sealed
    st: dict = {}
    while True:
        st = read_status(mnt)
        state = {f["path"]: f["state"] for f in st["files"]}
        left = [p for p in sealed if state.get(p) != "tiered"]
        backlog = st["totals"]["upload_backlog_files"]
        if not left and backlog == 0:
            return {"ok": True, "seconds": round(time.monotonic() - t, 1), "tiered": len(sealed)}
        if time.monotonic() - t > timeout:
            return {"ok": False, "seconds": round(time.monotonic() - t, 1), "backlog_files": backlog,
                    "not_tiered": len(left), "first_not_tiered": [(p, state.get(p)) for p in left[:10]]}
        time.sleep(0.5)


def run_final_consumer(mnt: Path, p: SoakParams, messages: int) -> dict:
    t = time.perf_counter()
    cmd = [C.PY, str(CONSUMER), str(mnt), "--json", "--expect-messages", str(messages), "--check-keys",
           str(p.check_keys), "--index-slots", str(p.index_slots), "--index-items", str(p.index_items)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(600.0, messages / 5000), cwd="/")
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    try:
        out = json.loads(lines[-1])
    except (IndexError, ValueError):
        out = {"ok": False, "error": f"exit {r.returncode}: {r.stderr.strip()[-1000:]}"}
    res = {"ok": bool(out.get("ok")) and r.returncode == 0, "seconds": round(time.perf_counter() - t, 1)}
    res.update({k: out[k] for k in ("messages", "cq_units", "keys_checked", "index_files", "error") if k in out})
    return res


def run_fsck(mnt: Path) -> dict:
    t = time.perf_counter()
    r = subprocess.run([C.PY, "-m", "tierfs", "fsck", str(mnt), "--deep", "--json"], capture_output=True, text=True,
                       timeout=1800, cwd="/")
    try:
        out = json.loads(r.stdout)
    except ValueError:
        return {"ok": False, "exit_code": r.returncode, "error": r.stderr.strip()[-1000:]}
    return {"ok": r.returncode == 0 and bool(out.get("clean")), "exit_code": r.returncode,
            "seconds": round(time.perf_counter() - t, 1), "checked": out.get("checked"),
            "summary": out.get("summary"), "findings": (out.get("findings") or [])[:10], "error": out.get("error")}


def final_checks(mnt: Path, p: SoakParams, writer: dict, sealed: list[str], log: Callable[[str], None]) -> dict:
    """After the writer stopped: the backlog drains, every file reads back with the writer's crc32c, the whole store
    verifies with examples/consumer.py, and fsck --deep finds nothing."""
    log(f"waiting for the upload backlog to drain ({len(sealed)} complete files must be tiered)")
    drain = wait_drained(mnt, sealed, p.drain_timeout)
    log(f"drain: {drain}")
    formats = {f["path"]: f["format"] for f in read_status(mnt)["files"] if f["state"] == "tiered"}
    crcs = check_crcs(mnt, writer["files"], formats)
    log(f"crc32c of {crcs['files']} files through the mount: {crcs['mismatches']} mismatches "
        f"({crcs['bytes'] / 1e6:.0f} MB in {crcs['seconds']} s; {crcs['per_format']})")
    final_consumer = run_final_consumer(mnt, p, writer["messages"]) if p.final_consumer else None
    if final_consumer is not None:
        log(f"examples/consumer.py: {final_consumer}")
    fsck = run_fsck(mnt) if p.fsck else None
    if fsck is not None:
        log(f"fsck --deep: ok={fsck['ok']} {fsck.get('summary')}")
    return {"drain": drain, "crc_check": crcs, "final_consumer": final_consumer, "fsck": fsck}


class Monitor:
    """The soak's view over time: status.json samples, the largest upload backlog, one row per interval."""

    def __init__(self, t0: float, first: dict, out: Any):
        self.t0, self.prev, self.out = t0, first, out
        self.rows: list[dict] = []
        self.peak = {"files": 0, "bytes": 0, "age_s": 0.0, "files_at_s": 0.0, "bytes_at_s": 0.0}
        self.bl_int = (0, 0)  # largest backlog (files, bytes) in the current interval
        self.compacting = False
        self.widths = [max(len(h), 9) for h in ROW_HEADERS]
        print("  ".join(h.rjust(w) for h, w in zip(ROW_HEADERS, self.widths)), file=out, flush=True)

    def sample(self, cur: dict, compacting: bool) -> None:
        at = round(cur["t"] - self.t0, 1)
        if cur["backlog_files"] > self.peak["files"]:
            self.peak.update(files=cur["backlog_files"], files_at_s=at)
        if cur["backlog_bytes"] > self.peak["bytes"]:
            self.peak.update(bytes=cur["backlog_bytes"], bytes_at_s=at)
        self.peak["age_s"] = max(self.peak["age_s"], cur["backlog_age_s"])
        self.bl_int = (max(self.bl_int[0], cur["backlog_files"]), max(self.bl_int[1], cur["backlog_bytes"]))
        self.compacting = self.compacting or compacting

    def row(self, cur: dict, compacting: bool) -> None:
        r = interval_row(self.prev, cur, self.t0, self.bl_int)
        r["compacting"] = self.compacting
        self.rows.append(r)
        print(format_row(r, self.widths), file=self.out, flush=True)
        self.prev, self.bl_int, self.compacting = cur, (0, 0), compacting


def verdict(res: dict, writer: dict) -> list[str]:
    """What makes the soak fail; empty when it passed."""
    problems = []
    n = writer["messages"]
    if res["verification_failures"]:
        problems.append(f"{res['verification_failures']} verification failures")
    if writer["errors"]:
        problems.append(f"writer errors: {writer['errors'][:3]}")
    if res["tail"]["read"] != n:
        problems.append(f"the tail reader verified {res['tail']['read']} of {n} messages")
    if not res["replay"]["read"]:
        problems.append("the replay reader verified nothing")
    if not res["drain"]["ok"]:
        problems.append("the upload backlog did not drain")
    if res["crc_check"]["mismatches"]:
        problems.append(f"{res['crc_check']['mismatches']} files differ from what the writer wrote")
    fc, fk, eng = res["final_consumer"], res["fsck"], res["engine"]
    if fc is not None and not fc["ok"]:
        problems.append(f"examples/consumer.py failed: {fc.get('error')}")
    if fk is not None and not fk["ok"]:
        problems.append("fsck found problems")
    if eng.get("fetch_errors") or eng.get("corrupt_objects"):
        problems.append(f"engine errors: fetch {eng.get('fetch_errors')}, corrupt {eng.get('corrupt_objects')}")
    bad = [r for r in res["compactions"] if not r["ok"]]
    if bad:
        problems.append(f"{len(bad)} compaction runs failed")
    return problems


def run_soak(mnt: Path, p: SoakParams, log: Callable[[str], None] = C.log, workdir: Path | None = None,
             out: Any = None) -> dict:
    """The soak on an existing, empty tierfs mount (made with mount_options(p) or equivalent). Prints the
    throughput lines to `out` (default stdout) and returns everything measured; result["ok"] says if it passed."""
    out = out or sys.stdout
    mnt = Path(mnt).resolve()
    if (mnt / "commitlog").exists():
        raise SystemExit(f"{mnt} already holds a store (commitlog/); the soak needs an empty mount")
    made_workdir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tierfs-soak-")) if workdir is None else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    children: dict[str, Child] = {}
    comp = Compactor(mnt, workdir, p.compact_timeout)
    res: dict[str, Any] = {"params": asdict(p), "mountpoint": str(mnt)}
    try:
        cp = p.child_params()
        children["writer"] = Child("writer", mnt, cp, workdir)
        children["tail"] = Child("tail", mnt, cp, workdir)
        children["replay"] = Child("replay", mnt, cp, workdir)
        t0 = time.monotonic()
        log(f"soak started on {mnt} for {p.seconds:.0f} s (writer {p.rate:g} msg/s, replay {p.replay_rate:g} msg/s, "
            f"{p.compactions} compactions)")
        due = [t0 + p.seconds * (i + 1) / (p.compactions + 1) for i in range(p.compactions)]
        first = snapshot(read_status(mnt), children)
        mon = Monitor(t0, first, out)
        next_row = t0 + p.interval
        while (now := time.monotonic()) < t0 + p.seconds:
            for ch in children.values():
                if not ch.alive():
                    raise RuntimeError(f"the {ch.role} exited early ({ch.proc.returncode}); {ch.stderr_tail()}")
            cur = snapshot(read_status(mnt), children)
            if comp.poll():
                r = comp.runs[-1]
                log(f"compaction {len(comp.runs)} finished after {r['seconds']} s: ok={r['ok']}, applied {r['applied']}")
            if due and now >= due[0] and comp.proc is None:  # one due while another runs starts after it
                late = now - due.pop(0)
                comp.start(now - t0)
                log(f"compaction {len(comp.runs) + 1} started at {now - t0:.0f} s"
                    + (f" ({late:.0f} s late: the previous one was still running)" if late > 5 else ""))
            mon.sample(cur, comp.proc is not None)
            if now >= next_row:
                mon.row(cur, comp.proc is not None)
                next_row += p.interval
            time.sleep(max(0.0, min(p.sample_interval, t0 + p.seconds - time.monotonic())))
        ran = time.monotonic() - t0
        # ---- stop the writer, let the readers finish
        children["writer"].send("stop")
        wfinal = children["writer"].wait_final(120)
        n = wfinal["messages"]
        log(f"writer stopped: {n} messages, {wfinal['bytes'] / 1e6:.0f} MB, {len(wfinal['files'])} files")
        children["replay"].send("stop")
        children["tail"].send(f"stop {n}")
        tfinal = children["tail"].wait_final(max(120.0, n / 2000))
        rfinal = children["replay"].wait_final(120)
        last = snapshot(read_status(mnt), children)
        if comp.proc is not None:
            log("waiting for the running compaction")
            comp.poll(block=True)
            log(f"compaction {len(comp.runs)} finished after {comp.runs[-1]['seconds']} s: ok={comp.runs[-1]['ok']}")
        # ---- drain, then nothing lost
        sealed = sorted(r for r, f in wfinal["files"].items() if f["sealed"])
        res.update(final_checks(mnt, p, wfinal, sealed, log))
        st = read_status(mnt)
        eng = st["totals"].get("engine") or {}
        failures = tfinal["failures"] + rfinal["failures"]
        res.update({
            "seconds_run": round(ran, 1),
            "written": {k: wfinal[k] for k in ("messages", "bytes", "elapsed_s", "msgs_per_s", "mb_per_s", "errors")},
            "files": {"total": len(wfinal["files"]), "sealed": len(sealed)},
            "tail": tfinal, "replay": rfinal,
            "verification_failures": failures,
            "failures": (tfinal["first_failures"] + rfinal["first_failures"])[:MAX_FAILURES_KEPT],
            "series": mon.rows,
            "max_backlog": mon.peak,
            "cache_hit_ratio": hit_ratio(eng.get("reads_local", 0), eng.get("reads_waited", 0)),
            "cache_hit_ratio_during_soak": hit_ratio(last["reads_local"] - first["reads_local"],
                                                     last["reads_waited"] - first["reads_waited"]),
            "engine": {k: eng.get(k) for k in ENGINE_KEYS},
            "compactions": comp.runs, "compactions_not_started": len(due),
        })
        problems = verdict(res, wfinal)
        res["problems"] = problems
        res["ok"] = not problems
        return res
    finally:
        for ch in children.values():
            ch.kill()
        comp.kill()
        if made_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


# ======================================================================================== baseline and report


def writer_baseline(root: Path, p: SoakParams, seconds: float, workdir: Path) -> dict:
    """The soak writer alone, unthrottled, for `seconds` into `root` (native dir or a fresh mount)."""
    ch = Child("writer", root, p.child_params(rate=0, seconds=seconds), workdir)
    try:
        f = ch.wait_final(seconds + 120)
    finally:
        ch.kill()
    if f["errors"]:
        raise RuntimeError(f"baseline writer failed: {f['errors']}")
    return {k: f[k] for k in ("messages", "bytes", "elapsed_s", "msgs_per_s", "mb_per_s")}


def measure_baseline(base: Path, p: SoakParams, options: list[str], seconds: float, repeat: int,
                     workdir: Path) -> dict:
    """The writer unthrottled on the native filesystem and through a fresh mount (same options as the soak's, same
    filesystem as its hot dir), `repeat` alternating pairs; the ratio is the median of the paired ratios, which a
    busy shared host disturbs less than either figure alone."""
    pairs = []
    for i in range(repeat):
        pair = {}
        for side in ("native", "mount") if i % 2 == 0 else ("mount", "native"):
            if side == "native":
                root = base / f"native{i}"
                root.mkdir()
                pair["native"] = writer_baseline(root, p, seconds, workdir)
                shutil.rmtree(root, ignore_errors=True)
            else:
                with C.TierfsMount(base / f"bhot{i}", base / f"bmnt{i}", options) as bm:
                    pair["mount"] = writer_baseline(bm.mnt, p, seconds, workdir)
                shutil.rmtree(base / f"bhot{i}", ignore_errors=True)
            C.log(f"baseline {i + 1}/{repeat} {side}: {pair[side]['msgs_per_s']:,.0f} msg/s "
                  f"({pair[side]['mb_per_s']:.1f} MB/s)")
        pair["ratio"] = round(pair["mount"]["msgs_per_s"] / pair["native"]["msgs_per_s"], 3)
        pairs.append(pair)
    med = {side: {k: round(C.median(pr[side][k] for pr in pairs), 1) for k in ("msgs_per_s", "mb_per_s")}
           for side in ("native", "mount")}
    ratios = [pr["ratio"] for pr in pairs]
    return {"seconds": seconds, "repeat": repeat, "native": med["native"], "mount": med["mount"],
            "ratio": round(C.median(ratios), 3), "ratio_min": min(ratios), "ratio_max": max(ratios), "pairs": pairs}


def print_summary(res: dict, out: Any = None) -> None:
    out = out or sys.stdout
    w = res["written"]
    p = res["params"]
    print(file=out)
    print(f"tierfs soak: {res['seconds_run']:.0f} s, target {p['rate']:g} msg/s, bodies {p['body_min']}-"
          f"{p['body_max']} B, {p['topics']} topics x {p['queues']} queues, CommitLog {p['commitlog_size'] >> 20} MiB"
          f" segments; {'PASS' if res['ok'] else 'FAIL: ' + '; '.join(res['problems'])}", file=out)
    hr, hrs = res["cache_hit_ratio"], res["cache_hit_ratio_during_soak"]
    mb = res["max_backlog"]
    rows = [
        ["written", f"{w['messages']:,} messages, {w['bytes'] / 1e6:,.0f} MB ({w['msgs_per_s']:,.0f} msg/s, "
                    f"{w['mb_per_s']:.1f} MB/s), {res['files']['total']} files ({res['files']['sealed']} complete)"],
        ["tail reader", f"{res['tail']['read']:,} verified, {res['tail']['failures']} failures, "
                        f"{res['tail']['torn_rereads']} torn-unit re-reads"],
        ["replay reader", f"{res['replay']['read']:,} verified in {res['replay']['passes']} passes "
                          f"({res['replay']['segments']} segments read, "
                          f"{res['replay']['segment_read_mb_per_s']} MB/s), {res['replay']['failures']} failures"],
        ["largest backlog", f"{mb['files']} files at {mb['files_at_s']} s, {mb['bytes'] / MiB:.1f} MiB at "
                            f"{mb['bytes_at_s']} s, oldest {mb['age_s']} s"],
        ["cache hit ratio", f"{'-' if hr is None else f'{100 * hr:.1f} %'} (during the soak "
                            f"{'-' if hrs is None else f'{100 * hrs:.1f} %'}): reads_local {res['engine']['reads_local']:,}"
                            f", reads_waited {res['engine']['reads_waited']:,}"],
        ["transfers", f"uploaded {res['engine']['uploads']} segments {res['engine']['upload_bytes'] / 1e6:,.0f} MB, "
                      f"fetched {res['engine']['fetches']} ranges {res['engine']['fetch_bytes'] / 1e6:,.0f} MB, evicted "
                      f"{res['engine']['evicted_bytes'] / 1e6:,.0f} MB; errors: fetch {res['engine']['fetch_errors']}, "
                      f"corrupt {res['engine']['corrupt_objects']}, upload {res['engine']['upload_failures']}"],
    ]
    for c in res["compactions"]:
        rows.append(["compaction", f"at {c['at_s']} s, {c['seconds']} s, ok={c['ok']}, applied {c['applied']}"
                     + (f", {c['note']}" if c.get("note") else "") + (f", errors {c['errors']}" if c["errors"] else "")])
    d = res["drain"]
    rows.append(["drain", f"{'ok' if d['ok'] else 'NOT drained'} in {d['seconds']} s"])
    cc = res["crc_check"]
    rates = ", ".join(f"{k} {v['mb_per_s_per_reader']} MB/s" for k, v in sorted(cc["per_format"].items()))
    rows.append(["crc32c check", f"{cc['files']} files ({cc['sealed_files']} complete), {cc['bytes'] / 1e6:,.0f} MB "
                                 f"in {cc['seconds']} s by {cc['readers']} readers (each: {rates}): "
                                 f"{cc['mismatches']} mismatches"])
    if res["final_consumer"]:
        fc = res["final_consumer"]
        rows.append(["consumer.py", f"ok={fc['ok']}, {fc.get('messages', '?'):,} messages, "
                                    f"{fc.get('keys_checked', '?')} keys, {fc['seconds']} s"
                     + (f", {fc['error']}" if fc.get("error") else "")])
    if res["fsck"]:
        fk = res["fsck"]
        rows.append(["fsck --deep", f"ok={fk['ok']}, {fk.get('seconds', '?')} s, {fk.get('summary')}"])
    if res.get("baseline"):
        b = res["baseline"]
        rows.append(["writer baseline", f"unthrottled, {b['repeat']} x {b['seconds']:g} s: native "
                                        f"{b['native']['msgs_per_s']:,.0f} msg/s ({b['native']['mb_per_s']:.1f} MB/s), "
                                        f"mount {b['mount']['msgs_per_s']:,.0f} msg/s ({b['mount']['mb_per_s']:.1f} "
                                        f"MB/s): mount/native {b['ratio']:.2f} (pairs {b['ratio_min']:.2f}-"
                                        f"{b['ratio_max']:.2f})"])
    width = max(len(r[0]) for r in rows)
    for label, text in rows:
        print(f"  {label:<{width}}  {text}", file=out)
    for f in res["failures"][:10]:
        print(f"  failure: {f}", file=out)


# ======================================================================================== CLI


def parse_args(argv: list[str]) -> argparse.Namespace:
    d = SoakParams()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=d.seconds, help="soak duration (default 600)")
    ap.add_argument("--interval", type=float, default=d.interval, help="a throughput line every N seconds")
    ap.add_argument("--sample-interval", type=float, default=d.sample_interval,
                    help="status.json poll period (the largest backlog is taken over these samples)")
    ap.add_argument("--rate", type=float, default=d.rate, help="messages/s written (0: as fast as possible)")
    ap.add_argument("--replay-rate", type=float, default=d.replay_rate, help="messages/s the replay reader verifies "
                    "(0: unlimited)")
    ap.add_argument("--body-min", type=int, default=d.body_min)
    ap.add_argument("--body-max", type=int, default=d.body_max)
    ap.add_argument("--topics", type=int, default=d.topics)
    ap.add_argument("--queues", type=int, default=d.queues, help="queues per topic")
    ap.add_argument("--commitlog-size", type=int, default=d.commitlog_size, help="CommitLog segment bytes")
    ap.add_argument("--cq-units", type=int, default=d.cq_units, help="units per ConsumeQueue file")
    ap.add_argument("--index-slots", type=int, default=d.index_slots, help="IndexFile maxHashSlotNum")
    ap.add_argument("--index-items", type=int, default=d.index_items, help="IndexFile maxIndexNum")
    ap.add_argument("--flush-ms", type=int, default=d.flush_ms, help="CommitLog msync period")
    ap.add_argument("--cq-flush-ms", type=int, default=d.cq_flush_ms, help="ConsumeQueue fdatasync period")
    ap.add_argument("--keep-mapped", type=int, default=d.keep_mapped, help="CommitLog segments kept mapped")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--compactions", type=int, default=d.compactions, help="`tierfs compact` runs, evenly spaced")
    ap.add_argument("--compact-timeout", type=float, default=d.compact_timeout)
    ap.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    ap.add_argument("--check-keys", type=int, default=d.check_keys, help="keys examples/consumer.py looks up")
    ap.add_argument("--no-final-consumer", action="store_true", help="skip the examples/consumer.py pass")
    ap.add_argument("--no-fsck", action="store_true", help="skip `tierfs fsck --deep`")
    ap.add_argument("--baseline-seconds", type=float, default=10.0,
                    help="unthrottled writer on native and on a fresh mount before the soak (0: skip)")
    ap.add_argument("--baseline-repeat", type=int, default=2, help="alternating native/mount baseline pairs")
    ap.add_argument("--cache-bytes", default="64MiB", help="cache.max_bytes of the soak mount")
    ap.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE[,...]",
                    help="extra `tierfs mount -o` options (after the soak's own, so they win)")
    ap.add_argument("--mountpoint", help="soak this existing, empty tierfs mount instead of mounting one "
                    "(no mount-side baseline)")
    ap.add_argument("--dir", help="base dir for the temp native/hot/mountpoint dirs (default $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (debugging)")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="also write machine-readable results (to FILE, or stdout when no FILE)")
    ap.add_argument("--child", nargs=3, metavar=("ROLE", "ROOT", "PARAMS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return a
    checks = [
        (a.seconds > 0 and a.interval > 0 and a.sample_interval > 0, "--seconds, --interval and --sample-interval "
         "must be > 0"),
        (a.rate >= 0 and a.replay_rate >= 0, "--rate and --replay-rate must be >= 0 (0: unlimited)"),
        (16 <= a.body_min <= a.body_max <= P.MAX_BODY, f"need 16 <= --body-min <= --body-max <= {P.MAX_BODY} (a body "
         "starts with its 16-byte (seq, seed) header)"),
        (a.topics >= 1 and a.queues >= 1 and a.cq_units >= 1, "--topics, --queues and --cq-units must be >= 1"),
        (a.commitlog_size >= 4 * (a.body_max + 1024), f"--commitlog-size {a.commitlog_size} is too small for bodies "
         f"of up to {a.body_max} bytes; use at least {4 * (a.body_max + 1024)}"),
        (a.index_slots >= 1 and a.index_items >= 2, "need --index-slots >= 1 and --index-items >= 2"),
        (a.keep_mapped >= 1, "--keep-mapped must be >= 1 (the active segment)"),
        (a.compactions >= 0 and a.baseline_seconds >= 0 and a.baseline_repeat >= 1,
         "need --compactions >= 0, --baseline-seconds >= 0 and --baseline-repeat >= 1"),
        (a.check_keys >= -1, "--check-keys: -1 (all), 0 (none) or a count"),
    ]
    for ok, msg in checks:
        if not ok:
            ap.error(msg)
    return a


def params_from(args: argparse.Namespace) -> SoakParams:
    p = SoakParams()
    for f in fields(SoakParams):
        if hasattr(args, f.name):
            setattr(p, f.name, getattr(args, f.name))
    p.final_consumer = not args.no_final_consumer
    p.fsck = not args.no_fsck
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child_main(*args.child)
    C.install_signal_handlers()
    p = params_from(args)
    options = [mount_options(p, args.cache_bytes), *args.options]
    with C.temp_base(args.dir, prefix="tierfs-soak-", keep=args.keep) as base:
        workdir = base / "work"
        workdir.mkdir()
        baseline = None
        if args.baseline_seconds > 0 and not args.mountpoint:
            baseline = measure_baseline(base, p, options, args.baseline_seconds, args.baseline_repeat, workdir)
        if args.mountpoint:
            res = run_soak(Path(args.mountpoint), p, workdir=workdir)
        else:
            with C.TierfsMount(base / "hot", base / "mnt", options) as m:
                C.log(f"mounted {m.hot} at {m.mnt} (daemon pid {m.pid})")
                res = run_soak(m.mnt, p, workdir=workdir)
                res["daemon_cpu_s"] = round(C.daemon_cpu_seconds(m.pid), 1)
        res["baseline"] = baseline
        res["mount_options"] = options
        res["loadavg_at_end"] = os.getloadavg()
    print_summary(res)
    if args.json:
        text = json.dumps(res, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            C.log(f"wrote {args.json}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
