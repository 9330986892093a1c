#!/usr/bin/env python3
"""Verifying consumer for stores written by ``examples/producer.py`` (or any broker store, minus the
body/seq checks that rely on the producer's deterministic content).

Usage: ``python examples/consumer.py STORE_DIR [--expect-messages N] [--check-keys K] [--recover] [--json]``

It reads a store the way the broker does and checks every byte it can:

1. Walks the CommitLog from the first segment: every record valid with a matching BODYCRC,
   PHYSICALOFFSET == position, QUEUEOFFSET consecutive per queue, STORETIMESTAMP non-decreasing,
   message numbers consecutive, body equal to the producer's deterministic body. Full segments must end
   with a BLANK whose TOTALSIZE == remaining bytes; the valid data ends at the first invalid record.
2. Reads every ConsumeQueue by queue offset up to the first invalid unit and, per unit, the referenced
   record (size, PHYSICALOFFSET, QUEUEOFFSET, topic, queue id, tags hash, BODYCRC).
3. Cross-checks per-queue counts between (1) and (2).
4. Looks keys up through the IndexFiles newest to oldest like ``IndexService.queryOffset`` and resolves
   hash collisions by reading the records and comparing keys.

``--recover`` accepts a crashed store (``abort`` present): only the valid prefix counts, CQ units that point
at or beyond the commitlog's valid end are ignored, and the single in-flight message at the crash point may be
missing from its CQ or index. ``--redispatch`` (implies ``--recover``) accepts a store taken from the hot dir
at an instant while the writer ran (a killed tierfs daemon, or a ``tierfs mount --takeover``): ConsumeQueues and
IndexFiles may then lag the CommitLog by whatever the writer had not flushed yet, as the broker's abnormal
recovery expects (it re-dispatches CommitLog records past the ConsumeQueues); every CQ unit present must still
be right, in order from the first, and ``cq_lag_units`` counts the records not dispatched yet.
Exit 0 on success, 1 with a precise message on the first mismatch.
A JSON summary is printed on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
from array import array
from pathlib import Path

try:
    import tierfs.store  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierfs.store import commitlog as cl
from tierfs.store import consumequeue as cq
from tierfs.store import indexfile as ix
from tierfs.store.checkpoint import CHECKPOINT_SIZE, decode_checkpoint
from tierfs.store.javahash import tags_hash_code
from tierfs.store.names import is_index_name, is_offset_name, name_to_offset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from producer import BODY_HEADER, body_pool, expected_body, parse_seq  # noqa: E402

LONG_MAX = (1 << 63) - 1


class Mismatch(Exception):
    """A verification failure; the message says exactly what and where."""


def _map_ro(path: Path) -> tuple[int, mmap.mmap | bytes]:
    """Open and map a file read-only (an empty file maps to b"")."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return size, b""
        return size, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


class Segment:
    __slots__ = ("path", "start", "size", "buf")

    def __init__(self, path: Path, start: int, size: int, buf) -> None:
        self.path = path
        self.start = start
        self.size = size
        self.buf = buf


