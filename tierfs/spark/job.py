"""The Spark driver of the tierfs pipeline: `python -m tierfs.spark --job-dir DIR`.

Contract (docs: pipeline contract, DESIGN §10): the daemon writes DIR/input.json; this process runs the requested
stages in the fixed order segments, index, archive, with segments grouped into Spark tasks (plan_tasks); executors
open the object store themselves, so no segment bytes pass through the driver. Each stage's results stream back in completion order
(one job per partition of one RDD, submitted from a small thread pool), and the driver appends one line per
finished item to DIR/progress.jsonl. A failing item is an errors[] entry, not a job failure. DIR/result.json is
written last and atomically: a job killed midway leaves none, and the daemon then swaps nothing.

Exit status: 0 when the job ran (even with per-item errors), 2 for bad input (with a message naming what is
wrong), 1 when Spark itself could not run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tierfs import failpoints
from tierfs.spark import cds
from tierfs.store import indexfile
from tierfs.store.paths import Kind, classify

if TYPE_CHECKING:
    from tierfs.spark.catalog import CatalogSpec

STAGES = ("segments", "index", "archive")
ITEMS_KEY = {"segments": "segments", "index": "indexes", "archive": "commitlogs"}
RESULT_KEY = {"segments": "segments", "index": "indexes", "archive": "archive"}
INPUT = "input.json"
PROGRESS = "progress.jsonl"
RESULT = "result.json"
LOG4J = "spark-log4j2.properties"
SHARED_HINT = ("the posix object store is not visible to cluster executors; set objectstore.posix_shared=true if it "
               "is on shared storage")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
ARCHIVE_FORMATS = ("parquet", "delta")

_LOG4J_TEXT = """\
# Written by tierfs.spark: Spark logs warnings and errors only, on stderr.
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.nativeloader.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativeloader.level = error
"""


class InputError(ValueError):
    """input.json is missing or wrong; the message names the file and the field."""


# ---------------------------------------------------------------------------------------------------- input


@dataclass
class JobInput:
    job_dir: Path
    job_id: str
    stages: list[str]
    store: dict[str, Any]                 # {"url": ..., "options": {...}}
    store_id: str
    spark: dict[str, str]
    items: dict[str, list[dict]]          # stage -> SEGs
    max_hash_slot_num: int
    max_index_num: int
    retention: dict[str, float]
    today: _dt.date
    posix_shared: bool = False
    archive_format: str = "parquet"       # "parquet" (files per segment) | "delta" (the archive table)
    broker: str = ""                      # the broker name of the table's rows ("": unnamed, see archive.broker_group)
    table_retention_days: float = 0.0     # the table's rows older than this many days are expired (0: kept)
    vacuum_grace_hours: int = 168         # table files unreferenced this long are vacuumed
    catalog: CatalogSpec | None = None    # archive.catalog: register the table there
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def master(self) -> str:
        return self.spark["spark.master"]


def is_local_master(master: str) -> bool:
    """Masters whose executors run on this machine and so see the same file system."""
    m = master.strip()
    return m == "local" or m.startswith(("local[", "local-cluster["))


def load_input(job_dir: Path) -> JobInput:
    path = job_dir / INPUT
    where = str(path)
    if not job_dir.is_dir():
        raise InputError(f"job directory {str(job_dir)!r} does not exist or is not a directory")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{where} does not exist: the daemon writes it before starting the job") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{where} cannot be read: {e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{where} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{where} must hold a JSON object, not {type(doc).__name__}")
    return parse_input(doc, job_dir, where)


def _need(doc: dict, key: str, kind: type | tuple, where: str, what: str) -> Any:
    if key not in doc:
        raise InputError(f"{where}: {key!r} is missing ({what})")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(f"{where}: {key!r} must be {what}, not {json.dumps(value)[:80]}")
    return value


def parse_input(doc: dict, job_dir: Path, where: str) -> JobInput:
    job_id = _need(doc, "job_id", str, where, "a non-empty string")
    if not job_id.strip():
        raise InputError(f"{where}: 'job_id' must be a non-empty string")
    stages = _need(doc, "stages", list, where, f"a list of stage names ({', '.join(STAGES)})")
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise InputError(f"{where}: unknown stage(s) {', '.join(map(json.dumps, unknown))} in 'stages'; allowed: "
                         f"{', '.join(STAGES)}")
    store = _need(doc, "store", dict, where, 'an object {"url": ..., "options": {...}}')
    url = store.get("url")
    if not isinstance(url, str) or not url.strip():
        raise InputError(f"{where}: 'store.url' must be a file:///PATH or s3://BUCKET/PREFIX URL")
    options = store.get("options", {})
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise InputError(f"{where}: 'store.options' must be an object of open_store options")
    store_id = _need(doc, "store_id", str, where, "the store id (a non-empty string without '/')")
    if not store_id or "/" in store_id:
        raise InputError(f"{where}: 'store_id' {store_id!r} must be a non-empty string without '/'")
    spark_in = doc.get("spark") or {}
    if not isinstance(spark_in, dict):
        raise InputError(f"{where}: 'spark' must be an object of spark.* settings")
    spark: dict[str, str] = {}
    for k, v in spark_in.items():
        if not k.startswith("spark."):
            raise InputError(f"{where}: 'spark' key {k!r} is not a Spark setting (keys start with 'spark.')")
        if isinstance(v, (dict, list)) or v is None:
            raise InputError(f"{where}: 'spark' setting {k!r} must be a string, number or boolean")
        spark[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    spark.setdefault("spark.master", "local[*]")
    items: dict[str, list[dict]] = {}
    for stage in STAGES:
        key = ITEMS_KEY[stage]
        value = doc.get(key, [])
        if stage in stages and key not in doc:
            raise InputError(f"{where}: {key!r} is missing (the segments for stage {stage!r})")
        if not isinstance(value, list):
            raise InputError(f"{where}: {key!r} must be a list of segment entries")
        items[stage] = value
    limits = {}
    for key, default in (("max_hash_slot_num", indexfile.MAX_HASH_SLOT_NUM), ("max_index_num", indexfile.MAX_INDEX_NUM)):
        v = doc.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"{where}: {key!r} must be an integer >= 1, not {json.dumps(v)}")
        limits[key] = v
    retention_in = doc.get("retention") or {}
    if not isinstance(retention_in, dict):
        raise InputError(f"{where}: 'retention' must be an object of topic -> days ('*' for the default)")
    retention: dict[str, float] = {}
    for topic, days in retention_in.items():
        if not isinstance(days, (int, float)) or isinstance(days, bool) or not 0 <= days < math.inf:
            raise InputError(f"{where}: 'retention' of topic {topic!r} must be a number of days >= 0, "
                             f"not {json.dumps(days)}")
        retention[topic] = float(days)
    today_in = doc.get("today")
    if today_in is None:
        today = _dt.datetime.now(_dt.timezone.utc).date()
    else:
        try:
            today = _dt.date.fromisoformat(today_in)
        except (TypeError, ValueError):
            raise InputError(f"{where}: 'today' must be a date YYYY-MM-DD, not {json.dumps(today_in)}") from None
    posix_shared = doc.get("posix_shared", False)
    if not isinstance(posix_shared, bool):
        raise InputError(f"{where}: 'posix_shared' must be true or false")
    archive_format = doc.get("archive_format", "parquet")  # absent: what jobs wrote before the table existed
    if archive_format not in ARCHIVE_FORMATS:
        raise InputError(f"{where}: 'archive_format' must be one of {', '.join(ARCHIVE_FORMATS)}, not "
                         f"{json.dumps(archive_format)[:80]}")
    broker = doc.get("broker", "")
    if not isinstance(broker, str):
        raise InputError(f"{where}: 'broker' must be a string (the broker name of the archive table's rows)")
    expiry = doc.get("table_expiry") or {}
    days, grace = (expiry.get("retention_days", 0), expiry.get("vacuum_grace_hours", 168)) \
        if isinstance(expiry, dict) else (None, None)
    if not isinstance(days, (int, float)) or isinstance(days, bool) or not 0 <= days < math.inf \
            or not isinstance(grace, int) or isinstance(grace, bool) or grace < 0:
        raise InputError(f"{where}: 'table_expiry' must be an object with retention_days (a number >= 0) and "
                         f"vacuum_grace_hours (an integer >= 0), not {json.dumps(expiry)[:80]}")
    catalog = _parse_catalog(doc.get("catalog"), archive_format, where)
    inp = JobInput(job_dir=job_dir, job_id=job_id, stages=[s for s in STAGES if s in stages],
                   store={"url": url.strip(), "options": dict(options)}, store_id=store_id, spark=spark, items=items,
                   max_hash_slot_num=limits["max_hash_slot_num"], max_index_num=limits["max_index_num"],
                   retention=retention, today=today, posix_shared=posix_shared, archive_format=archive_format,
                   broker=broker.strip(), table_retention_days=float(days),
                   vacuum_grace_hours=grace, catalog=catalog, raw=doc)
    if inp.store["url"].lower().startswith("file:") and not is_local_master(inp.master) and not posix_shared:
        raise InputError(f"{where}: store {inp.store['url']!r} with spark.master {inp.master!r}: {SHARED_HINT}")
    return inp


def _parse_catalog(doc: Any, archive_format: str, where: str) -> CatalogSpec | None:
    """'catalog': {"kind": "hive", "uri": "thrift://...", "table": "db.t"} (archive.catalog*), or absent/none."""
    from tierfs.spark.catalog import CatalogSpec, check_table_name, check_uris

    if doc is None or (isinstance(doc, dict) and doc.get("kind", "none") == "none"):
        return None
    what = '{"kind": "hive", "uri": "thrift://HOST:PORT", "table": "DATABASE.TABLE"}'
    if not isinstance(doc, dict) or doc.get("kind") != "hive" or not all(
            isinstance(doc.get(k), str) for k in ("uri", "table")):
        raise InputError(f"{where}: 'catalog' must be {what} or absent, not {json.dumps(doc)[:80]}")
    why = check_uris(doc["uri"]) or check_table_name(doc["table"])
    if why:
        raise InputError(f"{where}: 'catalog': {why}")
    if archive_format != "delta":
        raise InputError(f"{where}: 'catalog' registers the Delta table: it needs 'archive_format' \"delta\"")
    return CatalogSpec("hive", doc["uri"].strip(), doc["table"])


def check_item(stage: str, seg: Any) -> str | None:
    """Why a segment entry cannot be processed, or None. Bad entries become errors[], not a failed job."""
    if not isinstance(seg, dict):
        return f"segment entry must be an object, not {json.dumps(seg)[:80]}"
    for key, kind, what in (("path", str, "a string"), ("generation", int, "an integer"),
                            ("size", int, "an integer"), ("format", str, "a string"), ("objects", list, "a list")):
        v = seg.get(key)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            return f"segment entry field {key!r} is missing or not {what}"
    if seg["format"] not in ("raw", "lz4c"):
        return f"segment entry format {seg['format']!r} is not raw or lz4c"
    if stage == "archive" and classify(seg["path"]) not in (Kind.COMMITLOG, Kind.DLEDGER_DATA):
        return f"the archive stage reads CommitLog segments (or DLedger data files) only, not {seg['path']!r}"
    return None


# ---------------------------------------------------------------------------------------------------- executor side

_STORES: dict[str, Any] = {}
_STORES_LOCK = threading.Lock()


def _store(spec: dict) -> Any:
    """One object store per executor Python worker and store spec (workers are reused across tasks)."""
    key = json.dumps(spec, sort_keys=True)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            from tierfs.objectstore import open_store

            store = _STORES[key] = open_store(spec["url"], **spec["options"])
        return store


@dataclass(frozen=True)
class StageParams:
    """Everything an executor needs for one stage: small, pickled into the task closure."""

    stage: str
    store: dict
    store_id: str
    max_hash_slot_num: int
    max_index_num: int
    retention: dict
    today: str
    archive_format: str = "parquet"
    broker: str = ""


def run_item(p: StageParams, seg: dict) -> dict:
    """Process one segment on an executor. Never raises: a failure is returned as {"ok": False, "error"}."""
    t0 = time.monotonic()
    try:
        failpoints.hit(f"spark.item.{p.stage}")  # tests: "raise" fails the item, "kill" crashes the worker
        store = _store(p.store)
        if p.stage == "segments":
            from tierfs.spark.tasks import compact_segment

            row = compact_segment(store, p.store_id, seg)
            bytes_in, bytes_out = int(seg["size"]), int(row.get("compressed_bytes", 0))
        elif p.stage == "index":
            from tierfs.spark.tasks import build_index_sidecar

            row = build_index_sidecar(store, p.store_id, seg, p.max_hash_slot_num, p.max_index_num)
            bytes_in, bytes_out = int(seg["size"]), int(row.get("bytes", 0))
        elif p.archive_format == "delta":
            from tierfs.spark.archive import archive_segment_table
            from tierfs.spark.table import TABLE_PREFIX

            row = archive_segment_table(store, p.store_id, seg, TABLE_PREFIX, seg.get("broker") or p.broker)
            bytes_in, bytes_out = int(row.pop("bytes_read")), int(row["bytes"])
        else:
            from tierfs.spark.archive import archive_segment

            row = archive_segment(store, p.store_id, seg, p.retention, _dt.date.fromisoformat(p.today))
            bytes_in, bytes_out = int(row.pop("bytes_read")), int(row["bytes"])
        return {"ok": True, "row": row, "bytes_in": bytes_in, "bytes_out": bytes_out,
                "seconds": round(time.monotonic() - t0, 3)}
    except Exception as e:  # noqa: BLE001 - every failure is reported per item
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": round(time.monotonic() - t0, 3)}


def _partition_runner(p: StageParams) -> Callable:
    def run(it):
        return [[run_item(p, seg) for seg in batch] for batch in it]
    return run


# ---------------------------------------------------------------------------------------------------- driver side


class Progress:
    """DIR/progress.jsonl: one JSON line per finished item, appended as items finish (O_APPEND, one write)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self.lock = threading.Lock()

    def write(self, line: dict) -> None:
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        with self.lock:
            os.write(self.fd, data)

    def close(self) -> None:
        os.close(self.fd)


