"""Walking sealed CommitLog content (format §4.1, §12) for the archive: record by record, or column-wise.

A DLedger CommitLog's data file (tierfs.store.dledger) holds the same records, each as the body of a 48-byte
DLedger entry header, and ends in DLedger's blank: :func:`batches` with ``dledger=True`` follows the entry chain,
checks each header against its place, and decodes the bodies as records (their PHYSICALOFFSET is the entry's
offset + 48, so the same checks hold).

A tiered segment was sealed by its content: valid records, then a BLANK whose TOTALSIZE reaches the end. Anything
else — a bad record, a BODYCRC or PHYSICALOFFSET mismatch, content ending before the BLANK — is corruption and
raises :class:`ArchiveError` naming the position.

:func:`records` checks and yields one record at a time (the codec baseline, ``archive.iter_messages``).
:func:`batches` does the same checks for many records at once: Python only follows the TOTALSIZE chain, numpy
gathers, checks and decodes the fields of every record of a batch in one go, so the archive costs no Python
object per message. A batch with a record that fails a column-wise check is cut before that record, and the
record-by-record checker then raises for it, so both walks name the same position and reason.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from tierfs.store import commitlog as cl
from tierfs.store import dledger as dl
from tierfs.store.names import name_to_offset

__all__ = ["ArchiveError", "Batch", "records", "batches", "check_record"]

HEAD_MIN = 91                   # smallest possible message record (IPv4, v1, empty body/topic/properties)
KEEP_TAIL = 8 << 20             # records(): compact the decode buffer once this much has been consumed
BATCH_BYTES = 16 << 20          # batches(): records of about this much content are decoded together
_V6 = cl.BORNHOST_V6_FLAG, cl.STOREHOSTADDRESS_V6_FLAG
_II = cl._II
_Q = cl._Q
_AR = {w: np.arange(w, dtype=np.int64) for w in (1, 2, 4, 8, 20)}


class ArchiveError(ValueError):
    """A segment cannot be archived; the message names the segment position or object that is wrong."""


# ---------------------------------------------------------------------------------------------------- one by one


def _head(name: str, buf, pos: int, at: int, size: int) -> tuple[int, int]:
    """(TOTALSIZE, magic) of the record at *pos* (segment position *at*); raises for what is no record."""
    total, magic = _II.unpack_from(buf, pos)
    if magic == cl.BLANK_MAGIC:
        if total != size - at:
            raise ArchiveError(f"commitlog/{name}: BLANK at position {at} has TOTALSIZE {total}, but "
                               f"{size - at} bytes remain in the {size}-byte segment")
        return total, magic
    if magic not in (cl.MAGIC_V1, cl.MAGIC_V2):
        raise ArchiveError(f"commitlog/{name}: no record at position {at} (magic {magic & 0xFFFFFFFF:#010x}"
                           f") before the terminal BLANK")
    if total < HEAD_MIN or at + total > size - cl.BLANK_SIZE:
        raise ArchiveError(f"commitlog/{name}: record at position {at} has an impossible TOTALSIZE "
                           f"{total} (segment size {size})")
    return total, magic


def _entry_head(name: str, buf, pos: int, at: int, size: int, base: int) -> tuple[int, int]:
    """(entry size, magic) of the DLedger entry at *pos* (data file position *at*), its header checked against
    its place and its body's TOTALSIZE; raises for what is no entry. The magic is BLANK_MAGIC for the blank."""
    magic, total = _II.unpack_from(buf, pos)
    if magic == dl.BLANK_MAGIC:
        if total != size - at:
            raise ArchiveError(f"dledger/{name}: blank at position {at} says {total} bytes, but {size - at} "
                               f"remain in the {size}-byte data file")
        return total, cl.BLANK_MAGIC
    if magic != dl.MAGIC:
        raise ArchiveError(f"dledger/{name}: no entry at position {at} (magic {magic & 0xFFFFFFFF:#010x}) "
                           f"before the terminal blank")
    if total < dl.BODY_OFFSET + HEAD_MIN or at + total > size - dl.MIN_BLANK_LEN:
        raise ArchiveError(f"dledger/{name}: entry at position {at} has an impossible size {total} "
                           f"(data file size {size})")
    return total, magic


def _check_entry(name: str, buf, pos: int, at: int, total: int, base: int) -> None:
    """The header of a whole DLedger entry: its pos is its offset, its body is one record of bodyLen bytes."""
    e = dl.decode_entry(buf, pos)
    body = _II.unpack_from(buf, pos + dl.BODY_OFFSET)[0]
    if e is None or e.pos != base + at or e.size != total or body != e.body_len:
        raise ArchiveError(f"dledger/{name}: entry at position {at} is invalid (its pos, size or bodyLen "
                           f"disagree with its place, or its body is not one record of bodyLen bytes)")


