"""The archive as a Delta Lake table (archive.format = "delta"): the driver's side, through delta-rs (`deltalake`).

Executors write each segment's rows as Parquet data files under the table's root (archive.archive_segment_table);
this module commits them. One table holds every topic of every store archiving into the same object store
(partitioned by topic and UTC date of the store time): `<store url>/tables/messages`.

Exactly once per broker group. A message's identity is (broker group, topic, queue id, queue offset); the master
and slaves of a group hold byte-identical CommitLog segments at the same offsets, so a segment is keyed by its
group and base name (archive.segment_base, the same on every replica), and its content by a digest of its
catalog crc32c's (archive.content_digest). It is committed with a Delta `txn` action whose appId names the
segment (`tierfs/<group>/commitlog~<base offset>`) and whose version is the digest, in the same commit as its data
files, so the table holds both or neither. Before writing, the driver asks the table for each segment's txn: the
same digest means the segment is archived (by this store in a job killed before its result, or by a replica), and
nothing is written; the commit checks again (delta-rs refuses a commit racing another txn of the same appId, and
the commit is retried against the new version), so two replicas archiving at once still commit one copy. Files
written by a job killed before its commit are not in the table (readers see only committed files) and the re-run
writes the same file names again.

Different content under the same key (a new generation of the segment in this store, or a replica whose segment
an unclean election rewrote) replaces the table's files of the segment in the same commit (remove actions): the
table holds one content per segment, the last committed, never both (no row doubled). The replaced digest is in
the result row (`replaced_digest`) and the daemon logs it. After an unclean election the truncated replica
rewrites its segment to the surviving master's bytes, so the last content to be archived is the group's.

Retention (expire): rows whose date is older than archive.retention_days go by a Delta delete, and the files it
removed by a vacuum once they were unreferenced for archive.vacuum_grace_hours (readers of an older version keep
theirs meanwhile). The table lives outside the mount's catalog, so the reference authority (tier/references.py)
never sees its files: they are deleted only by Delta's vacuum, the table's own authority; a segment deleted by
its broker keeps its rows.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterable

from tierfs.spark.archive import arrow_schema, parse_table_file, safe_name, segment_base

__all__ = ["TABLE_PREFIX", "PARTITION_BY", "TableSpec", "app_id", "table_schema", "held", "commit",
           "Committed", "LostRace", "attempt_commit", "superseded", "expire"]

TABLE_PREFIX = "tables/messages/"  # the table's root, as an object key prefix below the store's URL
PARTITION_BY = ["topic", "date"]


@dataclass(frozen=True)
class TableSpec:
    uri: str                      # file:///... or s3://bucket/prefix/tables/messages
    storage_options: dict[str, str]

    @classmethod
    def of_store(cls, url: str, options: dict[str, Any]) -> "TableSpec":
        """The table beside a store's objects, with delta-rs storage options from the store's open_store options."""
        root = url.rstrip("/")
        uri = f"{root}/{TABLE_PREFIX.rstrip('/')}"
        if urllib.parse.urlsplit(root).scheme.lower() != "s3":
            return cls(uri, {})
        so: dict[str, str] = {}
        ep = options.get("endpoint_url")
        if ep:
            so["AWS_ENDPOINT_URL"] = ep
            if ep.startswith("http://"):
                so["AWS_ALLOW_HTTP"] = "true"
        for opt, key in (("access_key", "AWS_ACCESS_KEY_ID"), ("secret_key", "AWS_SECRET_ACCESS_KEY"),
                         ("region", "AWS_REGION")):
            if options.get(opt):
                so[key] = str(options[opt])
        so.setdefault("AWS_REGION", "us-east-1")
        if options.get("addressing", "path") == "path":
            so["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false"
        # commits are put-if-absent on the log object (S3's If-None-Match), never a rename
        so["AWS_CONDITIONAL_PUT"] = "etag"
        return cls(uri, so)


def app_id(group: str, path: str) -> str:
    """The Delta txn appId of a segment of a broker group (the same on each of its replicas)."""
    return f"tierfs/{group}/{segment_base(path)}"


def table_schema():
    """The table's schema: the data files' columns, then the partition columns."""
    import pyarrow as pa

    s = arrow_schema(table=True)
    return pa.schema(list(s) + [pa.field("topic", pa.string()), pa.field("date", pa.date32())])


def _open(spec: TableSpec):
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return DeltaTable(spec.uri, storage_options=spec.storage_options or None)
    except TableNotFoundError:
        return None


def held(spec: TableSpec, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], int | None]:
    """The content digest the table holds for each (group, segment path): None when not archived (or no table)."""
    dt = _open(spec)
    return {k: (None if dt is None else dt.transaction_version(app_id(*k))) for k in keys}


@dataclass
class Committed:
    version: int                        # the table version of the commit (or later), -1 when nothing committed
    raced: list[str]                    # paths a replica committed with the same content meanwhile: not added
    replaced: dict[str, int]            # path -> digest of the content its commit replaced


class LostRace(Exception):
    """A commit lost to another writer's commit of the same segment (or of the table's creation): look again."""


def commit(spec: TableSpec, store_id: str, rows: list[dict], attempts: int = 8) -> Committed:
    """Commit the data files of these archive[] rows (archive_segment_table: `group`, `digest`, `files`) and their
    segments' txn actions in one Delta transaction, removing the files of other content of the same segments.
    Rows whose segment the table meanwhile holds with the same content are left out (`raced`). A commit that lost
    a race (LostRace) is tried again against the new version. Raises whatever delta-rs raises otherwise (nothing
    is committed then)."""
    for attempt in range(attempts):
        try:
            return attempt_commit(_open(spec), spec, store_id, rows)
        except LostRace as e:
            if attempt + 1 == attempts:
                raise e.__cause__ or e
    raise AssertionError("unreachable")


def attempt_commit(dt, spec: TableSpec, store_id: str, rows: list[dict]) -> Committed:
    """One try of commit() against the table version `dt` (None: no table yet). Raises LostRace when a commit of
    the same segment's txn (delta-rs' conflict check), or the table's creation, got in first since `dt`."""
    from deltalake import Schema
    from deltalake.transaction import (AddAction, CommitProperties, RemoveAction, Transaction,
                                       create_table_with_add_actions)

    now = int(time.time() * 1000)
    have = {row["path"]: (None if dt is None else dt.transaction_version(app_id(row["group"], row["path"])))
            for row in rows}
    raced = [row["path"] for row in rows if have[row["path"]] == int(row["digest"])]
    todo = [row for row in rows if row["path"] not in raced]
    if not todo:
        return Committed(-1 if dt is None else int(dt.version()), raced, {})
    adds = [AddAction(f["path"], int(f["size"]), {"topic": f["topic"], "date": f["date"]}, now, True,
                      json.dumps(f["stats"], separators=(",", ":")))
            for row in todo for f in row["files"]]
    txns = [Transaction(app_id(row["group"], row["path"]), int(row["digest"]), now) for row in todo]
    meta = {"tierfs.store_id": store_id, "tierfs.segments": {row["path"]: int(row["generation"]) for row in todo}}
    replaced = {row["path"]: have[row["path"]] for row in todo if have[row["path"]] is not None}
    schema = Schema.from_arrow(table_schema())
    if dt is None:
        # version 0 or nothing: a create that lost the race must not be retried as version 1 (delta-rs would,
        # without checking the txn actions)
        first = CommitProperties(custom_metadata=meta, app_transactions=txns, max_commit_retries=0)
        try:
            create_table_with_add_actions(spec.uri, schema, adds, mode="error", partition_by=PARTITION_BY,
                                          name="messages", storage_options=spec.storage_options or None,
                                          commit_properties=first)
        except Exception as e:  # noqa: BLE001 - another store created it meanwhile?
            if _open(spec) is None:
                raise
            raise LostRace() from e
        return Committed(0, raced, replaced)
    props = CommitProperties(custom_metadata=meta, app_transactions=txns, max_commit_retries=20)
    removes = [RemoveAction(p, True, now) for p in superseded(dt.get_add_actions().column("path").to_pylist(), todo)]
    try:
        dt.create_write_transaction([*adds, *removes], mode="append", schema=schema, partition_by=PARTITION_BY,
                                    commit_properties=props)
    except Exception as e:  # noqa: BLE001 - delta-rs retries other writers' commits; a txn of ours it refuses
        if type(e).__name__ == "CommitFailedError" and "oncurrent transaction" in str(e):
            raise LostRace() from e
        raise
    dt.update_incremental()  # the version this commit made, or a later one if another store committed since
    return Committed(int(dt.version()), raced, replaced)


