"""Object key layout (DESIGN §6). Pure: a catalog entry's identity in, object keys out.

Segment content is split into chunk objects so every ranged GET stays small and cheap on any server:
    <store-id>/seg/<relative path>/<generation>.raw/<chunk number, 6 digits>
A compacted segment is one lz4c object (its blocks are the unit of ranged reads): <generation>.lz4c.
The object store adds its own bucket prefix (s3://BUCKET/PREFIX).

Content-addressed chunks (a broker group's replicas under one mount write byte-identical sealed segments):
    <store-id>/cas/<first 2 hex digits>/<sha256 of the chunk's bytes, hex>
named by their bytes, so identical chunks of two rows are one object, which the reference authority keeps while
any row names it (tierfs.tier.references). Per chunk, not per segment: the key is known as soon as the chunk is
read, so the upload hashes, holds and PUTs it in the one pass that reads the segment; a segment's verification
table (tierfs.tier.units) is content-addressed the same way. Which keys a row has is its `objects` list, written
when it is tiered: readers, the evictor, compaction, snapshots and fsck all read keys from there, never rederive
them, so rows of either kind (an old catalog's) keep working.

A broker group's replicas on separate mounts sharing one bucket (upload.dedup_group) share one namespace:
    groups/<group>/cas/<xx>/<sha256>            the chunk (or table) object
    groups/<group>/refs/<sha256>/<store-id>     one marker per mount whose rows name it (tierfs.tier.sharedrefs)
    groups/<group>/tomb/<sha256>                a deleter's tombstone while it decides to delete it
"""

from __future__ import annotations

import re


def chunk_key(store_id: str, rel_path: str, generation: int, fmt: str, chunk_no: int) -> str:
    return f"{store_id}/seg/{rel_path}/{generation}.{fmt}/{chunk_no:06d}"


def chunk_keys(store_id: str, rel_path: str, generation: int, fmt: str, size: int, chunk_bytes: int) -> list[str]:
    n = max(-(-size // chunk_bytes), 1)
    return [chunk_key(store_id, rel_path, generation, fmt, i) for i in range(n)]


def raw_chunk_of(block: int, chunk_bytes: int, block_bytes: int) -> tuple[int, int]:
    """(chunk number, byte offset inside that chunk object) of block `block` of a raw segment."""
    per = chunk_bytes // block_bytes
    return block // per, block % per * block_bytes


def raw_chunk_blocks(chunk_no: int, chunk_bytes: int, block_bytes: int, nblocks: int) -> range:
    """The blocks that chunk object `chunk_no` of a raw segment holds."""
    per = chunk_bytes // block_bytes
    return range(chunk_no * per, min((chunk_no + 1) * per, nblocks))


def segment_prefix(store_id: str) -> str:
    return f"{store_id}/seg/"


def lz4c_key(store_id: str, rel_path: str, generation: int) -> str:
    """The one lz4c object of a compacted segment (tierfs.tier.lz4c; blocks make chunking unnecessary)."""
    return f"{store_id}/seg/{rel_path}/{generation}.lz4c"


def cidx_key(store_id: str, rel_path: str, generation: int) -> str:
    """Compacted sidecar of an IndexFile (tierfs.store.cidx)."""
    return f"{store_id}/idx/{rel_path}/{generation}.cidx"


def archive_key(store_id: str, topic: str, date: str, rel_path: str, generation: int) -> str:
    """Parquet part of the messages of *topic* on *date* (YYYY-MM-DD) from one CommitLog segment: named after the
    segment (the file name of *rel_path*; a bare file name works too) and generation, so a re-run overwrites the
    part instead of duplicating it."""
    name = rel_path.rsplit("/", 1)[-1]
    return f"{store_id}/archive/topic={topic}/date={date}/part-{name}-g{generation}.parquet"


def archive_prefix(store_id: str) -> str:
    return f"{store_id}/archive/"


def cas_prefix(store_id: str) -> str:
    return f"{store_id}/cas/"


def cas_key(store_id: str, sha256_hex: str) -> str:
    """The content-addressed object holding bytes whose sha256 is `sha256_hex`."""
    return f"{store_id}/cas/{sha256_hex[:2]}/{sha256_hex}"


_CAS = re.compile(r"/cas/([0-9a-f]{2})/\1[0-9a-f]{62}$")


def is_cas(key: str) -> bool:
    """A content-addressed key (shared by every row whose content holds those bytes)."""
    return bool(_CAS.search(key))


def cas_store(key: str) -> str:
    """The store id a content-addressed key belongs to."""
    return key[:key.rindex("/cas/")]


def object_prefixes(store_id: str) -> tuple[str, str]:
    """Every prefix segment objects live under (per row and content-addressed): listings of what rows name."""
    return segment_prefix(store_id), cas_prefix(store_id)


GROUP_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def group_prefix(group: str) -> str:
    return f"groups/{group}/"


def group_cas_prefix(group: str) -> str:
    return f"groups/{group}/cas/"


def is_group_cas(key: str) -> bool:
    """A content-addressed key of a broker group's shared namespace (several mounts may name it)."""
    return key.startswith("groups/") and is_cas(key)


def cas_sha(key: str) -> str:
    """The sha256 (hex) a content-addressed key is named by."""
    return key.rsplit("/", 1)[1]