def write_result(job_dir: Path, result: dict) -> None:
    """tmp + fsync + rename + directory fsync: the daemon sees the whole result or none."""
    tmp = job_dir / f".{RESULT}.tmp.{os.getpid()}"
    data = json.dumps(result, indent=1).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, job_dir / RESULT)
    dfd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# The driver JVM of a job lives for one job and does little work (scheduling; in local mode also moving small
# results between Python workers): the C1 compiler alone and the serial collector start it about 1.5 s sooner
# (6 -> 4.5 s on 2 cores) and spend less CPU on JIT during the stages. A job's own extraJavaOptions replace these.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_conf(inp: JobInput, cds_plan: cds.Plan | None = None) -> dict[str, str]:
    """The settings given to the SparkSession builder: quiet, quick-starting defaults, then every spark.* key of the
    input; the driver maps (or records) the class-data archive of *cds_plan*."""
    conf = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions": QUICK_JVM}
    if is_local_master(inp.master):
        conf["spark.driver.host"] = "127.0.0.1"
        conf["spark.driver.bindAddress"] = "127.0.0.1"
    conf.update(inp.spark)
    log4j = f"-Dlog4j2.configurationFile=file:{inp.job_dir.resolve() / LOG4J}"
    opts = conf.get("spark.driver.extraJavaOptions", "")
    if "log4j2.configurationFile" not in opts:
        opts = f"{opts} {log4j}".strip()
    if cds_plan is not None:
        opts = f"{opts} {cds_plan.java_options}"
    conf["spark.driver.extraJavaOptions"] = opts
    return conf