def _ends_before_blank(name: str, end: int) -> ArchiveError:
    return ArchiveError(f"commitlog/{name}: content ends at position {end} before the terminal BLANK (the "
                        f"segment is not sealed, or its objects are truncated)")


def _ends_inside(name: str, end: int, at: int, total: int) -> ArchiveError:
    return ArchiveError(f"commitlog/{name}: content ends at position {end} inside the record at position {at} "
                        f"(TOTALSIZE {total})")


def check_record(buf, pos: int, at: int, total: int, magic: int, base: int, name: str) -> tuple:
    """The layout (commitlog._message_layout's) of the complete message record at *pos*, after checking its
    lengths against TOTALSIZE, its BODYCRC and its PHYSICALOFFSET (*base* + *at*)."""
    lay = cl._message_layout(buf, pos, total, 2 if magic == cl.MAGIC_V2 else 1, len(buf))
    if lay is None or not cl._crc_ok(memoryview(buf), pos, lay[3], lay[4]):
        raise ArchiveError(f"commitlog/{name}: record at position {at} is invalid (field lengths "
                           f"disagree with TOTALSIZE {total}, or its BODYCRC does not match the body)")
    phys = _Q.unpack_from(buf, pos + 28)[0]
    if phys != base + at:
        raise ArchiveError(f"commitlog/{name}: record at position {at} says PHYSICALOFFSET "
                           f"{phys}, expected {base + at}")
    return lay


def records(blocks: Iterable[bytes], name: str, size: int) -> Iterator[tuple[bytearray, int, int, tuple]]:
    """(buffer, position in it, segment position, layout) of each message record of a sealed segment whose
    content arrives in *blocks*, checked by :func:`check_record`. The buffer is only valid until the next item.
    Streams (at most KEEP_TAIL bytes plus one block and one record held); reads nothing after the BLANK."""
    base = name_to_offset(name)
    it = iter(blocks)
    buf = bytearray()
    start = 0  # segment position of buf[0]
    pos = 0    # read position in buf
    eof = False

    def fill(need: int) -> bool:
        nonlocal buf, start, pos, eof
        while len(buf) - pos < need and not eof:
            if pos >= KEEP_TAIL or (pos and pos == len(buf)):
                del buf[:pos]
                start += pos
                pos = 0
            try:
                buf += next(it)
            except StopIteration:
                eof = True
        return len(buf) - pos >= need

    while True:
        at = start + pos
        if len(buf) - pos < 8 and not fill(8):
            raise _ends_before_blank(name, start + len(buf))
        total, magic = _head(name, buf, pos, at, size)
        if magic == cl.BLANK_MAGIC:
            return
        if len(buf) - pos < total and not fill(total):
            raise _ends_inside(name, start + len(buf), at, total)
        lay = check_record(buf, pos, at, total, magic, base, name)
        yield buf, pos, at, lay
        pos += total


# ---------------------------------------------------------------------------------------------------- column-wise


@dataclass
class Batch:
    """Checked records of one stretch of content. Offsets (``*_at``) index ``data``; numbers are native numpy
    arrays, one element per record in segment order."""

    data: bytes
    n: int
    total: np.ndarray
    body_crc: np.ndarray
    queue_id: np.ndarray
    flag: np.ndarray
    queue_offset: np.ndarray
    phys: np.ndarray
    sys_flag: np.ndarray
    born_ts: np.ndarray
    store_ts: np.ndarray
    reconsume: np.ndarray
    born_at: np.ndarray     # born host: ip bytes then port, born_len bytes (8 or 20)
    born_len: np.ndarray
    store_at: np.ndarray
    store_len: np.ndarray
    body_at: np.ndarray
    body_len: np.ndarray
    topic_at: np.ndarray
    topic_len: np.ndarray
    props_at: np.ndarray
    props_len: np.ndarray


def _be(u8: np.ndarray, at: np.ndarray, width: int, kind: str = "i") -> np.ndarray:
    """Big-endian integers of *width* bytes at offsets *at* of *u8*, as int64."""
    return u8[at[:, None] + _AR[width]].view(f">{kind}{width}")[:, 0].astype(np.int64)


def _first_bad(ok: np.ndarray) -> int:
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else len(ok)


