#!/usr/bin/env python3
"""Synthetic RocketMQ producer: writes a broker store with the broker's own file-system behaviour.

Usage: ``python examples/producer.py STORE_DIR [options]`` (``--help`` lists them).

It is a load generator for tierfs that needs no JVM. Every file is written the way the store engine
writes it (format doc §3, §5, §8, §10, §17), so a FUSE mount sees the real syscall pattern:

* CommitLog segments: ``open(O_RDWR|O_CREAT)`` + ``ftruncate(size)`` + ``mmap(MAP_SHARED)``, records put
  into the mapping, the 8-byte BLANK at a roll, the next-next segment preallocated (full-size, sparse),
  and a flush thread that msyncs one segment per tick (``FlushRealTimeService``), so segment N is
  msynced after N+1 already holds data.
* ConsumeQueues: mmap puts (4.9 / <=5.3.0) or one 20-byte ``pwrite`` per message and ``fdatasync``
  (5.3.1+ ``putConsumeQueueDataByFileChannel``), flushed by a ``FlushConsumeQueueService``-like thread.
* IndexFiles: mmap, hash-slot chains, roll to a new time-named file when full, then a one-off thread
  rewrites the previous header and msyncs it; 5.x also flushes every index file at shutdown.
* ``checkpoint`` (4096-B mmap + msync), ``lock`` (``F_SETLK`` byte 0 len 1, "lock" + fsync),
  ``abort`` (``O_EXCL`` at start, unlinked at clean exit), ``config/*.json`` persisted 4.9- or 5.x-style.

Messages are deterministic from ``--seed``: message number *seq* has ``KEYS = k-<seq>`` (plus
``k-<seq>-<j>`` extras), a ``UNIQ_KEY``, a tag, and a body starting with ``(seq, seed)`` followed by
bytes from a seeded pool, so ``examples/consumer.py`` can verify everything. SIGTERM/SIGINT flush and
exit cleanly; a clean exit prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import mmap
import os
import random
import signal
import struct
import sys
import threading
import time
import zlib
from pathlib import Path

try:
    import tierfs.store  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierfs.store import checkpoint as ckpt
from tierfs.store import commitlog as cl
from tierfs.store import consumequeue as cq
from tierfs.store import indexfile as ix
from tierfs.store.javahash import index_hash_of, java_string_hash, tags_hash_code
from tierfs.store.names import index_file_name, offset_to_name

OS_PAGE_SIZE = 4096
MS_SYNC = getattr(mmap, "MS_SYNC", 4)  # Linux value; the mmap module does not export it
MAX_BODY = 4 * 1024 * 1024  # broker maxMessageSize default
POOL_SPAN = 1 << 20
BODY_HEADER = struct.Struct(">QQ")  # (seq, seed) at the start of every body
UNIQ_PREFIX_LEN = 20  # MessageClientIDSetter: 20 hex fixed prefix + 12 hex time/counter

_libc = ctypes.CDLL(None, use_errno=True)
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.restype = ctypes.c_int


# --- deterministic message content (shared with consumer.py) --------------------------------------

def body_pool(seed: int) -> bytes:
    """Seeded random bytes every body is cut from."""
    return random.Random(seed).randbytes(POOL_SPAN + MAX_BODY)


def body_length(seq: int, body_min: int, body_max: int) -> int:
    if body_min == body_max:
        return body_min
    return body_min + ((seq * 0x9E3779B1) >> 7) % (body_max - body_min + 1)


def expected_body(seq: int, seed: int, length: int, pool: bytes | memoryview) -> bytes:
    """Body of message *seq*: ``(seq, seed)`` big-endian then pool bytes, cut to *length*."""
    head = BODY_HEADER.pack(seq, seed)
    if length <= len(head):
        return head[:length]
    off = (seq * 2654435761) % POOL_SPAN
    return head + bytes(pool[off:off + length - len(head)])


def uniq_prefix(seed: int) -> str:
    return f"{(seed * 0x9E3779B97F4A7C15) & ((1 << 80) - 1):020X}"


def uniq_key(seed: int, seq: int) -> str:
    return f"{uniq_prefix(seed)}{seq:012X}"


def message_keys(seq: int, keys_per_msg: int) -> list[str]:
    return [f"k-{seq}"] + [f"k-{seq}-{j}" for j in range(1, keys_per_msg)]


def parse_seq(key: str) -> int | None:
    """Inverse of the first key: ``k-<seq>`` -> seq."""
    if key.startswith("k-") and key[2:].isdigit():
        return int(key[2:])
    return None


# --- MappedFile ---------------------------------------------------------------------------------

class MappedFile:
    """One segment held open and mapped for its whole life, like ``DefaultMappedFile``."""

    __slots__ = ("path", "size", "start", "fd", "mm", "_anchor", "addr", "wrote", "flushed",
                 "store_ts", "filechannel")

    def __init__(self, path: Path, size: int, start: int = 0) -> None:
        self.path = path
        self.size = size
        self.start = start
        # RandomAccessFile("rw") -> open(O_RDWR|O_CREAT, 0666); FileChannel.map -> ftruncate if short, mmap.
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # The raw address lets flush threads call msync(2) through ctypes, which releases the GIL
        # (mmap.flush() holds it), so flushes really overlap with appends as in the broker.
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)
        self.wrote = 0
        self.flushed = 0
        self.store_ts = 0
        self.filechannel = False  # set once FileChannel writes happened -> force() is fdatasync

    @property
    def full(self) -> bool:
        return self.wrote == self.size

    def msync(self) -> None:
        """``MappedByteBuffer.force()``: msync(MS_SYNC) over the whole mapping."""
        if _libc.msync(self.addr, self.size, MS_SYNC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"msync {self.path}: {os.strerror(err)}")

    def force(self) -> None:
        """``DefaultMappedFile.flush`` body: fdatasync after FileChannel writes, msync otherwise."""
        if self.filechannel:
            os.fdatasync(self.fd)
        else:
            self.msync()

    def flush(self, least_pages: int) -> int:
        """``DefaultMappedFile.flush(flushLeastPages)``; returns the flushed position."""
        write = self.wrote
        flush = self.flushed
        if self.wrote == self.size:
            able = True
        elif least_pages > 0:
            able = write // OS_PAGE_SIZE - flush // OS_PAGE_SIZE >= least_pages
        else:
            able = write > flush
        if able:
            self.force()
            self.flushed = write
        return self.flushed

    def close(self, unlink: bool = False) -> None:
        """munmap + close (+ unlink): the destroy order of ``ReferenceResource``."""
        del self._anchor
        self.mm.close()
        os.close(self.fd)
        if unlink:
            os.unlink(self.path)


class MappedFileQueue:
    """Files of one log in offset order plus ``flushedWhere`` (``MappedFileQueue``)."""

    def __init__(self) -> None:
        self.files: list[MappedFile] = []
        self.flushed_where = 0
        self.store_timestamp = 0
        self.lock = threading.Lock()  # serialises flushes from the periodic thread and shutdown

    def find(self, offset: int, first_if_missing: bool) -> MappedFile | None:
        files = self.files
        if not files:
            return None
        first = files[0]
        idx = (offset - first.start) // first.size
        if 0 <= idx < len(files) and files[idx].start <= offset < files[idx].start + files[idx].size:
            return files[idx]
        return first if first_if_missing else None

    def flush(self, least_pages: int) -> bool:
        """Force the one file containing ``flushedWhere``; True when nothing moved (Java's ``result``)."""
        with self.lock:
            f = self.find(self.flushed_where, self.flushed_where == 0)
            if f is None:
                return True
            ts = f.store_ts
            where = f.start + f.flush(least_pages)
            result = where == self.flushed_where
            self.flushed_where = where
            if least_pages == 0:
                self.store_timestamp = ts
            return result


class ConsumeQueueWriter:
    """One ``consumequeue/<topic>/<qid>`` log."""

    __slots__ = ("dir", "file_size", "filechannel", "mfq", "cur", "next_offset")

    def __init__(self, root: Path, topic: str, qid: int, file_size: int, filechannel: bool) -> None:
        self.dir = root / "consumequeue" / topic / str(qid)
        self.file_size = file_size
        self.filechannel = filechannel
        self.mfq = MappedFileQueue()
        self.cur: MappedFile | None = None
        self.next_offset = 0  # next queue offset (entry number)

    def put(self, phys: int, size: int, tags_code: int) -> None:
        cur = self.cur
        if cur is None or cur.wrote == cur.size:
            cur = self._new_file()
        unit = cq.encode_unit(phys, size, tags_code)
        pos = cur.wrote
        if self.filechannel:
            os.pwrite(cur.fd, unit, pos)  # appendMessageUsingFileChannel: position(p) + write(20 B)
            cur.filechannel = True
        else:
            cur.mm[pos:pos + cq.UNIT_SIZE] = unit
        cur.wrote = pos + cq.UNIT_SIZE
        self.next_offset += 1

    def _new_file(self) -> MappedFile:
        start = self.next_offset * cq.UNIT_SIZE
        start -= start % self.file_size
        if not self.mfq.files:
            self.dir.mkdir(parents=True, exist_ok=True)
        f = MappedFile(self.dir / offset_to_name(start), self.file_size, start)
        self.mfq.files.append(f)
        self.cur = f
        return f


class SuffixHasher:
    """``String.hashCode`` of ``prefix + fmt(seq)`` in O(1) per call on the hot path.

    ``fmt(seq)`` is split as ``fmt(seq // base) + last digits``; the hash of the high part is cached
    (it changes once per *base* messages) and the low digits come from a table:
    ``h(p + hi + lo) = h(p + hi) * 31**len(lo) + h(lo)`` (mod 2**32). Exact for any seq >= 0.
    """

    def __init__(self, prefix_hash: int, radix: int, width: int, pad: int = 0) -> None:
        self.prefix_hash = prefix_hash
        self.radix = radix  # 10 for "k-%d", 16 for "%012X"
        self.pad = pad  # zero-padded total width (12 for UNIQ_KEY), 0 for plain decimal
        self.width = width  # digits served from the table
        self.base = radix ** width
        fmt = "%0{}d".format(width) if radix == 10 else "%0{}X".format(width)
        self.low = [java_string_hash(fmt % i) for i in range(self.base)]
        self.mul = pow(31, width, 1 << 32)
        self.hi_key = -1
        self.hi_hash = 0

    def _text(self, value: int, width: int) -> str:
        if self.radix == 10:
            return "%0*d" % (width, value) if width else "%d" % value
        return "%0*X" % (width, value)

    def __call__(self, seq: int) -> int:
        if seq < self.base and not self.pad:
            return java_string_hash(self._text(seq, 0), self.prefix_hash)
        hi, lo = divmod(seq, self.base)
        if hi != self.hi_key:
            head = self._text(hi, max(self.pad - self.width, 0)) if (hi or self.pad) else ""
            self.hi_key = hi
            self.hi_hash = java_string_hash(head, self.prefix_hash)
        h = (self.hi_hash * self.mul + self.low[lo]) & 0xFFFFFFFF
        return h - 0x100000000 if h & 0x80000000 else h

    def index_hash(self, seq: int) -> int:
        """:func:`index_hash_of` of :meth:`__call__` (``Math.abs``; ``Integer.MIN_VALUE`` -> 0)."""
        return index_hash_of(self(seq))


class IndexFileWriter:
    """An index file: its mapping plus the ``IndexFile`` write logic over that mapping."""

    __slots__ = ("mf", "writer")

    def __init__(self, mf: MappedFile, writer: ix.IndexWriter) -> None:
        self.mf = mf
        self.writer = writer


# --- the producer -------------------------------------------------------------------------------

class Producer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.root = Path(args.store_dir)
        self.version = args.broker_version
        self.cl_size = args.commitlog_size
        self.cq_size = cq.round_cq_file_size(args.cq_size)
        self.filechannel = args.cq_mode == "filechannel"
        self.stop_requested = False
        self.stop_event = threading.Event()
        self.cp = ckpt.Checkpoint()
        self.cp_lock = threading.Lock()
        self.cp_file: MappedFile | None = None
        self.lock_fd: int | None = None
        self.clq = MappedFileQueue()
        self.prealloc: list[MappedFile] = []  # queued preallocated commitlog files (not yet handed out)
        self.queues: dict[tuple[int, int], ConsumeQueueWriter] = {}
        self.index_files: list[IndexFileWriter] = []
        self.index_threads: list[threading.Thread] = []
        self.last_index_ms = 0
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.config_dir = self.root / "config"
        self.topic_names = topic_names(args.topic_prefix, args.topics, args.long_topics)
        self._cq_last_thorough = 0.0
        self.elapsed = 0.0
        self.count = 0
        self.bytes = 0
        self.body_bytes = 0

    # ---- small files ----
    def _write_file(self, path: Path, data: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # FileWriter
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)

    @staticmethod
    def _read_file(path: Path) -> str | None:
        try:
            return path.read_text()
        except FileNotFoundError:
            return None

    def string2file(self, path: Path, data: str) -> None:
        """``MixAll.string2File``: 4.9 = .tmp + .bak + unlink + rename; 5.x = .bak + in-place overwrite."""
        path.parent.mkdir(parents=True, exist_ok=True)
        bak = path.with_name(path.name + ".bak")
        if self.version == 4:
            tmp = path.with_name(path.name + ".tmp")
            self._write_file(tmp, data)
            prev = self._read_file(path)
            if prev is not None:
                self._write_file(bak, prev)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            os.rename(tmp, path)
        else:
            prev = self._read_file(path)
            if prev is not None:
                self._write_file(bak, prev)
            self._write_file(path, data)

    def persist_topics(self, upto: int) -> None:
        table = {}
        for t in self.topic_names[:upto]:
            table[t] = {
                "order": False, "perm": 6, "readQueueNums": self.a.queues, "topicFilterType": "SINGLE_TAG",
                "topicName": t, "topicSysFlag": 0, "writeQueueNums": self.a.queues,
            }
        doc = {"dataVersion": {"counter": upto, "timestamp": int(time.time() * 1000)}, "topicConfigTable": table}
        self.string2file(self.config_dir / "topics.json", json.dumps(doc, indent="\t"))

    def persist_offsets(self) -> None:
        self.string2file(self.config_dir / "consumerOffset.json", json.dumps({"offsetTable": {}}, indent="\t"))
        self.string2file(self.config_dir / "delayOffset.json", json.dumps({"offsetTable": {}}, indent="\t"))

    def checkpoint_flush(self) -> None:
        """``StoreCheckpoint.flush``: fields into the mapping, then msync of the 4 KiB."""
        with self.cp_lock:
            if self.cp_file is None:
                return
            ckpt.encode_checkpoint_into(self.cp_file.mm, self.cp, 5 if self.version == 5 else 3)
            self.cp_file.msync()

    # ---- startup / shutdown ----
    def start(self) -> int:
        # DefaultMessageStore ctor: mkdirs, open lock (no lock yet).
        for d in (self.root, self.root / "commitlog", self.root / "consumequeue"):
            d.mkdir(parents=True, exist_ok=True)
        self.lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o666)
        # load(): checkpoint mapped (ftruncate 4096 on a new file).
        self.cp_file = MappedFile(self.root / "checkpoint", ckpt.CHECKPOINT_SIZE)
        # start(): tryLock(0, 1, false) = fcntl(F_SETLK, F_WRLCK, 0, 1).
        try:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
        except OSError:
            self._close_small()
            print("Lock failed,MQ already started", file=sys.stderr)
            return 1
        if any(p.is_file() for p in (self.root / "commitlog").iterdir()):
            self._release_lock()
            self._close_small()
            print(f"store {self.root} already has commitlog segments; this producer only writes fresh stores",
                  file=sys.stderr)
            return 2
        os.write(self.lock_fd, b"lock")
        os.fsync(self.lock_fd)
        # abort marker: createNewFile (O_EXCL); 5.x then writes the PID via string2File (makes abort.bak).
        abort = self.root / "abort"
        try:
            os.close(os.open(abort, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            pass
        if self.version == 5:
            self.string2file(abort, str(os.getpid()))
        # Broker-side config managers.
        for i in range(1, len(self.topic_names) + 1):
            self.persist_topics(i)  # one persist per topic creation, like updateTopicConfig
        self.string2file(self.config_dir / "subscriptionGroup.json", json.dumps(
            {"dataVersion": {"counter": 0, "timestamp": int(time.time() * 1000)}, "subscriptionGroupTable": {}},
            indent="\t"))
        self.persist_offsets()
        # Background services.
        self._spawn(self._commitlog_flush_loop, "FlushRealTimeService")
        self._spawn(self._cq_flush_loop, "FlushConsumeQueueService")
        self._spawn(self._scheduled_loop, "StoreScheduledThread")
        return 0

    def _spawn(self, fn, name: str) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # surface in the main thread
                self.errors.append(e)
                self.stop_requested = True
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def _release_lock(self) -> None:
        if self.lock_fd is not None:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN, 1, 0, os.SEEK_SET)

    def _close_small(self) -> None:
        if self.cp_file is not None:
            with self.cp_lock:
                self.cp_file.close()
                self.cp_file = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def shutdown(self) -> None:
        """Store shutdown order (§10): commitlog flush, CQ flush + checkpoint, index flush (5.x),
        destroy preallocated segments, checkpoint flush, unlink abort, release lock; then configs."""
        if self.a.shutdown_sleep_ms:
            time.sleep(self.a.shutdown_sleep_ms / 1000)
        self.stop_event.set()
        for t in self.threads:
            t.join()
        for t in self.index_threads:
            t.join()
        # FlushRealTimeService exit: flush(0) while it makes progress, at most RETRY_TIMES_OVER (10).
        for _ in range(10):
            if self.clq.flush(0):
                break
        if self.clq.store_timestamp > 0:
            self.cp.physic_msg_timestamp = self.clq.store_timestamp
        if self.version == 5:  # 4.9's IndexService.shutdown() is empty
            self._index_flush_all()
        self._cq_do_flush(3)
        for f in self.prealloc:  # AllocateMappedFileService.shutdown destroys queued files
            f.close(unlink=True)
        self.prealloc.clear()
        self.checkpoint_flush()
        for f in self.clq.files:
            f.close()
        for q in self.queues.values():
            for f in q.mfq.files:
                f.close()
        for xf in self.index_files:
            xf.mf.close()
        os.unlink(self.root / "abort")
        self._release_lock()
        self._close_small()
        self.persist_offsets()

    def _index_flush_all(self) -> None:
        for xf in self.index_files:
            self._index_flush(xf)

    def _index_flush(self, xf: IndexFileWriter) -> None:
        """``IndexService.flush(f)``: header rewrite + msync; a full file advances ``indexMsgTimestamp``."""
        end_ts = xf.writer.header.end_timestamp if xf.writer.is_full else 0
        xf.writer.flush_header()
        xf.mf.msync()
        if end_ts > 0:
            self.cp.index_msg_timestamp = end_ts
            self.checkpoint_flush()

    # ---- background loops ----
    def _commitlog_flush_loop(self) -> None:
        interval = self.a.flush_ms / 1000
        last_thorough = 0.0
        while not self.stop_event.wait(interval):
            least = self.a.flush_least_pages
            now = time.time() * 1000
            if now >= last_thorough + self.a.flush_thorough_ms:
                last_thorough = now
                least = 0
            self.clq.flush(least)
            if least == 0 and self.clq.store_timestamp > 0:
                self.cp.physic_msg_timestamp = self.clq.store_timestamp

    def _cq_do_flush(self, retry_times: int) -> None:
        """``FlushConsumeQueueService.doFlush``: one file per queue; thorough passes also flush the checkpoint."""
        least = self.a.cq_flush_least_pages
        if retry_times == 3:
            least = 0
        logics_ts = 0
        now = time.time() * 1000
        if now >= self._cq_last_thorough + self.a.cq_thorough_ms:
            self._cq_last_thorough = now
            least = 0
            logics_ts = self.cp.logics_msg_timestamp
        for q in list(self.queues.values()):
            for _ in range(retry_times):
                if q.mfq.flush(least):
                    break
        if least == 0:
            if logics_ts > 0:
                self.cp.logics_msg_timestamp = logics_ts
            self.checkpoint_flush()

    def _cq_flush_loop(self) -> None:
        interval = self.a.cq_flush_ms / 1000
        while not self.stop_event.wait(interval):
            self._cq_do_flush(1)

    def _scheduled_loop(self) -> None:
        """5.x 1 s checkpoint flush; consumer/delay offset persistence (both versions)."""
        cp_every = self.a.checkpoint_ms / 1000 if self.version == 5 else None
        cfg_every = self.a.config_persist_ms / 1000
        next_cp = time.monotonic() if cp_every else float("inf")
        next_cfg = time.monotonic() + cfg_every
        while True:
            timeout = max(0.0, min(next_cp, next_cfg) - time.monotonic())
            if self.stop_event.wait(timeout):
                return
            now = time.monotonic()
            if now >= next_cp:
                self.checkpoint_flush()
                next_cp = now + cp_every
            if now >= next_cfg:
                self.persist_offsets()
                next_cfg = now + cfg_every

    # ---- commitlog segments ----
    def _new_commitlog(self, start: int) -> MappedFile:
        return MappedFile(self.root / "commitlog" / offset_to_name(start), self.cl_size, start)

    def _next_segment(self) -> MappedFile:
        """``getLastMappedFile(0)``: hand out the next file (preallocated if queued) and queue the one after."""
        files = self.clq.files
        start = files[-1].start + self.cl_size if files else 0
        if self.prealloc and self.prealloc[0].start == start:
            f = self.prealloc.pop(0)
        else:
            f = self._new_commitlog(start)
        nxt = start + self.cl_size
        if not any(p.start == nxt for p in self.prealloc):
            self.prealloc.append(self._new_commitlog(nxt))  # nextNextFilePath
        files.append(f)
        return f

    # ---- index ----
    def _index_for_put(self) -> IndexFileWriter:
        """``retryGetAndCreateIndexFile``: the last file unless full; else a new time-named one, and a
        one-off thread flushes the previous file (``FlushIndexFileThread``)."""
        if self.index_files and not self.index_files[-1].writer.is_full:
            return self.index_files[-1]
        prev = self.index_files[-1] if self.index_files else None
        now = int(time.time() * 1000)
        while now <= self.last_index_ms:  # names are creation-time millis: never reuse one
            time.sleep(0.0005)
            now = int(time.time() * 1000)
        self.last_index_ms = now
        name = index_file_name(now)
        (self.root / "index").mkdir(exist_ok=True)
        size = ix.index_file_size(self.a.index_slots, self.a.index_items)
        mf = MappedFile(self.root / "index" / name, size)
        end_phy = prev.writer.header.end_phy_offset if prev else 0
        end_ts = prev.writer.header.end_timestamp if prev else 0
        writer = ix.IndexWriter(mf.mm, self.a.index_slots, self.a.index_items, end_phy, end_ts)
        xf = IndexFileWriter(mf, writer)
        self.index_files.append(xf)
        if prev is not None:
            self.index_threads = [t for t in self.index_threads if t.is_alive()]
            t = threading.Thread(target=self._index_flush, args=(prev,), name="FlushIndexFileThread", daemon=True)
            t.start()
            self.index_threads.append(t)
        return xf

    # ---- the put loop ----
    def run(self) -> None:
        a = self.a
        seed = a.seed
        pool = body_pool(seed)
        pool_mv = memoryview(pool)
        body_min, body_max = a.body_min, a.body_max
        ntopics, nqueues = a.topics, a.queues
        tags = [t for t in a.tags.split(",") if t] if a.tags else []
        tag_bytes = [t.encode() for t in tags]
        tag_codes = [tags_hash_code(t) for t in tags]
        trailing = b"\x02" if self.version == 5 else b""
        upfx = uniq_prefix(seed)
        keys_per = a.keys_per_msg
        if a.ipv6:
            sys_flag = cl.BORNHOST_V6_FLAG | cl.STOREHOSTADDRESS_V6_FLAG
            born_host = (b"\x00" * 15 + b"\x01", 54321)
            store_host = (b"\x00" * 15 + b"\x01", 10911)
        else:
            sys_flag = 0
            born_host = (b"\x7f\x00\x00\x01", 54321)
            store_host = (b"\x7f\x00\x00\x01", 10911)
        packers = []
        key_hashers = []  # per topic: [UNIQ_KEY hasher, k-<seq> hasher]
        topic_hash = []
        for t in self.topic_names:
            tb = t.encode()
            version = 2 if (self.version == 5 and len(t) > 127) else 1
            packers.append(cl.RecordPacker(tb, sys_flag, version, born_host, store_host))
            h = java_string_hash(t + "#")
            topic_hash.append(h)
            key_hashers.append((SuffixHasher(java_string_hash(upfx, h), 16, 3, pad=12).index_hash,
                                SuffixHasher(java_string_hash("k-", h), 10, 3).index_hash))
        base_size = [p.size(0, 0) for p in packers]
        queues = self.queues
        for ti, t in enumerate(self.topic_names):
            for q in range(nqueues):
                queues[(ti, q)] = ConsumeQueueWriter(self.root, t, q, self.cq_size, self.filechannel)
        qlist = [[queues[(ti, q)] for q in range(nqueues)] for ti in range(ntopics)]
        # Properties: bytes templates filled per message (name\x01value\x02 ..., trailing \x02 on 5.x).
        if keys_per == 1:
            keys_fmt = b"k-%d"
        else:
            keys_fmt = b" ".join([b"k-%d"] + [b"k-%%d-%d" % j for j in range(1, keys_per)])
        props_fmt = (b"KEYS\x01" + keys_fmt + b"\x02UNIQ_KEY\x01" + upfx.encode() + b"%012X"
                     + (b"\x02TAGS\x01%s" if tags else b"") + b"\x02WAIT\x01true" + trailing)
        head_pack = BODY_HEADER.pack
        crc32 = zlib.crc32
        time_ns = time.time_ns
        rate = a.rate
        total_msgs = a.messages
        cp = self.cp

        nk = keys_per
        # Like the broker, the first commitlog segment and index file appear with the first message.
        seg = mm = None
        seg_start = 0
        seg_size = wpos = self.cl_size
        iw = None
        t0 = time.monotonic()
        seq = 0
        nbytes = 0
        nbody = 0
        while not self.stop_requested and (total_msgs == 0 or seq < total_msgs):
            if rate and seq % 16 == 0:
                due = t0 + seq / rate
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            ti = seq % ntopics
            qi = (seq // ntopics) % nqueues
            cqw = qlist[ti][qi]
            packer = packers[ti]
            # body
            length = body_min if body_min == body_max else body_length(seq, body_min, body_max)
            if length > 16:
                off = (seq * 2654435761) % POOL_SPAN
                body = head_pack(seq, seed) + pool_mv[off:off + length - 16]
            else:
                body = head_pack(seq, seed)[:length]
            # properties
            fill = (seq,) * nk + (seq,)
            if tags:
                tag_i = seq % len(tags)
                props = props_fmt % (fill + (tag_bytes[tag_i],))
                tags_code = tag_codes[tag_i]
            else:
                props = props_fmt % fill
                tags_code = 0
            size = base_size[ti] + length + len(props)
            if size + cl.BLANK_SIZE > seg_size - wpos:
                if size + cl.BLANK_SIZE > seg_size:
                    raise SystemExit(f"message of {size} bytes cannot fit a {seg_size}-byte commitlog segment")
                if seg is not None:
                    # END_OF_FILE: BLANK with the remaining length, file becomes full, retry in the next file.
                    mm[wpos:wpos + cl.BLANK_SIZE] = cl.encode_blank(seg_size - wpos)
                    seg.wrote = seg_size
                seg = self._next_segment()
                mm = seg.mm
                seg_start, seg_size = seg.start, seg.size
                wpos = 0
            now = time_ns() // 1_000_000
            phys = seg_start + wpos
            queue_offset = cqw.next_offset
            packer.pack_into(mm, wpos, body, props, qi, queue_offset, phys, now, now, 0, 0, 0,
                             crc32(body) & 0x7FFFFFFF)
            wpos += size
            seg.store_ts = now
            seg.wrote = wpos
            # Dispatch (ReputMessageService): ConsumeQueue unit, then index keys (UNIQ_KEY, then KEYS).
            cqw.put(phys, size, tags_code)
            cp.logics_msg_timestamp = now
            if iw is None or iw.is_full:
                iw = self._index_for_put().writer
            uh, kh = key_hashers[ti]
            hashes = [uh(seq), kh(seq)]
            for j in range(1, keys_per):
                hashes.append(index_hash_of(java_string_hash("k-%d-%d" % (seq, j), topic_hash[ti])))
            for h in hashes:
                if not iw.put_key(h, phys, now):
                    iw = self._index_for_put().writer
                    iw.put_key(h, phys, now)
            seq += 1
            nbytes += size
            nbody += length
        self.count = seq
        self.bytes = nbytes
        self.body_bytes = nbody
        self.elapsed = time.monotonic() - t0
        if self.errors:
            raise self.errors[0]

    def summary(self) -> dict:
        n_cq = sum(len(q.mfq.files) for q in self.queues.values())
        return {
            "messages": self.count,
            "bytes": self.bytes,
            "body_bytes": self.body_bytes,
            "max_phys_offset": (self.clq.files[-1].start + self.clq.files[-1].wrote) if self.clq.files else 0,
            "files": {"commitlog": len(self.clq.files), "consumequeue": n_cq, "index": len(self.index_files)},
            "elapsed_s": round(self.elapsed, 3),
            "msgs_per_s": round(self.count / self.elapsed) if self.elapsed > 0 else 0,
            "mib_per_s": round(self.bytes / self.elapsed / 1048576, 1) if self.elapsed > 0 else 0,
            "broker_version": self.version,
            "cq_mode": self.a.cq_mode,
        }


def topic_names(prefix: str, n: int, long_topics: bool) -> list[str]:
    names = [f"{prefix}{i}" if n > 1 else prefix for i in range(n)]
    if long_topics:  # longer than 127 chars: 5.x writes these with MAGIC_V2
        names = [nm + "_" + "L" * max(0, 149 - len(nm)) for nm in names]
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("store_dir", metavar="STORE_DIR", help="storePathRootDir to create/write")
    p.add_argument("--broker-version", type=int, choices=(4, 5), default=5,
                   help="4 = 4.9.x behaviour, 5 = 5.3.x behaviour")
    p.add_argument("--cq-mode", choices=("mmap", "filechannel"), default=None,
                   help="ConsumeQueue write path (default: filechannel for 5, mmap for 4)")
    p.add_argument("--commitlog-size", type=int, default=1073741824, help="mappedFileSizeCommitLog")
    p.add_argument("--cq-size", type=int, default=6000000, help="mappedFileSizeConsumeQueue (rounded up to 20)")
    p.add_argument("--index-slots", type=int, default=ix.MAX_HASH_SLOT_NUM, help="maxHashSlotNum")
    p.add_argument("--index-items", type=int, default=ix.MAX_INDEX_NUM, help="maxIndexNum")
    p.add_argument("--topics", type=int, default=1)
    p.add_argument("--queues", type=int, default=4, help="queues per topic")
    p.add_argument("--topic-prefix", default="TopicTest")
    p.add_argument("--long-topics", action="store_true",
                   help="topic names of 150 chars (v2 records; needs --broker-version 5)")
    p.add_argument("--messages", type=int, default=100000, help="0 = until SIGTERM/SIGINT")
    p.add_argument("--body-size", type=int, default=1024, help="fixed body size (sets min and max)")
    p.add_argument("--body-min", type=int, default=None)
    p.add_argument("--body-max", type=int, default=None)
    p.add_argument("--keys-per-msg", type=int, default=1, help="KEYS tokens per message (k-<seq>, k-<seq>-1, ...)")
    p.add_argument("--tags", default="TagA,TagB,TagC", help="comma list cycled over messages; '' = no TAGS")
    p.add_argument("--ipv6", action="store_true", help="IPv6 born/store hosts (SYSFLAG 0x10|0x20)")
    p.add_argument("--rate", type=float, default=0, help="messages per second, 0 = unlimited")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--flush-ms", type=int, default=500, help="flushIntervalCommitLog")
    p.add_argument("--flush-least-pages", type=int, default=4, help="flushCommitLogLeastPages")
    p.add_argument("--flush-thorough-ms", type=int, default=10000, help="flushCommitLogThoroughInterval")
    p.add_argument("--cq-flush-ms", type=int, default=1000, help="flushIntervalConsumeQueue")
    p.add_argument("--cq-flush-least-pages", type=int, default=2, help="flushConsumeQueueLeastPages")
    p.add_argument("--cq-thorough-ms", type=int, default=60000, help="flushConsumeQueueThoroughInterval")
    p.add_argument("--checkpoint-ms", type=int, default=1000, help="5.x periodic checkpoint flush")
    p.add_argument("--config-persist-ms", type=int, default=5000, help="consumerOffset/delayOffset persist interval")
    p.add_argument("--shutdown-sleep-ms", type=int, default=0, help="the broker sleeps 3000 here")
    a = p.parse_args(argv)
    if a.cq_mode is None:
        a.cq_mode = "filechannel" if a.broker_version == 5 else "mmap"
    if a.body_min is None:
        a.body_min = a.body_size if a.body_max is None else 0
    if a.body_max is None:
        a.body_max = max(a.body_size, a.body_min)
    if not 0 <= a.body_min <= a.body_max <= MAX_BODY:
        p.error(f"need 0 <= body-min <= body-max <= {MAX_BODY}")
    if a.long_topics and a.broker_version != 5:
        p.error("--long-topics needs --broker-version 5 (4.9 only knows v1 records)")
    if a.topics < 1 or a.queues < 1 or a.keys_per_msg < 1:
        p.error("--topics, --queues and --keys-per-msg must be >= 1")
    if a.index_slots < 1 or a.index_items < 2:
        p.error("--index-slots >= 1 and --index-items >= 2")
    if a.commitlog_size < 1024:
        p.error("--commitlog-size too small")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    prod = Producer(a)

    def on_signal(signum, frame):  # flush and exit cleanly
        prod.stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rc = prod.start()
    if rc:
        return rc
    try:
        prod.run()
    finally:
        prod.shutdown()
    print(json.dumps(prod.summary()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
