"""The archive as a Delta Lake table (archive.format = "delta"): the driver's side, through delta-rs (`deltalake`).

Executors write each segment's rows as Parquet data files under the table's root (archive.archive_segment_table);
this module commits them. One table holds every topic of every store archiving into the same object store
(partitioned by topic and UTC date of the store time): `<store url>/tables/messages`.

Exactly once. A segment generation (store id, generation; generations are never reused within a store) is
committed with a Delta `txn` action whose appId names it (`tierfs/<store-id>/g<generation>`), in the same commit as
its data files, so the table holds both or neither. Before writing, the driver asks the table which of the job's
generations it already holds (a job killed after its commit but before its result is re-run by the daemon) and
skips them; files written by a job killed before its commit are not in the table (readers see only committed
files) and the re-run writes the same file names again. A rewrite to lz4c keeps the generation, so it is never
archived twice; a new generation of the same segment (its content was written again) replaces the older
generation's files in the same commit (remove actions), so no message is in the table twice.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterable

from tierfs.spark.archive import arrow_schema, parse_table_file, safe_name

__all__ = ["TABLE_PREFIX", "PARTITION_BY", "TableSpec", "app_id", "table_schema", "committed", "commit"]

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


def app_id(store_id: str, generation: int) -> str:
    """The Delta txn appId that records a segment generation as archived."""
    return f"tierfs/{store_id}/g{generation}"


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


def committed(spec: TableSpec, store_id: str, generations: Iterable[int]) -> set[int]:
    """The generations of store_id that the table already holds (none when there is no table yet)."""
    dt = _open(spec)
    if dt is None:
        return set()
    return {g for g in generations if dt.transaction_version(app_id(store_id, g)) is not None}


def commit(spec: TableSpec, store_id: str, rows: list[dict]) -> int:
    """Commit the data files of these archive[] rows (archive_segment_table) and their generations' txn actions
    in one Delta transaction; older generations' files of the same segments go in the same commit. Returns the
    table's version once committed. Raises whatever delta-rs raises (nothing is committed then)."""
    from deltalake import Schema
    from deltalake.transaction import (AddAction, CommitProperties, RemoveAction, Transaction,
                                       create_table_with_add_actions)

    now = int(time.time() * 1000)
    adds = [AddAction(f["path"], int(f["size"]), {"topic": f["topic"], "date": f["date"]}, now, True,
                      json.dumps(f["stats"], separators=(",", ":")))
            for row in rows for f in row["files"]]
    txns = [Transaction(app_id(store_id, int(row["generation"])), int(row["generation"]), now) for row in rows]
    meta = {"tierfs.store_id": store_id,
            "tierfs.segments": {row["path"]: int(row["generation"]) for row in rows}}
    props = CommitProperties(custom_metadata=meta, app_transactions=txns, max_commit_retries=20)
    schema = Schema.from_arrow(table_schema())
    dt = _open(spec)
    if dt is None:
        try:
            create_table_with_add_actions(spec.uri, schema, adds, mode="append", partition_by=PARTITION_BY,
                                          name="messages", storage_options=spec.storage_options or None,
                                          commit_properties=props)
            return 0
        except Exception:  # noqa: BLE001 - another store created it meanwhile: append to it as below
            dt = _open(spec)
            if dt is None:
                raise
    removes = [RemoveAction(p, True, now) for p in superseded(dt.get_add_actions().column("path").to_pylist(),
                                                              store_id, rows)]
    dt.create_write_transaction([*adds, *removes], mode="append", schema=schema, partition_by=PARTITION_BY,
                                commit_properties=props)
    dt.update_incremental()  # the version this commit made, or a later one if another store committed since
    return int(dt.version())


def superseded(paths: Iterable[str], store_id: str, rows: list[dict]) -> list[str]:
    """Files of the table holding an older generation of a segment that these rows archive (a newer one is a
    later writer's, after a takeover: never removed here). Pure."""
    from tierfs.spark.archive import part_name

    new = {(safe_name(store_id), safe_name(part_name(row["path"]))): int(row["generation"]) for row in rows}
    out = []
    for p in paths:
        k = parse_table_file(str(p))
        if k is not None and (k[0], k[1]) in new and k[2] < new[(k[0], k[1])]:
            out.append(str(p))
    return out
