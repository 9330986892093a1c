"""The ``lz4c`` object format (DESIGN §6): lz4 blocks + footer table + fixed trailer. Pure: bytes in, values out.

Layout of one object::

    [block 0][block 1]...[block n-1][footer: n entries of 24 bytes][trailer: 44 bytes]

Block i holds uncompressed bytes ``[i*block_bytes, i*block_bytes + ulen)`` (only the last may be shorter), as
``lz4.block.compress(data, store_size=False)``, or stored raw (flag bit 0) when lz4 does not make it smaller.
Footer entry: compressed offset u64, compressed length u32, uncompressed length u32, flags u32, crc32c of the
uncompressed block u32. Trailer: magic, block_bytes u32, block count u32, uncompressed size u64, footer offset u64,
footer length u32, footer crc32c u32, crc32c of the whole uncompressed content u32. All little-endian.

Any byte range of the content is served by reading the trailer and footer once (cacheable), then one ranged read
of the covering blocks (:func:`block_range` -> :func:`block_span` -> :func:`decode_blocks`). Every parse checks what
it can (magic, sizes, crcs, contiguity) and raises :class:`Lz4cError` naming the part that is wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import crc32c as _crc32c
import lz4.block

__all__ = [
    "MAGIC", "TRAILER_SIZE", "ENTRY_SIZE", "FLAG_RAW", "MAX_BLOCK_BYTES", "Lz4cError", "Lz4cWriter", "Trailer",
    "Footer", "ObjectMissing", "RangedStore", "parse_trailer", "parse_footer", "read_footer", "read_object_footer",
    "block_span", "block_range", "decode_blocks", "encode", "decode",
]

MAGIC = b"TLZ4C\0\0\1"
_TRAILER = struct.Struct("<8sIIQQIII")
_ENTRY = struct.Struct("<QIIII")
TRAILER_SIZE = _TRAILER.size  # 44
ENTRY_SIZE = _ENTRY.size  # 24
FLAG_RAW = 1
# lz4's own input limit is LZ4_MAX_INPUT_SIZE (0x7E000000); a block is also a unit of cache and fetch, so far
# smaller in practice. One GiB keeps every length a u32 with room to spare.
MAX_BLOCK_BYTES = 1 << 30
_TAIL_READ = 64 << 10  # read_footer's first read: the trailer plus, usually, the whole footer


class Lz4cError(ValueError):
    """An lz4c object (or a part of one) is malformed or corrupt; the message says which part and how."""


def _crc(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def _check_block_bytes(block_bytes: object) -> int:
    if type(block_bytes) is not int or not 0 < block_bytes <= MAX_BLOCK_BYTES:
        raise ValueError(f"block_bytes {block_bytes!r} must be an integer from 1 to {MAX_BLOCK_BYTES}")
    return block_bytes


# ------------------------------------------------------------------------------------------------ writer


class Lz4cWriter:
    """Streaming encoder: feed content with :meth:`add` in pieces of any length, append what each call returns,
    then append :meth:`finish`. Holds at most one block of pending input, so a 1 GiB segment is never in memory.

    After :meth:`finish`: ``size`` (uncompressed bytes), ``content_crc32c`` (of the whole uncompressed content)
    and ``compressed_size`` (bytes of the whole object: blocks + footer + trailer) are valid.
    """

    def __init__(self, block_bytes: int):
        self.block_bytes = _check_block_bytes(block_bytes)
        self._pending = bytearray()
        self._entries: list[bytes] = []
        self._off = 0  # compressed bytes emitted so far
        self._finished = False
        self.size = 0
        self.content_crc32c = 0
        self.compressed_size = 0

    def add(self, data: bytes | bytearray | memoryview) -> bytes:
        """Take uncompressed bytes; return the compressed bytes of every block they completed (maybe b'')."""
        if self._finished:
            raise ValueError("Lz4cWriter.add after finish")
        mv = memoryview(data).cast("B")
        bb = self.block_bytes
        out: list[bytes] = []
        pos = 0
        if self._pending:
            take = min(bb - len(self._pending), len(mv))
            self._pending += mv[:take]
            pos = take
            if len(self._pending) == bb:
                out.append(self._block(self._pending))
                self._pending = bytearray()
        end = len(mv)
        while end - pos >= bb:
            out.append(self._block(mv[pos:pos + bb]))
            pos += bb
        if pos < end:
            self._pending += mv[pos:]
        return out[0] if len(out) == 1 else b"".join(out)

    def finish(self) -> bytes:
        """The last (short) block, if any, then the footer and the trailer."""
        if self._finished:
            raise ValueError("Lz4cWriter.finish called twice")
        tail = self._block(self._pending) if self._pending else b""
        self._pending = bytearray()
        self._finished = True
        footer = b"".join(self._entries)
        trailer = _TRAILER.pack(MAGIC, self.block_bytes, len(self._entries), self.size, self._off, len(footer),
                                _crc(footer), self.content_crc32c)
        self.compressed_size = self._off + len(footer) + len(trailer)
        return b"".join((tail, footer, trailer))

    def _block(self, block) -> bytes:
        ulen = len(block)
        crc = _crc(block)
        self.content_crc32c = _crc(block, self.content_crc32c)
        comp = lz4.block.compress(block, store_size=False)
        flags = 0
        if len(comp) >= ulen:
            comp, flags = bytes(block), FLAG_RAW
        self._entries.append(_ENTRY.pack(self._off, len(comp), ulen, flags, crc))
        self._off += len(comp)
        self.size += ulen
        return comp


def encode(content: bytes | bytearray | memoryview, block_bytes: int) -> bytes:
    """The whole lz4c object for *content* (convenience over :class:`Lz4cWriter`)."""
    w = Lz4cWriter(block_bytes)
    return w.add(content) + w.finish()


# ------------------------------------------------------------------------------------------------ reader


@dataclass(frozen=True)
class Trailer:
    block_bytes: int
    nblocks: int
    size: int
    footer_offset: int
    footer_length: int
    footer_crc32c: int
    content_crc32c: int

    @property
    def object_size(self) -> int:
        """Size of the whole object this trailer ends."""
        return self.footer_offset + self.footer_length + TRAILER_SIZE


@dataclass(frozen=True)
class Footer:
    trailer: Trailer
    coff: list[int]
    clen: list[int]
    ulen: list[int]
    flags: list[int]
    crcs: list[int]

    @property
    def nblocks(self) -> int:
        return self.trailer.nblocks


def parse_trailer(b: bytes | bytearray | memoryview, object_size: int | None = None) -> Trailer:
    """Decode the trailer from the last :data:`TRAILER_SIZE` bytes of *b* (the trailer itself, or any tail of the
    object). With *object_size*, also check that the trailer describes an object of exactly that size."""
    if len(b) < TRAILER_SIZE:
        raise Lz4cError(f"lz4c trailer: need {TRAILER_SIZE} bytes, got {len(b)}")
    magic, block_bytes, nblocks, size, foff, flen, fcrc, ccrc = _TRAILER.unpack_from(b, len(b) - TRAILER_SIZE)
    if magic != MAGIC:
        raise Lz4cError(f"lz4c trailer: bad magic {magic!r} (expected {MAGIC!r}): not an lz4c object or truncated")
    if not 0 < block_bytes <= MAX_BLOCK_BYTES:
        raise Lz4cError(f"lz4c trailer: block_bytes {block_bytes} is out of range 1..{MAX_BLOCK_BYTES}")
    if nblocks != -(-size // block_bytes):
        raise Lz4cError(f"lz4c trailer: block count {nblocks} does not fit size {size} with block_bytes "
                        f"{block_bytes} (expected {-(-size // block_bytes)})")
    if flen != nblocks * ENTRY_SIZE:
        raise Lz4cError(f"lz4c trailer: footer length {flen} is not {nblocks} blocks x {ENTRY_SIZE} bytes")
    if not nblocks <= foff <= size:
        # Every block is at least 1 byte and never larger than its input (incompressible blocks are stored raw).
        raise Lz4cError(f"lz4c trailer: footer offset {foff} is impossible for {nblocks} blocks of {size} bytes")
    t = Trailer(block_bytes, nblocks, size, foff, flen, fcrc, ccrc)
    if object_size is not None and t.object_size != object_size:
        raise Lz4cError(f"lz4c trailer: footer at {foff} + {flen} bytes + trailer {TRAILER_SIZE} = {t.object_size} "
                        f"bytes, but the object is {object_size} bytes")
    return t


def parse_footer(trailer: Trailer, b: bytes | bytearray | memoryview) -> Footer:
    """Decode and check the footer (exactly ``trailer.footer_length`` bytes): its crc32c, that blocks are
    contiguous from offset 0 up to the footer, each block's uncompressed length, flags, and raw-block lengths."""
    if len(b) != trailer.footer_length:
        raise Lz4cError(f"lz4c footer: got {len(b)} bytes, the trailer says {trailer.footer_length}")
    crc = _crc(b)
    if crc != trailer.footer_crc32c:
        raise Lz4cError(f"lz4c footer: crc32c mismatch (computed {crc:08x}, trailer says {trailer.footer_crc32c:08x})")
    n = trailer.nblocks
    cols = list(zip(*_ENTRY.iter_unpack(b))) if n else [(), (), (), (), ()]
    coff, clen, ulen, flags, crcs = (list(c) for c in cols)
    bb, size = trailer.block_bytes, trailer.size
    pos = 0
    for i in range(n):
        want = min(bb, size - i * bb)
        if ulen[i] != want:
            raise Lz4cError(f"lz4c footer: block {i} has uncompressed length {ulen[i]}, expected {want}")
        if coff[i] != pos:
            raise Lz4cError(f"lz4c footer: block {i} starts at {coff[i]}, expected {pos} (blocks are contiguous)")
        if flags[i] & ~FLAG_RAW:
            raise Lz4cError(f"lz4c footer: block {i} has unknown flags {flags[i]:#x}")
        if flags[i] & FLAG_RAW and clen[i] != ulen[i]:
            raise Lz4cError(f"lz4c footer: raw block {i} is {clen[i]} bytes, expected {ulen[i]}")
        if clen[i] == 0:
            raise Lz4cError(f"lz4c footer: block {i} has compressed length 0")
        pos += clen[i]
    if pos != trailer.footer_offset:
        raise Lz4cError(f"lz4c footer: blocks end at {pos} but the footer starts at {trailer.footer_offset}")
    return Footer(trailer, coff, clen, ulen, flags, crcs)