class Consumer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.root = Path(args.store_dir)
        self.redispatch = bool(getattr(args, "redispatch", False))
        self.recover = args.recover or self.redispatch
        self.cq_end_phys: dict[tuple[str, int], int] = {}  # phys offset of each queue's last valid unit
        self.lag_from = 1 << 62  # --redispatch: records at or past this phys offset may be undispatched
        self.segments: list[Segment] = []
        self.seg_size = 0
        self.first_start = 0
        self.valid_end = 0
        self.phys_by_seq = array("q")
        self.queue_counts: dict[tuple[str, int], int] = {}
        self.last_queue: tuple[str, int] | None = None
        self.seed: int | None = args.seed
        self.pool: bytes | None = None
        self.summary: dict = {}
        self.torn_units = 0
        self.zero_length_tail: list[str] = []
        self.ignored_units = 0
        self.index_files: list = []
        self.index_headers: list[ix.IndexHeader] = []
        self.index_names: list[str] = []
        self.slots = 0
        self.items = 0

    # ---- 1. commitlog ----
    def load_commitlog(self) -> None:
        d = self.root / "commitlog"
        if not d.is_dir():
            raise Mismatch(f"{d} does not exist")
        names = sorted(p.name for p in d.iterdir() if p.is_file())
        bad = [n for n in names if not is_offset_name(n)]
        if bad:
            raise Mismatch(f"commitlog/ holds non-segment files the broker would refuse: {bad[:5]}")
        names = self._drop_zero_length_tail(d, names)
        for n in names:
            size, buf = _map_ro(d / n)
            self.segments.append(Segment(d / n, name_to_offset(n), size, buf))
        if not self.segments:
            return
        self.seg_size = self.segments[0].size
        self.first_start = self.segments[0].start
        for i, s in enumerate(self.segments):
            if s.size != self.seg_size:
                raise Mismatch(f"{s.path}: size {s.size} != {self.seg_size} (broker load() would fail)")
            if s.start != self.first_start + i * self.seg_size:
                raise Mismatch(f"{s.path}: expected start offset {self.first_start + i * self.seg_size}")

    def _drop_zero_length_tail(self, d: Path, names: list[str]) -> list[str]:
        """With --recover, ignore a 0-byte last file: a crash between open(O_CREAT) and ftruncate leaves one,
        and the broker's load() deletes exactly that case silently (§2)."""
        if self.recover and names and (d / names[-1]).stat().st_size == 0:
            self.zero_length_tail.append(str((d / names[-1]).relative_to(self.root)))
            return names[:-1]
        return names

    def _seg_for(self, phys: int) -> Segment | None:
        if not self.segments or phys < self.first_start:
            return None
        i = (phys - self.first_start) // self.seg_size
        return self.segments[i] if i < len(self.segments) else None

    def _check_body(self, seq: int, msg: cl.Message, where: str) -> None:
        body = msg.body
        if self.seed is None and len(body) >= BODY_HEADER.size:
            self.seed = BODY_HEADER.unpack_from(body)[1]
        if self.seed is None:
            want = BODY_HEADER.pack(seq, 0)[:min(len(body), 8)]
            if body[:len(want)] != want:
                raise Mismatch(f"{where}: body does not start with message number {seq}")
            return
        if self.pool is None:
            self.pool = body_pool(self.seed)
        if body != expected_body(seq, self.seed, len(body), self.pool):
            raise Mismatch(f"{where}: body of message {seq} differs from the producer's (seed {self.seed})")

    def walk_commitlog(self) -> None:
        """Independent walk of every segment, like broker recovery plus content checks."""
        expect_seq = 0
        last_ts = -1
        counts = self.queue_counts
        phys_by_seq = self.phys_by_seq
        self.valid_end = self.first_start
        ended = False
        empty_after = 0
        for si, seg in enumerate(self.segments):
            if ended:
                if cl.decode_record(seg.buf, 0) is not None or bytes(seg.buf[:8]) != bytes(8):
                    raise Mismatch(f"{seg.path}: data after the end of the valid commitlog at {self.valid_end}")
                empty_after += 1
                continue
            pos = 0
            blank_seen = False
            for pos, rec in cl.iter_records(seg.buf, 0, check_crc=True):
                where = f"{seg.path.name}@{pos}"
                if isinstance(rec, cl.Blank):
                    if rec.total_size != seg.size - pos:
                        raise Mismatch(f"{where}: BLANK TOTALSIZE {rec.total_size} != remaining {seg.size - pos}")
                    blank_seen = True
                    break
                if self.recover and cl.torn_record(seg.buf, pos):
                    # the crash cut this append short (its topic or properties end in zeros): the valid data
                    # ends before it, though the broker's recovery (lengths and body crc only) would keep it
                    self.summary["torn_records"] = 1
                    break
                phys = seg.start + pos
                if rec.physical_offset != phys:
                    raise Mismatch(f"{where}: PHYSICALOFFSET {rec.physical_offset} != {phys}")
                if pos + rec.total_size + cl.BLANK_SIZE > seg.size:
                    raise Mismatch(f"{where}: record leaves fewer than 8 bytes for the BLANK")
                qk = (rec.topic, rec.queue_id)
                n = counts.get(qk, 0)
                if rec.queue_offset != n:
                    raise Mismatch(f"{where}: QUEUEOFFSET {rec.queue_offset} != {n} expected for {qk}")
                counts[qk] = n + 1
                if rec.store_timestamp < last_ts:
                    raise Mismatch(f"{where}: STORETIMESTAMP went backwards")
                last_ts = rec.store_timestamp
                keys = rec.keys
                seq = parse_seq(keys[0]) if keys else None
                if seq is None:
                    raise Mismatch(f"{where}: no producer key k-<seq> in KEYS={rec.properties.get('KEYS')!r}")
                if seq != expect_seq:
                    raise Mismatch(f"{where}: message number {seq}, expected {expect_seq}")
                self._check_body(seq, rec, where)
                expect_seq += 1
                phys_by_seq.append(phys)
                self.last_queue = qk
                self.valid_end = phys + rec.total_size
            if blank_seen:
                self.valid_end = seg.start + seg.size
                continue
            # End of valid data inside this segment.
            ended = True
            end_pos = self.valid_end - seg.start
            if end_pos < 0:  # an empty leading segment cannot happen with this producer
                raise Mismatch(f"{seg.path}: starts after a gap in the commitlog")
            tail = bytes(seg.buf[end_pos:end_pos + 8])
            if not self.recover and tail != bytes(len(tail)):
                raise Mismatch(f"{seg.path.name}@{end_pos}: invalid record after the valid data (torn write?); "
                               "a cleanly closed store has zeros here")
        self.summary["commitlog_files"] = len(self.segments)
        self.summary["empty_tail_segments"] = empty_after
        self.summary["messages"] = len(phys_by_seq)
        self.summary["bytes"] = self.valid_end - self.first_start

    # ---- 2. consume queues ----
    def walk_consumequeues(self) -> None:
        d = self.root / "consumequeue"
        cq_counts: dict[tuple[str, int], int] = {}
        nfiles = 0
        units_total = 0
        if d.is_dir():
            for tdir in sorted(p for p in d.iterdir() if p.is_dir()):
                for qdir in sorted(p for p in tdir.iterdir() if p.is_dir()):
                    if not qdir.name.lstrip("-").isdigit():
                        continue  # the broker skips non-numeric queue dirs
                    qid = int(qdir.name)
                    n, files = self._walk_queue(tdir.name, qid, qdir)
                    cq_counts[(tdir.name, qid)] = n
                    nfiles += files
                    units_total += n
        lag = 0
        for qk in set(cq_counts) | set(self.queue_counts):
            want = self.queue_counts.get(qk, 0)
            got = cq_counts.get(qk, 0)
            if got == want:
                continue
            if self.recover and qk == self.last_queue and got == want - 1:
                continue  # crash between the commitlog append and the dispatch of the last message
            if self.redispatch and got < want:
                lag += want - got  # not dispatched yet when the hot dir was taken
                self.lag_from = min(self.lag_from, self.cq_end_phys.get(qk, -1) + 1)
                continue
            raise Mismatch(f"queue {qk[0]}/{qk[1]}: {got} valid CQ units but {want} commitlog records")
        self.summary["cq_files"] = nfiles
        if self.redispatch:
            self.summary["cq_lag_units"] = lag
        self.summary["cq_units"] = units_total
        self.summary["queues"] = len(cq_counts)

    def _walk_queue(self, topic: str, qid: int, qdir: Path) -> tuple[int, int]:
        names = sorted(p.name for p in qdir.iterdir() if p.is_file())
        bad = [n for n in names if not is_offset_name(n)]
        if bad:
            raise Mismatch(f"{qdir}: non-segment files the broker would refuse: {bad[:5]}")
        names = self._drop_zero_length_tail(qdir, names)
        if not names:
            return 0, 0
        files = []
        for n in names:
            size, buf = _map_ro(qdir / n)
            files.append((name_to_offset(n), size, buf, n))
        fsize = files[0][1]
        if fsize <= 0 or fsize % cq.UNIT_SIZE:
            raise Mismatch(f"{qdir}/{names[0]}: size {fsize} is not a positive multiple of 20")
        for i, (start, size, _, n) in enumerate(files):
            if size != fsize:
                raise Mismatch(f"{qdir}/{n}: size {size} != {fsize} (broker load() would fail)")
            if start != files[0][0] + i * fsize:
                raise Mismatch(f"{qdir}/{n}: expected name {files[0][0] + i * fsize}")
        index = files[0][0] // cq.UNIT_SIZE
        valid = 0
        leading = True
        stop = False
        for fi, (start, size, buf, n) in enumerate(files):
            for pos in range(0, size, cq.UNIT_SIZE):
                unit = cq.decode_unit(buf, pos)
                if not cq.is_valid(unit):
                    stop = True
                    break
                if leading and cq.is_pre_blank(unit):
                    index += 1
                    continue
                leading = False
                where = f"consumequeue/{topic}/{qid}/{n}@{pos} (queue offset {index})"
                if unit.phys_offset >= self.valid_end or unit.phys_offset < self.first_start:
                    if not self.recover or unit.phys_offset < self.first_start:
                        raise Mismatch(f"{where}: points at {unit.phys_offset}, outside the commitlog's valid "
                                       f"range [{self.first_start}, {self.valid_end})")
                    self.ignored_units += 1  # dirty CQ tail beyond the recovered commitlog end
                    index += 1
                    continue
                err = self._check_unit(unit, topic, qid, index)
                if err:
                    last_unit = self._is_last_valid_unit(files, fi, pos)
                    if self.recover and last_unit and self.torn_units == 0:
                        self.torn_units += 1  # the one unit being written when the producer died
                        stop = True
                        break
                    raise Mismatch(f"{where}: {err}")
                valid += 1
                index += 1
                self.cq_end_phys[(topic, qid)] = unit.phys_offset
            if stop:
                break
        return valid, len(files)

    @staticmethod
    def _is_last_valid_unit(files, fi: int, pos: int) -> bool:
        nxt = pos + cq.UNIT_SIZE
        if nxt < files[fi][1]:
            return not cq.is_valid(cq.decode_unit(files[fi][2], nxt))
        if fi + 1 < len(files):
            return not cq.is_valid(cq.decode_unit(files[fi + 1][2], 0))
        return True

    def _check_unit(self, unit: cq.CqUnit, topic: str, qid: int, index: int) -> str | None:
        seg = self._seg_for(unit.phys_offset)
        if seg is None:
            return f"no commitlog segment holds offset {unit.phys_offset}"
        rec = cl.decode_record(seg.buf, unit.phys_offset - seg.start, check_crc=True)
        if not isinstance(rec, cl.Message):
            return f"no valid record (or BODYCRC mismatch) at commitlog offset {unit.phys_offset}"
        if rec.total_size != unit.size:
            return f"unit size {unit.size} != record TOTALSIZE {rec.total_size}"
        if rec.physical_offset != unit.phys_offset:
            return f"record PHYSICALOFFSET {rec.physical_offset} != unit offset {unit.phys_offset}"
        if rec.queue_offset != index:
            return f"record QUEUEOFFSET {rec.queue_offset} != {index}"
        if rec.topic != topic or rec.queue_id != qid:
            return f"record belongs to {rec.topic}/{rec.queue_id}"
        if unit.tags_code != tags_hash_code(rec.tags):
            return f"tags code {unit.tags_code} != hash of TAGS {rec.tags!r}"
        return None

    # ---- 4. index ----
    def load_index(self) -> None:
        d = self.root / "index"
        if not d.is_dir():
            return
        names = sorted(p.name for p in d.iterdir() if p.is_file() and is_index_name(p.name))
        names = self._drop_zero_length_tail(d, names)
        bufs = []
        for n in names:
            size, buf = _map_ro(d / n)
            bufs.append((n, size, buf))
        if not bufs:
            return
        sizes = {s for _, s, _ in bufs}
        if len(sizes) != 1:
            raise Mismatch(f"index files have different sizes: {sorted(sizes)}")
        size = sizes.pop()
        slots, items = self.a.index_slots, self.a.index_items
        if slots is None or items is None:
            if ix.index_file_size() == size:
                slots, items = ix.MAX_HASH_SLOT_NUM, ix.MAX_INDEX_NUM
            elif (size - ix.HEADER_SIZE) % 84 == 0:  # broker ratio: items = 4 * slots
                slots = (size - ix.HEADER_SIZE) // 84
                items = 4 * slots
            else:
                raise Mismatch(f"cannot infer maxHashSlotNum/maxIndexNum from index file size {size}; "
                               "pass --index-slots and --index-items")
        if ix.index_file_size(slots, items) != size:
            raise Mismatch(f"index file size {size} != 40 + {slots}*4 + {items}*20")
        self.slots, self.items = slots, items
        self.index_names = [n for n, _, _ in bufs]
        self.index_files = [b for _, _, b in bufs]
        self.index_headers = [ix.decode_header(b) for b in self.index_files]
        for n, h in zip(self.index_names, self.index_headers):
            if h.index_count > items:
                raise Mismatch(f"index/{n}: indexCount {h.index_count} > maxIndexNum {items}")

    def _pick_seqs(self, k: int) -> list[int]:
        n = len(self.phys_by_seq)
        if n == 0 or k == 0:
            return []
        if k < 0 or k >= n:
            return list(range(n))
        step = (n - 1) / max(k - 1, 1)
        return sorted({round(i * step) for i in range(k)})

    def _index_end(self) -> int:
        """The physical offset up to which the IndexFiles say they hold keys (their headers' endPhyOffset)."""
        return max((h.end_phy_offset for h in self.index_headers), default=0)

    def check_keys(self) -> None:
        k = self.a.check_keys
        seqs = self._pick_seqs(k)
        checked = 0
        missing_last = 0
        if seqs and not self.index_files:
            raise Mismatch("no index files to look keys up in")
        last_seq = len(self.phys_by_seq) - 1
        for seq in seqs:
            phys = self.phys_by_seq[seq]
            rec = self._record_at(phys)
            for key in [rec.uniq_key] + rec.keys:
                if key is None:
                    continue
                found = self.query(rec.topic, key)
                if found != [phys]:
                    if self.recover and seq == last_seq and not found:
                        missing_last += 1  # crash between the commitlog append and the index put
                        continue
                    if self.redispatch and not found and phys >= min(self.lag_from, self._index_end()):
                        missing_last += 1  # not indexed yet when the hot dir was taken
                        continue
                    raise Mismatch(f"key {rec.topic}#{key} (message {seq} at {phys}): index lookup resolved to {found}")
                checked += 1
        self.summary["keys_checked"] = checked
        if missing_last:
            self.summary["keys_missing_at_crash_point"] = missing_last
        self.summary["index_files"] = len(self.index_files)

    def _record_at(self, phys: int) -> cl.Message:
        seg = self._seg_for(phys)
        rec = cl.decode_record(seg.buf, phys - seg.start) if seg else None
        if not isinstance(rec, cl.Message):
            raise Mismatch(f"no record at commitlog offset {phys}")
        return rec

    def query(self, topic: str, key: str) -> list[int]:
        """``queryMessage`` by key: index hits newest to oldest, then read each record and compare keys."""
        hits = ix.query_offsets(self.index_files, ix.build_key(topic, key), 0, LONG_MAX,
                                ix.MAX_MSGS_NUM_BATCH, self.slots, self.items, self.index_headers)
        out = []
        for phys in hits:
            if phys >= self.valid_end:
                continue  # indexed but beyond the valid commitlog (crashed store)
            seg = self._seg_for(phys)
            rec = cl.decode_record(seg.buf, phys - seg.start) if seg else None
            if isinstance(rec, cl.Message) and rec.topic == topic and (key in rec.keys or rec.uniq_key == key):
                out.append(phys)
        return out

    # ---- driver ----
    def run(self) -> dict:
        abort = (self.root / "abort").exists()
        if abort and not self.recover:
            raise Mismatch("abort file present: the store was not shut down cleanly; use --recover")
        self.summary["abort_present"] = abort
        self.load_commitlog()
        self.walk_commitlog()
        if self.a.expect_messages is not None:
            n = self.summary["messages"]
            if self.recover:
                if n > self.a.expect_messages:
                    raise Mismatch(f"{n} messages in the store, more than the {self.a.expect_messages} expected")
            elif n != self.a.expect_messages:
                raise Mismatch(f"{n} messages in the store, expected {self.a.expect_messages}")
        self.walk_consumequeues()
        self.summary["cq_units_ignored"] = self.ignored_units
        self.summary["cq_units_torn"] = self.torn_units
        self.summary["zero_length_tail_files"] = self.zero_length_tail
        self.load_index()
        self.check_keys()
        cp_path = self.root / "checkpoint"
        if cp_path.exists():
            size, buf = _map_ro(cp_path)
            if size != CHECKPOINT_SIZE:
                raise Mismatch(f"checkpoint is {size} bytes, expected {CHECKPOINT_SIZE}")
            self.summary["checkpoint"] = vars(decode_checkpoint(buf))
        self.summary["ok"] = True
        return self.summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store_dir", metavar="STORE_DIR")
    p.add_argument("--expect-messages", type=int, default=None,
                   help="exact message count (upper bound with --recover)")
    p.add_argument("--check-keys", type=int, default=100,
                   help="messages whose keys (KEYS tokens + UNIQ_KEY) are looked up; -1 = all, 0 = none")
    p.add_argument("--recover", action="store_true", help="accept a crashed store: verify its valid prefix")
    p.add_argument("--redispatch", action="store_true",
                   help="with a store taken from a running writer's hot dir (tierfs takeover): ConsumeQueues and "
                        "IndexFiles may lag the CommitLog (implies --recover)")
    p.add_argument("--json", action="store_true", help="only JSON on stdout (errors as JSON too)")
    p.add_argument("--seed", type=int, default=None, help="producer seed (default: read from the first body)")
    p.add_argument("--index-slots", type=int, default=None, help="maxHashSlotNum (default: inferred)")
    p.add_argument("--index-items", type=int, default=None, help="maxIndexNum (default: inferred)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    c = Consumer(a)
    try:
        summary = c.run()
    except Mismatch as e:
        if a.json:
            print(json.dumps({"ok": False, "error": str(e)}), flush=True)
        print(f"MISMATCH: {e}", file=sys.stderr)
        return 1
    if not a.json:
        print(f"verified {summary['messages']} messages ({summary['bytes']} bytes), "
              f"{summary['cq_units']} CQ units, {summary['keys_checked']} keys", file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