def start_session(inp: JobInput, cds_plan: cds.Plan | None = None):
    """SparkSession for the job (executors use this same Python unless PYSPARK_PYTHON says otherwise)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    executor_python = inp.spark.get("spark.pyspark.python")
    if executor_python:  # what spark-submit does with this key: PySpark takes the executors' Python from the env
        os.environ["PYSPARK_PYTHON"] = executor_python
    if is_local_master(inp.master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    (inp.job_dir / LOG4J).write_text(_LOG4J_TEXT)
    from pyspark.sql import SparkSession

    if cds_plan is not None and cds_plan.tmp is None:
        failpoints.hit("spark.session.cds")  # tests: a JVM that cannot start with the archive it maps
    builder = SparkSession.builder.appName(f"tierfs-{inp.job_id}")
    for k, v in spark_conf(inp, cds_plan).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    if not is_local_master(inp.master):
        _ship_package(spark.sparkContext, inp.job_dir)
    return spark


def _ship_package(sc, job_dir: Path) -> None:
    """Cluster executors may not have tierfs installed: send this checkout's package as a zip."""
    import zipfile

    pkg = Path(__file__).resolve().parent.parent
    zpath = job_dir / "tierfs-package.zip"
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(pkg.rglob("*.py")):
            z.write(f, f.relative_to(pkg.parent))
    sc.addPyFile(str(zpath))