def read_footer(read: Callable[[int, int], bytes], object_size: int) -> Footer:
    """Trailer and footer of an object of *object_size* bytes through ``read(offset, length)`` (a ranged GET):
    one read of the object's tail, a second only when the footer is larger than that tail."""
    if object_size < TRAILER_SIZE:
        raise Lz4cError(f"lz4c object is {object_size} bytes, smaller than its {TRAILER_SIZE}-byte trailer")
    n = min(object_size, _TAIL_READ)
    tail = read(object_size - n, n)
    if len(tail) != n:
        raise Lz4cError(f"lz4c object: read of the last {n} bytes returned {len(tail)}")
    t = parse_trailer(tail, object_size)
    rel = t.footer_offset - (object_size - n)
    if rel >= 0:
        return parse_footer(t, memoryview(tail)[rel:rel + t.footer_length])
    return parse_footer(t, read(t.footer_offset, t.footer_length))


class ObjectMissing(LookupError):
    """read_object_footer: the store has no object under the key (not a malformed object: no Lz4cError)."""


class RangedStore(Protocol):
    """What read_object_footer needs of an object store (tierfs.objectstore.ObjectStore has it)."""

    def head(self, key: str) -> Any: ...  # an object with .size, or None when there is no such object

    def get_range(self, key: str, start: int, length: int) -> bytes: ...


