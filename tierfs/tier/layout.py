"""Object key layout (DESIGN §6). Pure: a catalog entry's identity in, object keys out.

Segment content is split into chunk objects so every ranged GET stays small and cheap on any server:
    <store-id>/seg/<relative path>/<generation>.<raw|lz4c>/<chunk number, 6 digits>
The object store adds its own bucket prefix (s3://BUCKET/PREFIX).
"""

from __future__ import annotations


def chunk_key(store_id: str, rel_path: str, generation: int, fmt: str, chunk_no: int) -> str:
    return f"{store_id}/seg/{rel_path}/{generation}.{fmt}/{chunk_no:06d}"


def chunk_keys(store_id: str, rel_path: str, generation: int, fmt: str, size: int, chunk_bytes: int) -> list[str]:
    n = max(-(-size // chunk_bytes), 1)
    return [chunk_key(store_id, rel_path, generation, fmt, i) for i in range(n)]


def segment_prefix(store_id: str) -> str:
    return f"{store_id}/seg/"