def _warm_task(_: Any) -> list[int]:
    """Executor side of warm_up: load what every task needs once per Python worker."""
    import pyarrow.parquet  # noqa: F401 - the archive's writer, the slowest import

    import tierfs.spark.archive  # noqa: F401
    import tierfs.spark.tasks  # noqa: F401

    return [os.getpid()]


def warm_up(sc) -> None:
    """Start a Python worker on every executor core and import the task modules in it, as part of the session
    start: stage timings then measure the work, and the first tasks of a stage do not queue behind imports.
    Spark keeps idle Python workers for the next tasks (spark.python.worker.reuse, on by default)."""
    n = max(1, int(sc.defaultParallelism))
    sc.parallelize(range(n), n).mapPartitions(_warm_task).collect()


class SparkStartError(Exception):
    """Spark could not start (the message says why)."""


class Session:
    """The job's SparkSession, started (class-data archive, executor warm-up) when a stage first has segments to
    run: a job whose every segment the archive table already holds (a replica of the group archived them) starts
    no JVM, and costs a second instead of a Spark start."""

    def __init__(self, inp: JobInput):
        self.inp = inp
        self.spark = None
        self.cds_plan: cds.Plan | None = None
        self.startup = 0.0  # seconds the start took (0: not started)

    @property
    def sparkContext(self):
        if self.spark is None:
            self.spark = self._start()
        return self.spark.sparkContext

    def _start(self):
        t0 = time.monotonic()
        # the driver JVM is started here unless spark-submit started it (then it runs as that was configured)
        self.cds_plan = None if "PYSPARK_GATEWAY_PORT" in os.environ else \
            cds.plan({"spark.driver.extraJavaOptions": QUICK_JVM, **self.inp.spark})
        try:
            try:
                spark = start_session(self.inp, self.cds_plan)
            except Exception as e:  # noqa: BLE001 - a damaged archive must not stop every job: drop it, start again
                if self.cds_plan is None:
                    raise
                print(f"tierfs.spark: warning: Spark did not start with class-data archive {self.cds_plan.archive}, "
                      f"which is removed: {_spark_error(e)}", file=sys.stderr)
                cds.discard(self.cds_plan)
                self.cds_plan = None
                spark = start_session(self.inp, None)
        except Exception as e:  # noqa: BLE001
            raise SparkStartError(f"cannot start Spark (spark.master {self.inp.master!r}): {_spark_error(e)}") \
                from None
        try:
            warm_up(spark.sparkContext)
        except Exception as e:  # noqa: BLE001 - the stages then report what is wrong, item by item
            print(f"tierfs.spark: warning: executor warm-up failed: {_spark_error(e)}", file=sys.stderr)
        self.startup = time.monotonic() - t0
        return spark

    def stop(self) -> None:
        if self.spark is None:
            return
        self.spark.stop()
        from pyspark import SparkContext

        cds.publish(self.cds_plan, SparkContext)