def read_object_footer(store: RangedStore, key: str) -> Footer:
    """Trailer and footer of the lz4c object *key* of an object store: a HEAD for its size, then
    :func:`read_footer` (one ranged GET of the tail, a second only for a footer larger than that tail).
    Raises :class:`ObjectMissing` when the HEAD finds no object, Lz4cError when the object is malformed."""
    info = store.head(key)
    if info is None:
        raise ObjectMissing(f"lz4c object {key!r} does not exist")
    return read_footer(lambda off, n: store.get_range(key, off, n), info.size)


def _check_blocks(f: Footer, first: int, n: int) -> None:
    if type(first) is not int or type(n) is not int or first < 0 or n < 0 or first + n > f.trailer.nblocks:
        raise ValueError(f"lz4c: blocks [{first}, {first}+{n}) are outside [0, {f.trailer.nblocks})")


def block_span(f: Footer, first: int, n: int) -> tuple[int, int]:
    """``(offset, length)`` in the object of the compressed bytes of blocks ``[first, first+n)``."""
    _check_blocks(f, first, n)
    if n == 0:
        return (f.coff[first] if first < f.trailer.nblocks else f.trailer.footer_offset), 0
    last = first + n - 1
    return f.coff[first], f.coff[last] + f.clen[last] - f.coff[first]