def superseded(paths: Iterable[str], rows: list[dict]) -> list[str]:
    """Files of the table holding other content of a segment these rows archive (same group and base name,
    another digest: an older generation, or a replica's diverged copy). Pure."""
    new = {(safe_name(row["group"]), safe_name(segment_base(row["path"]))): int(row["digest"]) for row in rows}
    out = []
    for p in paths:
        k = parse_table_file(str(p))
        if k is not None and (k[0], k[1]) in new and k[2] != new[(k[0], k[1])]:
            out.append(str(p))
    return out


def expire(spec: TableSpec, cutoff: _dt.date, grace_hours: float) -> dict:
    """Retention: delete the rows dated before `cutoff` (whole date partitions: their files are removed, none
    rewritten), then vacuum the files unreferenced for at least `grace_hours` (those of earlier deletes and
    replaced content, and files of jobs killed before their commit). Vacuum is the only deleter of table files.
    Returns what was done; no table: nothing."""
    dt = _open(spec)
    if dt is None:
        return {"deleted_rows": 0, "removed_files": 0, "vacuumed_files": 0}
    m = dt.delete(f"date < '{cutoff.isoformat()}'")
    gone = dt.vacuum(retention_hours=int(grace_hours), enforce_retention_duration=False, dry_run=False)
    return {"deleted_rows": int(m.get("num_deleted_rows") or 0), "removed_files": int(m.get("num_removed_files") or 0),
            "vacuumed_files": len(gone)}