def _decode(data: bytes, starts: list[int], start: int, base: int) -> tuple[Batch, int]:
    """The batch of the records at *starts* of *data* (complete records whose TOTALSIZE and magic were
    checked), cut before the first record that fails a check; and the index of that record (or len)."""
    u8 = np.frombuffer(data, np.uint8)
    s = np.asarray(starts, np.int64)
    total = _be(u8, s, 4)
    v2 = _be(u8, s + 4, 4) == cl.MAGIC_V2
    sys_flag = _be(u8, s + cl.SYSFLAG_POSITION, 4)
    bh = np.where(sys_flag & _V6[0], 20, 8)
    sh = np.where(sys_flag & _V6[1], 20, 8)
    body_off = 72 + bh + sh
    tl = np.where(v2, 2, 1)
    ok = total >= body_off + tl + 2
    body_len = np.where(ok, _be(u8, s + np.where(ok, body_off - 4, 0), 4), 0)
    tl_off = body_off + body_len
    ok &= (body_len >= 0) & (tl_off + tl + 2 <= total)
    tl_at = s + np.where(ok, tl_off, 0)
    topic_len = np.where(v2, _be(u8, tl_at, 2), _be(u8, tl_at, 1))
    pl_off = tl_off + tl + topic_len
    ok &= (topic_len >= 0) & (pl_off + 2 <= total)
    props_len = _be(u8, s + np.where(ok, pl_off, 0), 2)
    ok &= (props_len >= 0) & (pl_off + 2 + props_len == total)
    phys = _be(u8, s + 28, 8)
    ok &= phys == base + start + s
    cut = _first_bad(ok)
    body_at = s + body_off
    crc = _be(u8, s + 8, 4)
    mv = memoryview(data)
    got = np.fromiter((zlib.crc32(mv[a:a + n]) for a, n in zip(body_at[:cut].tolist(), body_len[:cut].tolist())),
                      np.int64, cut) & 0x7FFFFFFF
    cut = _first_bad(got == crc[:cut])
    k = slice(0, cut)
    b48 = s[k] + 48
    store_at = b48 + bh[k]  # STORETIMESTAMP, then the store host
    batch = Batch(
        data=data, n=cut, total=total[k], body_crc=crc[k].astype(np.int32), queue_id=_be(u8, s[k] + 12, 4),
        flag=_be(u8, s[k] + 16, 4), queue_offset=_be(u8, s[k] + 20, 8), phys=phys[k], sys_flag=sys_flag[k],
        born_ts=_be(u8, s[k] + 40, 8), store_ts=_be(u8, store_at, 8), reconsume=_be(u8, store_at + 8 + sh[k], 4),
        born_at=b48, born_len=bh[k], store_at=store_at + 8, store_len=sh[k], body_at=body_at[k],
        body_len=body_len[k], topic_at=tl_at[k] + tl[k], topic_len=topic_len[k], props_at=s[k] + pl_off[k] + 2,
        props_len=props_len[k])
    return batch, cut


def batches(blocks: Iterable[bytes], name: str, size: int, dledger: bool = False) -> Iterator[Batch]:
    """The checked message records of a sealed segment whose content arrives in *blocks*, in batches of about
    BATCH_BYTES, in segment order; raises ArchiveError as :func:`records` does, after yielding the records
    before the bad one. Reads exactly the blocks :func:`records` reads (none after the BLANK's header).
    *dledger*: the segment is a DLedger data file, whose records are the bodies of its entries."""
    base = name_to_offset(name)
    skip = dl.BODY_OFFSET if dledger else 0  # where the record starts in an entry
    acc = bytearray()
    start = 0      # segment position of acc[0]
    pos = 0        # next record in acc
    starts: list[int] = []
    done = False
    err: ArchiveError | None = None
    it = iter(blocks)
    while not done and err is None:
        try:
            acc += next(it)
        except StopIteration:
            n = len(acc)
            err = (_ends_before_blank(name, start + n) if n - pos < 8
                   else _ends_inside(name, start + n, start + pos, _II.unpack_from(acc, pos)[0]))
        n = len(acc)
        while err is None and n - pos >= 8:  # follow the TOTALSIZE chain as far as the content goes
            at = start + pos
            try:
                total, magic = (_entry_head(name, acc, pos, at, size, base) if dledger
                                else _head(name, acc, pos, at, size))
                if magic == cl.BLANK_MAGIC:
                    done = True
                    break
                if n - pos < total:
                    break
                if dledger:
                    _check_entry(name, acc, pos, at, total, base)
            except ArchiveError as e:
                err = e
                break
            starts.append(pos + skip)
            pos += total
        if pos >= BATCH_BYTES or done or err is not None:
            with memoryview(acc) as whole:
                data = bytes(whole[:pos])  # one copy (acc[:pos] would be a second)
            del acc[:pos]
            if starts:
                batch, cut = _decode(data, starts, start, base)
                if batch.n:
                    yield batch
                if cut < len(starts):  # the record-by-record rules say what is wrong with it
                    p = starts[cut]
                    total, magic = _II.unpack_from(data, p)
                    what = "dledger" if dledger else "commitlog"
                    try:
                        check_record(data, p, start + p, total, magic, base, name)
                    except ArchiveError as e:
                        raise ArchiveError(str(e).replace("commitlog/", f"{what}/", 1)) from None
                    raise ArchiveError(f"{what}/{name}: record at position {start + p} is invalid")
            start += pos
            pos = 0
            starts = []
    if err is not None:
        raise err