def block_range(f: Footer, offset: int, length: int) -> tuple[int, int]:
    """``(first, n)``: the blocks covering uncompressed bytes ``[offset, offset+length)`` (clipped to the size)."""
    if offset < 0 or length < 0:
        raise ValueError(f"lz4c: invalid range offset={offset} length={length}")
    end = min(offset + length, f.trailer.size)
    if offset >= end:
        return min(offset // f.trailer.block_bytes, f.trailer.nblocks), 0
    bb = f.trailer.block_bytes
    return offset // bb, (end - 1) // bb - offset // bb + 1


def decode_blocks(f: Footer, first: int, n: int, data: bytes | bytearray | memoryview) -> bytes:
    """Uncompressed content of blocks ``[first, first+n)`` from *data* (exactly the bytes of
    :func:`block_span`), each block checked against its crc32c."""
    off, length = block_span(f, first, n)
    if len(data) != length:
        raise Lz4cError(f"lz4c: blocks {first}..{first + n - 1}: got {len(data)} bytes, expected {length} "
                        f"(object bytes [{off}, {off + length}))")
    mv = memoryview(data).cast("B")
    parts: list = []
    for i in range(first, first + n):
        rel = f.coff[i] - off
        piece = mv[rel:rel + f.clen[i]]
        ulen = f.ulen[i]
        if f.flags[i] & FLAG_RAW:
            out = piece
        else:
            try:
                out = lz4.block.decompress(piece, uncompressed_size=ulen)
            except lz4.block.LZ4BlockError as e:
                raise Lz4cError(f"lz4c: block {i} does not decompress (corrupt): {e}") from None
            if len(out) != ulen:
                raise Lz4cError(f"lz4c: block {i} decompresses to {len(out)} bytes, expected {ulen}")
        crc = _crc(out)
        if crc != f.crcs[i]:
            raise Lz4cError(f"lz4c: block {i} crc32c mismatch (computed {crc:08x}, footer says {f.crcs[i]:08x})")
        parts.append(out)
    if len(parts) == 1 and isinstance(parts[0], bytes):
        return parts[0]
    return b"".join(parts)


def decode(obj: bytes | bytearray | memoryview) -> bytes:
    """The whole content of an lz4c object held in memory, every crc checked (tests and verification)."""
    mv = memoryview(obj).cast("B")
    t = parse_trailer(mv[-TRAILER_SIZE:] if len(mv) >= TRAILER_SIZE else mv, len(mv))
    f = parse_footer(t, mv[t.footer_offset:t.footer_offset + t.footer_length])
    content = decode_blocks(f, 0, t.nblocks, mv[:t.footer_offset])
    crc = _crc(content)
    if crc != t.content_crc32c:
        raise Lz4cError(f"lz4c: content crc32c mismatch (computed {crc:08x}, trailer says {t.content_crc32c:08x})")
    return content
