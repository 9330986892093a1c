"""The daemon's side of the Spark pipeline (DESIGN §6, §10): pick work, run the job, verify and swap.

The Spark job runs as a child process (`python -m tierfs.spark --job-dir DIR`, or spark-submit) so no JVM lives in
the FUSE daemon. It only writes new objects and `DIR/result.json`; nothing the mount serves changes until this
module has checked every result against the catalog (the decompressed lz4c content must have the catalog's
crc32c, block by block) and swapped the catalog row in one transaction. Replaced objects are deleted after
`delete.grace_seconds`, so reads in flight never break.

Crash safety: a job dir with a result.json and no applied.json is applied again at start-up; applying is
idempotent (a row already swapped, or changed since, is skipped). A job killed midway leaves no result.json.

Job directories live in HOT/.tierfs/jobs/<job id>/: input.json (0600: store credentials), progress.jsonl,
result.json, applied.json, job.log. `tierfs compact` asks for a run by dropping a request file in
HOT/.tierfs/compaction/requests/ and then follows the job's directory.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c
import trio

from tierfs import failpoints
from tierfs.config import parse_retention
from tierfs.objectstore import ObjectStore
from tierfs.store import cidx
from tierfs.store import brokeridentity
from tierfs.store.paths import MESSAGE_LOGS, Kind, split_root
from tierfs.tier import layout, lz4c
from tierfs.tier.catalog import Artifact, Entry, State

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.compaction")

STAGES = ("segments", "index", "archive")
KEEP_JOB_DIRS = 20
EXPIRY_PERIOD = 3600.0  # the archive table's retention runs at most this often (and at the daemon's first job)
VERIFY_BATCH_BLOCKS = 16


def new_job_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def jobs_dir(state_dir: Path) -> Path:
    return state_dir / "jobs"


def requests_dir(state_dir: Path) -> Path:
    return state_dir / "compaction" / "requests"


def write_json_atomic(path: Path, obj: dict, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def request_job(state_dir: Path, stages: list[str], spark: dict[str, str], min_age_seconds: float) -> str:
    """What `tierfs compact` does: queue a request the daemon picks up within a second; returns the job id."""
    job_id = new_job_id()
    d = requests_dir(state_dir)
    for part in (d.parent, d):  # private like the rest of the state dir, whatever the caller's umask
        part.mkdir(mode=0o700, exist_ok=True)
    write_json_atomic(d / f"{job_id}.json", {"job_id": job_id, "stages": stages, "spark": spark,
                                              "min_age_seconds": min_age_seconds}, mode=0o600)
    return job_id


async def hold_outputs(eng: Engine, job_id: str, inp: dict) -> None:
    """Register the objects the job may write with the reference authority before it starts, so none is deleted
    while it runs and none leaks when it fails, is killed or its result is skipped (released in run_job)."""
    sid = inp["store_id"]
    keys = [layout.lz4c_key(sid, r["path"], r["generation"]) for r in inp["segments"]]
    keys += [layout.cidx_key(sid, r["path"], r["generation"]) for r in inp["indexes"]]
    await eng.db(eng.references.hold, f"job:{job_id}", keys)


def seg_record(e: Entry) -> dict:
    return {"path": e.path, "file_id": e.file_id, "kind": e.kind, "generation": e.generation, "size": e.size, "format": e.format,
            "chunk_bytes": e.chunk_bytes, "block_bytes": e.block_bytes, "crc32c": e.crc32c,
            "block_crcs": e.block_crcs, "objects": e.objects}


def verify_lz4c(store: ObjectStore, key: str, e: Entry) -> lz4c.Footer:
    """Blocking: the object's decompressed content must be the catalog's, block by block and as a whole."""
    footer = lz4c.read_object_footer(store, key)
    t = footer.trailer
    if t.size != e.size or t.block_bytes != e.block_bytes or t.nblocks != e.nblocks:
        raise lz4c.Lz4cError(f"{key}: shape {t.size} bytes / {t.nblocks} blocks of {t.block_bytes} does not match "
                             f"the catalog's {e.size} / {e.nblocks} of {e.block_bytes}")
    if list(footer.crcs) != list(e.block_crcs):
        bad = next(i for i, (a, b) in enumerate(zip(footer.crcs, e.block_crcs)) if a != b)
        raise lz4c.Lz4cError(f"{key}: block {bad} crc32c differs from the catalog's")
    crc = 0
    for first in range(0, e.nblocks, VERIFY_BATCH_BLOCKS):
        n = min(VERIFY_BATCH_BLOCKS, e.nblocks - first)
        off, length = lz4c.block_span(footer, first, n)
        crc = crc32c.crc32c(lz4c.decode_blocks(footer, first, n, store.get_range(key, off, length)), crc)
    if crc != e.crc32c or t.content_crc32c != e.crc32c:
        raise lz4c.Lz4cError(f"{key}: content crc32c {crc:08x} differs from the catalog's {e.crc32c:08x}")
    return footer


def verify_sidecar(store: ObjectStore, key: str, size: int, crc: int) -> bytes:
    """Blocking: the whole sidecar must have the size and crc32c the job reported and a sound header; returns
    the header, kept in the catalog so a look-up needs no GET for it."""
    data = store.get(key)
    if len(data) != size or crc32c.crc32c(data) != crc:
        raise ValueError(f"{key}: {len(data)} bytes with crc32c {crc32c.crc32c(data):08x}, expected {size} bytes "
                         f"with {crc:08x}")
    header = cidx.parse_header(data[:cidx.HEADER_SIZE])
    if header.size != size:
        raise ValueError(f"{key}: the header describes {header.size} bytes, the object has {size}")
    return bytes(data[:cidx.HEADER_SIZE])


@dataclass
class Job:
    job_id: str
    stages: list[str]
    dir: Path
    started: float = field(default_factory=time.time)
    trigger: str = "schedule"


class Compactor:
    """Schedules pipeline jobs (one at a time), runs them as child processes, and applies their results."""

    def __init__(self, engine: "Engine"):
        self.eng = engine
        self.config = engine.config
        self.jobs = jobs_dir(engine.state_dir)
        self.requests = requests_dir(engine.state_dir)
        self.running: Job | None = None
        self._lock = trio.Lock()
        self._archived: set[tuple[str, int]] | None = None  # (path, generation) of archived segments (catalog)
        self._archive_job_seconds = 0.0  # how long the last job archiving anything took (freshness scheduling)
        self._fresh_not_before = 0.0
        self._expired_at: float | None = None
        # archive.catalog: not known to be registered (at start, or after a failed registration): the next archive
        # job registers the table, and runs even with nothing to archive; once registered, jobs leave it alone
        self._catalog_pending = True
        self.last_archive_lag: float | None = None  # worst seal-to-table lag of the last job's segments

    # ------------------------------------------------------------------ loops

    async def run(self) -> None:
        self.jobs.mkdir(exist_ok=True)
        await self._recover()
        await self.archived()
        interval = float(self.config["compaction.interval_seconds"])
        next_scheduled = time.monotonic() + interval
        while True:
            if not self.eng.store_writable():  # no writer lease: the job's objects and swaps must wait
                await trio.sleep(1.0)
                continue
            for req in sorted(self.requests.glob("*.json")) if self.requests.is_dir() else []:
                await self._run_request(req)
            stages = [s.strip() for s in self.config["compaction.stages"].split(",") if s.strip()]
            if self.config["compaction.enabled"] and time.monotonic() >= next_scheduled:
                await self.run_job(new_job_id(), stages, {}, float(self.config["compaction.min_age_seconds"]),
                                   "schedule")
                next_scheduled = time.monotonic() + interval
            elif self.config["compaction.enabled"] and "archive" in stages and await self._archive_due():
                summary = await self.run_job(new_job_id(), ["archive"], {}, 0.0, "freshness")
                self._fresh_not_before = time.monotonic() + (1.0 if summary.get("ok") else
                                                              max(5.0, self._max_lag() / 2))
            await trio.sleep(1.0)

    # ------------------------------------------------------------------ archive freshness

    def _max_lag(self) -> float:
        return float(self.config["archive.max_lag_seconds"])

    async def archived(self) -> set[tuple[str, int]]:
        """(path, generation) of every segment the catalog records as archived (cached; jobs add to it)."""
        if self._archived is None:
            arts = await self.eng.db(self.eng.catalog.artifacts, "archive")
            self._archived = {(a.path, a.generation) for a in arts}
        return self._archived

    def archive_lag(self, tiered_only: bool = False) -> float | None:
        """Age (since its last write, which is before its seal) of the oldest sealed message log not archived yet;
        0 when none waits, None before the archived set is loaded. `tiered_only`: of those the archive can read
        already."""
        done = self._archived
        if done is None:
            return None
        oldest = min((e.mtime_ns for e in list(self.eng.entries.values())
                      if e.kind in MESSAGE_LOGS and e.state is not State.HOT
                      and (not tiered_only or e.state is State.TIERED) and (e.path, e.generation) not in done),
                     default=None)
        return 0.0 if oldest is None else max(0.0, time.time() - oldest / 1e9)

    async def _archive_due(self) -> bool:
        """archive.max_lag_seconds: an archive-only job is due when the oldest archivable segment is half the limit
        old, or earlier by twice the last archiving job's duration when that leaves less."""
        limit = self._max_lag()
        if limit <= 0 or time.monotonic() < self._fresh_not_before:
            return False
        await self.archived()
        trigger = max(0.0, min(limit / 2, limit - 2 * self._archive_job_seconds))
        lag = self.archive_lag(tiered_only=True) or 0.0
        return lag > 0 and lag >= trigger

    async def _run_request(self, req: Path) -> None:
        try:
            r = json.loads(req.read_text())
            job_id = str(r["job_id"])
            stages = [s for s in r.get("stages") or STAGES if s in STAGES]
            spark = {str(k): str(v) for k, v in (r.get("spark") or {}).items() if str(k).startswith("spark.")}
            min_age = float(r.get("min_age_seconds", 0.0))
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.error("ignoring unreadable compaction request %s: %s", req, err)
            req.unlink(missing_ok=True)
            return
        req.unlink(missing_ok=True)
        await self.run_job(job_id, stages, spark, min_age, "request")

    async def _recover(self) -> None:
        """Apply results whose job finished before the daemon died (between manifest and swap)."""
        for d in sorted(p for p in self.jobs.iterdir() if p.is_dir()):
            if (d / "result.json").exists() and not (d / "applied.json").exists():
                log.info("applying the result of job %s left by an earlier daemon", d.name)
                await self._apply_dir(d)
        grace = float(self.config["delete.grace_seconds"])
        for holder in await self.eng.db(self.eng.catalog.holders, "job:"):  # jobs of an earlier daemon: done
            await self.eng.db(self.eng.references.release, holder, time.time() + grace)

    # ------------------------------------------------------------------ one job

    async def run_job(self, job_id: str, stages: list[str], spark: dict[str, str], min_age: float,
                      trigger: str) -> dict:
        async with self._lock:
            d = self.jobs / job_id
            d.mkdir(parents=True, exist_ok=True)
            job = self.running = Job(job_id, stages, d, trigger=trigger)
            try:
                inp = await self._build_input(job, spark, min_age)
                write_json_atomic(d / "input.json", inp, mode=0o600)
                n = len(inp["segments"]) + len(inp["indexes"]) + len(inp["commitlogs"])
                if n == 0 and not inp.get("table_expiry") and not inp.get("catalog"):
                    summary = {"job_id": job_id, "ok": True, "trigger": trigger, "stages": stages, "applied": {},
                               "skipped": [], "errors": [], "seconds": 0.0, "note": "nothing to do"}
                    write_json_atomic(d / "applied.json", summary)
                    return summary
                log.info("compaction job %s (%s): %d segments, %d index files, %d commitlogs", job_id,
                         ",".join(stages), len(inp["segments"]), len(inp["indexes"]), len(inp["commitlogs"]))
                await hold_outputs(self.eng, job_id, inp)
                rc = await self._run_child(d, inp)
                if not (d / "result.json").exists():
                    tail = _tail(d / "job.log")
                    summary = {"job_id": job_id, "ok": False, "trigger": trigger, "stages": stages, "applied": {},
                               "skipped": [], "errors": [{"stage": "job", "path": "",
                                                          "error": f"job exited {rc} without a result: {tail}"}],
                               "seconds": round(time.time() - job.started, 1)}
                    write_json_atomic(d / "applied.json", summary)
                    log.error("compaction job %s failed (exit %s): %s", job_id, rc, tail)
                    return summary
                summary = await self._apply_dir(d)
                if inp.get("table_expiry"):
                    self._expired_at = time.monotonic()
                if inp["commitlogs"]:
                    self._archive_job_seconds = time.time() - job.started
                return summary
            finally:
                self.running = None
                self._prune()
                with trio.CancelScope(shield=True):  # what no row took over is queued (the authority decides)
                    await self.eng.db(self.eng.references.release, f"job:{job_id}",
                                      time.time() + float(self.config["delete.grace_seconds"]))

    async def _build_input(self, job: Job, spark: dict[str, str], min_age: float) -> dict:
        eng = self.eng
        arts = await eng.db(eng.catalog.artifacts)
        have = {(a.path, a.kind, a.generation) for a in arts}
        cutoff = time.time() - min_age
        tiered = [e for e in eng.entries.values() if e.state is State.TIERED and e.state_since <= cutoff]
        tiered.sort(key=lambda e: (e.mtime_ns, e.path))
        conf = self.config.spark_conf()
        conf.update(spark)
        retention = parse_retention(self.config["archive.retention"])
        commitlogs = [seg_record(e) for e in tiered if "archive" in job.stages
                      and e.kind in MESSAGE_LOGS and (e.path, "archive", e.generation) not in have]
        if self.config["archive.format"] == "delta" and not self.config["archive.broker_name"]:
            names = {}
            for root in {split_root(c["path"])[0] for c in commitlogs}:
                names[root] = await trio.to_thread.run_sync(brokeridentity.broker_name, eng.hot / root)
            for c in commitlogs:
                if names[split_root(c["path"])[0]]:
                    c["broker"] = names[split_root(c["path"])[0]]
        days = float(self.config["archive.retention_days"])
        expiry = {}
        if "archive" in job.stages and self.config["archive.format"] == "delta" and days > 0 and \
                (self._expired_at is None or time.monotonic() - self._expired_at >= EXPIRY_PERIOD):
            expiry = {"retention_days": days, "vacuum_grace_hours": int(self.config["archive.vacuum_grace_hours"])}
        catalog = {}  # asked for only until a registration succeeded: a registered table needs no metastore call,
        # and a replica whose segments the table holds then starts no Spark just to register it again
        if "archive" in job.stages and self.config["archive.format"] == "delta" and \
                self.config["archive.catalog"] != "none" and self._catalog_pending:
            catalog = {"kind": self.config["archive.catalog"], "uri": self.config["archive.catalog_uri"],
                       "table": self.config["archive.catalog_table"]}
        return {
            "job_id": job.job_id,
            "trigger": job.trigger,
            "stages": job.stages,
            "store": {"url": eng.store_url(), "options": eng.store_options()},
            "store_id": eng.store_id,
            "posix_shared": bool(self.config["objectstore.posix_shared"]),
            "archive_format": self.config["archive.format"],
            "broker": self.config["archive.broker_name"],
            "spark": conf,
            "segments": [seg_record(e) for e in tiered if "segments" in job.stages and e.format == "raw"],
            "indexes": [seg_record(e) for e in tiered if "index" in job.stages and e.kind == Kind.INDEX.value
                        and (e.path, "cidx", e.generation) not in have],
            "commitlogs": commitlogs,
            "table_expiry": expiry,
            "catalog": catalog,
            "max_hash_slot_num": int(self.config["broker.max_hash_slot_num"]),
            "max_index_num": int(self.config["broker.max_index_num"]),
            "retention": retention,
            "today": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
        }

    def _command(self, d: Path) -> list[str]:
        submit = self.config["compaction.spark_submit"]
        if not submit:
            return [sys.executable, "-P", "-m", "tierfs.spark", "--job-dir", str(d)]  # -P: no cwd on sys.path
        main = Path(__file__).resolve().parent.parent / "spark" / "__main__.py"
        return [submit, "--master", self.config["spark.master"], str(main), "--job-dir", str(d)]

    async def _run_child(self, d: Path, inp: dict) -> int | None:
        env = dict(os.environ)
        env.setdefault("PYSPARK_PYTHON", sys.executable)
        env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        # the daemon's failpoints are not the job's; tests arm the job's through TIERFS_JOB_FAILPOINTS
        env.pop("TIERFS_FAILPOINTS", None)
        if os.environ.get("TIERFS_JOB_FAILPOINTS"):
            env["TIERFS_FAILPOINTS"] = os.environ["TIERFS_JOB_FAILPOINTS"]
        with open(d / "job.log", "ab") as logf:
            proc = await trio.lowlevel.open_process(self._command(d), stdin=subprocess.DEVNULL, stdout=logf,
                                                    stderr=logf, env=env, start_new_session=True, cwd=d)
            try:
                return await proc.wait()
            finally:
                if proc.returncode is None:  # cancelled (daemon stopping): take the JVM down with the job
                    with trio.CancelScope(shield=True):
                        _signal_group(proc.pid, signal.SIGTERM)
                        with trio.move_on_after(5):
                            await proc.wait()
                        _signal_group(proc.pid, signal.SIGKILL)
                        await proc.wait()

    # ------------------------------------------------------------------ apply a result

    async def _apply_dir(self, d: Path) -> dict:
        result = json.loads((d / "result.json").read_text())
        inp = json.loads((d / "input.json").read_text())
        # a result row names a segment by path and generation; the file is found by the id the input named for
        # that generation (generations are never reused), whatever its name is now
        fids = {int(r["generation"]): int(r["file_id"]) for k in ("segments", "indexes", "commitlogs")
                for r in inp.get(k) or [] if "file_id" in r}
        t0 = time.time()
        await failpoints.pause("compaction.before_swap")  # tests: "sleep:S" lets the mount run meanwhile
        applied = {"segments": 0, "indexes": 0, "archive": 0}
        skipped: list[dict] = []
        errors = list(result.get("errors") or [])
        grace = float(self.config["delete.grace_seconds"])
        eng = self.eng
        for row in result.get("segments") or []:
            why = await self._apply_segment(row, self._entry_of(row, fids), grace)
            if why is None:
                applied["segments"] += 1
            elif why == "skipped":
                skipped.append({"stage": "segments", "path": row["path"], "error": "changed since the job read it"})
            else:
                errors.append({"stage": "segments", "path": row["path"], "error": why})
        arts: list[Artifact] = []
        for row in result.get("indexes") or []:
            e = self._entry_of(row, fids)
            if e is None or e.state is not State.TIERED:
                skipped.append({"stage": "index", "path": row["path"], "error": "changed since the job read it"})
                continue
            try:
                header = await eng.io(verify_sidecar, eng.store, row["key"], int(row["bytes"]), int(row["crc32c"]))
            except Exception as err:  # noqa: BLE001 - any failure means: do not use this sidecar
                errors.append({"stage": "index", "path": row["path"], "error": f"sidecar rejected: {err}"})
                continue
            arts.append(Artifact(e.path, "cidx", row["generation"], [row["key"]],
                                 {"bytes": row["bytes"], "crc32c": row["crc32c"], "header": header.hex()}))
        for row in result.get("archive") or []:
            e = self._entry_of(row, fids)  # renamed since: the artifact follows the file (gone: its last name)
            arts.append(Artifact(e.path if e is not None else row["path"], "archive", row["generation"],
                                 list(row.get("keys") or []),
                                 {"rows": row.get("rows", 0), "bytes": row.get("bytes", 0)}))
        lags = []
        for row in result.get("archive") or []:
            e = self._entry_of(row, fids)
            if e is not None:
                lags.append(time.time() - e.mtime_ns / 1e9)
            if row.get("replaced_digest") is not None:
                log.warning("archive table: %s (generation %s) replaced other content of the same segment of broker "
                            "group %s (digest %016x -> %016x): a replica's segment diverged (unclean election?) or "
                            "was rewritten", row["path"], row["generation"], row.get("group"),
                            int(row["replaced_digest"]), int(row.get("digest", 0)))
        if lags:
            self.last_archive_lag = round(max(lags), 3)
        if arts:
            new_cidx = {a.path: a for a in arts if a.kind == "cidx"}
            old = await eng.db(eng.catalog.artifacts, "cidx")
            replaced = [k for a in old if a.path in new_cidx for k in a.keys if k not in new_cidx[a.path].keys]
            await eng.db(eng.catalog.put_many, [], replaced, time.time() + grace, arts)
            applied["indexes"] = sum(a.kind == "cidx" for a in arts)
            applied["archive"] = sum(a.kind == "archive" for a in arts)
            if self._archived is not None:
                self._archived.update((a.path, a.generation) for a in arts if a.kind == "archive")
        summary = {"job_id": result.get("job_id", d.name), "ok": bool(result.get("ok", True)) and not errors,
                   "stages": result.get("stages"), "applied": applied, "skipped": skipped, "errors": errors,
                   "seconds": result.get("seconds"),
                   "apply_seconds": round(time.time() - t0, 2),
                   "bytes_in": sum(r.get("size", 0) for r in result.get("segments") or []),
                   "bytes_out": sum(r.get("compressed_bytes", 0) for r in result.get("segments") or []),
                   "archive_rows": sum(r.get("rows", 0) for r in result.get("archive") or []),
                   "archive_deleted": len(result.get("archive_deleted") or []),
                   "table_expiry": result.get("table_expiry"), "catalog": result.get("catalog")}
        cat = result.get("catalog")
        if cat is not None:  # archive.catalog: a failed registration makes the next archive job run, to retry it
            self._catalog_pending = bool(cat.get("error"))
            if cat.get("error"):
                log.warning("archive table not registered in the catalog (the next archive job retries): %s",
                            cat["error"])
        write_json_atomic(d / "applied.json", summary)
        log.info("compaction job %s applied: %s; %d skipped, %d errors", summary["job_id"], applied,
                 len(summary["skipped"]), len(summary["errors"]))
        return summary

    def _entry_of(self, row: dict, fids: dict[int, int]) -> Entry | None:
        """The live entry of the file a result row is about, if it is still at the row's generation."""
        fid = fids.get(int(row["generation"]))
        e = self.eng.files.get(fid) if fid is not None else None
        return e if e is not None and e.generation == row["generation"] else None

    async def _apply_segment(self, row: dict, e: Entry | None, grace: float) -> str | None:
        """Verify one lz4c object against the catalog and swap the entry `e`. None when swapped, else why not."""
        eng = self.eng
        if e is not None and e.format == "lz4c" and e.objects == [row["key"]]:
            return None  # swapped by an earlier attempt at this result
        if e is None or e.state is not State.TIERED or e.generation != row["generation"] or e.format != "raw":
            return "skipped"
        try:
            footer = await eng.io(verify_lz4c, eng.store, row["key"], e)
        except Exception as err:  # noqa: BLE001 - a bad object is reported, never swapped in
            log.error("compacted object %s of %s rejected: %s", row["key"], e.path, err)
            return f"rejected: {err}"
        if not eng.is_live(e) or e.state is not State.TIERED or e.generation != row["generation"]:
            return "skipped"
        old_keys = e.all_objects()
        # the swapped row is a copy (no await between it and queueing the commit); memory follows the commit
        # (resident bits: none; the engine persists the live ones after an fdatasync, never ahead of the bytes)
        swapped = e.copy(format="lz4c", objects=[row["key"]], chunk_bytes=e.nblocks * e.block_bytes,
                          resident=bytearray(len(e.resident)), unit_bytes=0, unit_crcs=b"",
                         unit_ref="")  # lz4 blocks: no units (the table object goes with the raw chunks)
        if not await eng.db(eng.catalog.swap, swapped, old_keys, time.time() + grace):
            return "skipped"  # written (HOT again) while the swap waited: its compacted object goes
        eng.cache.footers[row["key"]] = footer
        if eng.is_live(e) and e.state is State.TIERED and e.generation == row["generation"]:
            eng.apply(e, e.copy(format=swapped.format, objects=swapped.objects, chunk_bytes=swapped.chunk_bytes,
                                unit_bytes=0, unit_crcs=b"", unit_ref=""))
            eng.evictor.residency_changed(e)
        return None

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        lag = self.archive_lag()
        out: dict = {"running": None, "last": [], "archive_lag_seconds": None if lag is None else round(lag, 3),
                     "archive_max_lag_seconds": self._max_lag(), "archive_last_lag_seconds": self.last_archive_lag}
        if self.running is not None:
            j = self.running
            per_stage = stage_progress(j.dir)
            current = next(reversed(per_stage), None)  # the stage the job started last
            out["running"] = {"job_id": j.job_id, "stages": j.stages, "trigger": j.trigger,
                              "seconds": round(time.time() - j.started, 1),
                              "done": sum(p["done"] for p in per_stage.values()),
                              "total": sum(p["total"] for p in per_stage.values()),
                              "stage": current, "progress": per_stage}
        done = sorted((p for p in self.jobs.glob("*") if (p / "applied.json").exists()), reverse=True)
        for d in done[:5]:
            try:
                out["last"].append(json.loads((d / "applied.json").read_text()))
            except (OSError, ValueError):
                continue
        useful = _last_useful(done)
        if useful is not None:
            out["last_useful"] = useful
        return out

    def _prune(self) -> None:
        """Keep the newest KEEP_JOB_DIRS jobs, and the newest one that applied something (scheduled runs with
        nothing to do must not push the last real result out of `status`)."""
        dirs = sorted(p for p in self.jobs.glob("*") if (p / "applied.json").exists())
        useful = _last_useful(dirs[::-1])
        keep = useful["job_id"] if useful else None
        for d in dirs[:-KEEP_JOB_DIRS]:
            if d.name != keep:
                shutil.rmtree(d, ignore_errors=True)


def _last_useful(newest_first: list[Path]) -> dict | None:
    """The summary of the newest job that applied anything (or failed), from job dirs newest first."""
    for d in newest_first:
        try:
            s = json.loads((d / "applied.json").read_text())
        except (OSError, ValueError):
            continue
        if any((s.get("applied") or {}).values()) or not s.get("ok", True):
            return s
    return None


def stage_progress(d: Path) -> dict[str, dict[str, int]]:
    """{stage: {"done", "failed", "total"}} from DIR/progress.jsonl, stages in the order the job started them."""
    out: dict[str, dict[str, int]] = {}
    try:
        with open(d / "progress.jsonl") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    s = out.setdefault(str(rec["stage"]), {"done": 0, "failed": 0, "total": 0})
                    if "total" in rec:
                        s["total"] = int(rec["total"])
                    else:
                        s["done"] += 1
                        s["failed"] += not rec.get("ok", False)
                except (ValueError, KeyError, TypeError):
                    continue  # a line being written
    except OSError:
        pass
    return out


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no job log)"