def _spark_error(e: BaseException) -> str:
    """A short message for a task that failed inside Spark (worker crash, lost executor), not a Java trace."""
    text = str(getattr(e, "java_exception", None) or e)
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith(("at ", "..."))]
    return f"{type(e).__name__}: {' | '.join(lines[:3])[:1000]}"


@dataclass
class StageReport:
    items: int = 0
    failed: int = 0
    seconds: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    rows: int = 0


TASK_BYTES = 256 << 20  # segments are grouped into Spark tasks of about this much input ...
TASKS_PER_CORE = 2      # ... or less, so that every core gets this many tasks while there is enough work


def plan_tasks(sizes: list[int], cores: int) -> list[list[int]]:
    """Indexes of the segments grouped into tasks, in order: small segments (ConsumeQueue files, small stores)
    share a task so per-task costs do not dominate, a segment of TASK_BYTES or more is a task of its own, and
    the work is cut fine enough to keep `cores` busy."""
    per = max(1, min(TASK_BYTES, sum(sizes) // max(1, cores * TASKS_PER_CORE)))
    tasks: list[list[int]] = []
    cur: list[int] = []
    acc = 0
    for i, size in enumerate(sizes):
        if cur and acc + size > per:
            tasks.append(cur)
            cur, acc = [], 0
        cur.append(i)
        acc += size
    if cur:
        tasks.append(cur)
    return tasks


def run_stage(sc, stage: str, segs: list[dict], params: StageParams, progress: Progress,
              on_item: Callable[[dict, dict], None]) -> StageReport:
    """Segments grouped into tasks (plan_tasks); results handed to on_item(seg, outcome) and logged in
    completion order.

    One RDD with a partition per task; each partition runs as its own Spark job, submitted from as many driver
    threads as the cluster has cores, so results arrive as tasks finish (toLocalIterator would run the
    partitions one after another) while the scheduler keeps every core busy. A task that dies inside Spark
    (its worker crashed, retries exhausted) is an error for each of its segments.
    """
    report = StageReport(items=len(segs))
    t0 = time.monotonic()
    if segs:
        cores = max(1, int(sc.defaultParallelism))
        plan = plan_tasks([int(seg["size"]) for seg in segs], cores)
        rdd = sc.parallelize([[segs[i] for i in task] for task in plan], numSlices=len(plan))
        runner = _partition_runner(params)

        def one(t: int) -> list[dict]:
            return sc.runJob(rdd, runner, [t])[0]

        with concurrent.futures.ThreadPoolExecutor(min(len(plan), cores), thread_name_prefix=f"tierfs-{stage}") \
                as pool:
            futures = {pool.submit(one, t): task for t, task in enumerate(plan)}
            for fut in concurrent.futures.as_completed(futures):
                task = futures[fut]
                try:
                    outcomes = fut.result()
                except Exception as e:  # noqa: BLE001 - the task died inside Spark
                    outcomes = [{"ok": False, "error": _spark_error(e)}] * len(task)
                for i, outcome in zip(task, outcomes):
                    _item_done(stage, segs[i], outcome, report, progress, on_item)
    report.seconds = round(time.monotonic() - t0, 3)
    return report


def _item_done(stage: str, seg: dict, outcome: dict, report: StageReport, progress: Progress,
               on_item: Callable[[dict, dict], None]) -> None:
    report.bytes_in += outcome.get("bytes_in", 0)
    report.bytes_out += outcome.get("bytes_out", 0)
    report.failed += not outcome["ok"]
    if outcome["ok"]:
        report.rows += int(outcome["row"].get("rows", 0))
    on_item(seg, outcome)
    progress.write({"stage": stage, "path": seg["path"], "ok": outcome["ok"],
                    "bytes_in": outcome.get("bytes_in", 0), "bytes_out": outcome.get("bytes_out", 0),
                    "error": outcome.get("error"), "seconds": outcome.get("seconds")})


def run_job(inp: JobInput, spark, progress: Progress) -> dict:
    """The stages, in order. `spark`: a SparkSession or a Session, whose context is asked for only by a stage
    with segments to run."""
    from tierfs.tier.lease import last_holder

    t0 = time.monotonic()
    result: dict[str, Any] = {"job_id": inp.job_id, "ok": True, "seconds": 0.0, "segments": [], "indexes": [],
                              "archive": [], "archive_deleted": [], "archive_superseded": [], "errors": [],
                              "stages": {}}
    lease = last_holder(inp.job_dir.parent.parent, inp.store_id)  # the daemon's (jobs are in its state dir)
    for stage in inp.stages:
        params = StageParams(stage, inp.store, inp.store_id, inp.max_hash_slot_num, inp.max_index_num,
                             inp.retention, inp.today.isoformat(), inp.archive_format, inp.broker)
        table = stage == "archive" and inp.archive_format == "delta"
        progress.write({"stage": stage, "total": len(inp.items[stage])})
        good: list[dict] = []
        for seg in inp.items[stage]:
            why = check_item(stage, seg)
            if why is None:
                good.append(seg)
            else:
                path = seg.get("path") if isinstance(seg, dict) and isinstance(seg.get("path"), str) else ""
                result["errors"].append({"stage": stage, "path": path, "error": why})
                progress.write({"stage": stage, "path": path, "ok": False, "bytes_in": 0, "bytes_out": 0,
                                "error": why})

        pending: list[dict] = []  # table rows: in the result once their commit succeeded

        def on_item(seg: dict, outcome: dict, stage: str = stage) -> None:
            if outcome["ok"]:
                (pending if table else result[RESULT_KEY[stage]]).append(outcome["row"])
            else:
                result["errors"].append({"stage": stage, "path": seg["path"], "error": outcome["error"]})

        replicas: dict[str, list[dict]] = {}
        if table:
            good, replicas = _not_yet_in_table(inp, good, result)
        report = run_stage(spark.sparkContext if good else None, stage, good, params, progress, on_item)
        if table:
            _commit_table(inp, pending, replicas, result)
            if inp.table_retention_days > 0:
                _expire_table(inp, result)
            if inp.catalog is not None:
                _register_table(inp, spark, result)
        elif stage == "archive":
            _sweep(inp, result, lease)
        result["stages"][stage] = vars(report)
    result["ok"] = not result["errors"]
    result["seconds"] = round(time.monotonic() - t0, 3)
    return result


def _table_key(inp: JobInput, seg: dict) -> tuple[str, int]:
    """(broker group, content digest) of a segment (tierfs.spark.archive.broker_group, content_digest)."""
    from tierfs.spark.archive import broker_group, content_digest

    return broker_group(seg.get("broker") or inp.broker, inp.store_id, seg["path"])[1], content_digest(seg)


def _not_yet_in_table(inp: JobInput, segs: list[dict], result: dict) -> tuple[list[dict], dict[str, list[dict]]]:
    """The segments to write: those whose content the table does not hold for their broker group yet. Those it
    holds (archived by a job killed after its commit, or by a replica of the group) are archive[] rows again,
    marked `committed_before`, and are not written twice. Of several segments of one key in this job (the master
    and slave roots of one mount) one is written; the others (`replicas`: path written -> theirs) take its
    outcome, or wait for the next job when their content differs."""
    from tierfs.spark.archive import ArchiveError, segment_base
    from tierfs.spark.table import TableSpec, held

    spec = TableSpec.of_store(inp.store["url"], inp.store["options"])
    keyed: list[tuple[dict, str, int]] = []
    for seg in segs:
        try:
            group, digest = _table_key(inp, seg)
        except ArchiveError as e:
            result["errors"].append({"stage": "archive", "path": seg["path"], "error": str(e)})
            continue
        keyed.append((seg, group, digest))
    try:
        have = held(spec, {(g, seg["path"]) for seg, g, _ in keyed})
    except Exception as e:  # noqa: BLE001 - an unreadable table: every segment is an error, nothing is written
        for seg, _, _ in keyed:
            result["errors"].append({"stage": "archive", "path": seg["path"],
                                     "error": f"archive table {spec.uri} cannot be read: {type(e).__name__}: {e}"})
        return [], {}
    todo: list[dict] = []
    first: dict[tuple[str, str], tuple[dict, int]] = {}
    replicas: dict[str, list[dict]] = {}
    for seg, group, digest in keyed:
        if have[(group, seg["path"])] == digest:
            result["archive"].append(_skipped_row(seg, group, digest, committed_before=True))
            continue
        k = (group, segment_base(seg["path"]))
        if k not in first:
            first[k] = (seg, digest)
            todo.append(seg)
        elif first[k][1] == digest:
            replicas.setdefault(first[k][0]["path"], []).append(seg)
        else:
            print(f"tierfs.spark: {seg['path']} of broker group {group}: its content differs from "
                  f"{first[k][0]['path']} archived in this job; left for the next job", file=sys.stderr)
    return todo, replicas


def _skipped_row(seg: dict, group: str, digest: int, **flag: Any) -> dict:
    return {"path": seg["path"], "generation": int(seg["generation"]), "group": group, "digest": digest, "rows": 0,
            "keys": [], "bytes": 0, "expired_rows": 0, **flag}


def _commit_table(inp: JobInput, rows: list[dict], replicas: dict[str, list[dict]], result: dict) -> None:
    """One table transaction for every segment archived by this job (tierfs.spark.table.commit). A failed commit
    makes each of its segments (and their replicas in this job) an error (the daemon retries them; their written
    files are not in the table)."""
    from tierfs.spark.table import TableSpec, commit

    if not rows:
        return
    failpoints.hit("archive.table.before_commit")  # tests: "kill" between writing the files and the commit
    try:
        done = commit(TableSpec.of_store(inp.store["url"], inp.store["options"]), inp.store_id, rows)
    except Exception as e:  # noqa: BLE001 - reported per segment
        for row in rows:
            for seg in [row, *replicas.get(row["path"], [])]:
                result["errors"].append({"stage": "archive", "path": seg["path"],
                                         "error": f"archive table commit failed: {type(e).__name__}: {e}"})
        return
    failpoints.hit("archive.table.after_commit")  # tests: "kill" between the commit and the result
    for row in rows:
        if row["path"] in done.raced:  # a replica committed the same content first: its files are the table's
            result["archive"].append(_skipped_row(row, row["group"], row["digest"], committed_before=True))
        else:
            extra = {"replaced_digest": done.replaced[row["path"]]} if row["path"] in done.replaced else {}
            result["archive"].append(dict(row, table_version=done.version, **extra))
        for seg in replicas.get(row["path"], []):
            result["archive"].append(_skipped_row(seg, row["group"], row["digest"], replica_of=row["path"]))


def _expire_table(inp: JobInput, result: dict) -> None:
    """archive.retention_days of the table (tierfs.spark.table.expire): rows dated before today - days go."""
    from tierfs.spark.table import TableSpec, expire

    spec = TableSpec.of_store(inp.store["url"], inp.store["options"])
    cutoff = inp.today - _dt.timedelta(days=math.ceil(inp.table_retention_days))
    try:
        result["table_expiry"] = dict(expire(spec, cutoff, inp.vacuum_grace_hours), before=cutoff.isoformat())
    except Exception as e:  # noqa: BLE001 - reported, the rest of the job stands
        result["errors"].append({"stage": "archive", "path": spec.uri,
                                 "error": f"archive table expiry failed: {type(e).__name__}: {e}"})


def _register_table(inp: JobInput, spark, result: dict) -> None:
    """archive.catalog = hive (tierfs.spark.catalog.register), after the commit and apart from it: a failure is
    result["catalog"]["error"] and an errors[] entry, the committed table stands, the next job registers it. A
    table not created yet (nothing archived so far) is not registered."""
    from deltalake import DeltaTable

    from tierfs.spark.catalog import CatalogError, reader_location, register
    from tierfs.spark.table import TableSpec

    spec = TableSpec.of_store(inp.store["url"], inp.store["options"])
    cat = inp.catalog
    location = reader_location(spec.uri)
    out: dict[str, Any] = {"kind": cat.kind, "uri": cat.uri, "table": cat.table, "location": location,
                           "registered": False}
    result["catalog"] = out
    try:
        if not DeltaTable.is_deltatable(spec.uri, storage_options=spec.storage_options or None):
            out["note"] = "no table yet"
            return
        hive_conf = {k[len("spark.hadoop."):]: v for k, v in inp.spark.items() if k.startswith("spark.hadoop.hive.")}
        sc = spark.sparkContext  # registration needs the driver's JVM: a Session starts here if no stage did
        out.update(register(sc._jvm, cat, location, hive_conf, sc.version), registered=True)
    except Exception as e:  # noqa: BLE001 - reported; the table's commit stands
        conflict = isinstance(e, CatalogError)  # retrying cannot help: a setting (or the metastore) must change
        why = str(e) if conflict else _spark_error(e)
        out["error"] = why
        then = "refused" if conflict else "the next archive job retries"
        result["errors"].append({"stage": "archive", "path": cat.table,
                                 "error": f"archive table not registered as {cat.table} in the Hive Metastore "
                                          f"{cat.uri} (archive.catalog_uri); {then}: {why}"})
        print(f"tierfs.spark: warning: {result['errors'][-1]['error']}", file=sys.stderr)


def _sweep(inp: JobInput, result: dict, lease: dict | None) -> None:
    """Driver-side part of the archive stage: retention, and files of superseded generations. Its deletes are
    fenced by the writer lease the daemon held when the job started (`lease`, from the daemon's state dir, which
    holds the job dir): a mount taken over since must not delete what the new writer's archive holds (the same
    segment names, other generations). The executors' puts need no fence: a part is named by its segment and
    generation, and a takeover moves generations past the old writer's."""
    from tierfs.objectstore import open_store
    from tierfs.spark.archive import archive_prefix, part_name, sweep
    from tierfs.tier.lease import job_fence

    archived = {part_name(row["path"]): int(row["generation"]) for row in result["archive"]}
    try:
        store = open_store(inp.store["url"], **inp.store["options"])
        try:
            store.fence = job_fence(store, inp.store_id, lease)
            done = sweep(store, inp.store_id, inp.retention, inp.today, archived)
        finally:
            store.close()
    except Exception as e:  # noqa: BLE001 - reported, the rest of the job stands
        result["errors"].append({"stage": "archive", "path": archive_prefix(inp.store_id),
                                 "error": f"retention sweep failed: {type(e).__name__}: {e}"})
        return
    result["archive_deleted"] = done.expired
    result["archive_superseded"] = done.superseded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tierfs.spark",
                                 description="Run a tierfs pipeline job (lz4c compaction, index sidecars, "
                                             "Parquet archive) described by JOB_DIR/input.json.")
    ap.add_argument("--job-dir", required=True, type=Path, help="directory holding input.json (written by the daemon)")
    args = ap.parse_args(argv)
    job_dir: Path = args.job_dir
    try:
        inp = load_input(job_dir)
        # A bad store URL or option is bad input too: find out before starting a JVM.
        from tierfs.objectstore import open_store

        try:
            open_store(inp.store["url"], **inp.store["options"]).close()
        except ValueError as e:
            raise InputError(f"{job_dir / INPUT}: 'store': {e}") from None
    except InputError as e:
        print(f"tierfs.spark: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for stale in (job_dir / RESULT,):
        stale.unlink(missing_ok=True)  # a re-run in the same directory must not leave an old result behind
    progress = Progress(job_dir / PROGRESS)
    session = Session(inp)
    try:
        try:
            result = run_job(inp, session, progress)
            # the job's seconds are its stages' (the session's start is reported on its own)
            result["seconds"] = round(max(0.0, result["seconds"] - session.startup), 3)
            result["session_start_seconds"] = round(session.startup, 3)
            write_result(job_dir, result)
        except SparkStartError as e:
            print(f"tierfs.spark: error: {e}", file=sys.stderr)
            return EXIT_FAILED
        finally:
            session.stop()
    finally:
        progress.close()
    failed = len(result["errors"])
    started = f"session start {session.startup:.1f} s" if session.spark is not None else "no Spark session needed"
    print(f"tierfs.spark: job {inp.job_id} done in {result['seconds']:.1f} s ({started}); {failed} item error(s)",
          file=sys.stderr)
    return EXIT_OK
