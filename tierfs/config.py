"""One validated Config object from TOML plus `-o key=value` overrides.

Every key is declared once in `SCHEMA` with its type, default, allowed values and a one-line doc; the loader,
the `-o` parser, the README table (`tierfs config-doc`) and the redacted `/.tierfs/config` view all derive from it,
so a key cannot exist in one place and be missing in another.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping


class ConfigError(ValueError):
    """A configuration problem, worded for the operator: names the key, the value and what is allowed."""


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
               "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as '512MiB', '10GB', '4k'."""
    if isinstance(value, bool):
        raise ValueError("not a size")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError("not a size")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


def _parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("not a number")
    return float(value)


def _parse_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("not an integer")
    return int(value)


@dataclass(frozen=True)
class Key:
    """One configuration key: how to parse it, what it defaults to, and what is allowed."""

    name: str
    kind: str  # bool | int | float | size | str | path | choice
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    secret: bool = False

    def allowed(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        rng = ""
        if self.minimum is not None and self.maximum is not None:
            rng = f" from {self.minimum:g} to {self.maximum:g}"
        elif self.minimum is not None:
            rng = f" >= {self.minimum:g}"
        return {
            "bool": "true or false",
            "int": "an integer" + rng,
            "float": "a number" + rng,
            "size": "a byte size such as 1048576, '512MiB' or '10GB'" + rng,
            "str": "a string",
            "path": "an absolute path (or empty for the default)",
        }[self.kind]

    def parse(self, value: Any) -> Any:
        parsers: dict[str, Callable[[Any], Any]] = {
            "bool": _parse_bool, "int": _parse_int, "float": _parse_float, "size": parse_size,
            "str": str, "path": str, "choice": lambda v: str(v).strip().lower(),
        }
        try:
            out = parsers[self.kind](value)
        except (TypeError, ValueError):
            raise self.error(value) from None
        if isinstance(out, float) and not math.isfinite(out):
            raise self.error(value)
        if self.kind == "choice" and out not in self.choices:
            raise self.error(value)
        if self.kind == "path" and out and not out.startswith("/"):
            raise self.error(value)
        if self.minimum is not None and out < self.minimum:
            raise self.error(value)
        if self.maximum is not None and out > self.maximum:
            raise self.error(value)
        return out

    def error(self, value: Any) -> ConfigError:
        shown = "<redacted>" if self.secret else repr(value)
        return ConfigError(f"config key '{self.name}': invalid value {shown}; allowed: {self.allowed()} "
                           f"(default {self.default!r})")


SCHEMA: tuple[Key, ...] = (
    # --- mount: the FUSE front ---------------------------------------------------------------------
    Key("mount.allow_other", "bool", False,
        "Let users other than the mounting one access the store (FUSE allow_other). Off: only the owner sees it."),
    Key("mount.writeback_cache", "bool", True,
        "Kernel writeback cache: coalesces small and mmap writes into large WRITEs. Keep on for broker speed."),
    Key("mount.max_tasks", "int", 32,
        "Most FUSE requests handled concurrently by the daemon, besides those waiting on the object store "
        "(mount.max_store_waiters): this many are always free for requests on hot files.",
        minimum=1, maximum=1024),
    Key("mount.max_store_waiters", "int", 48,
        "Most FUSE requests that may wait on the object store at once (reads of evicted bytes; writes and "
        "truncates of a tiered segment that need a fetch), each for objectstore.read_timeout_seconds at most. One "
        "more fails with EIO at once, so hot files' requests never wait behind them. At most mount.max_background "
        "minus 16 (minus half of it when that is below 32), so the kernel keeps room for hot files' writeback.",
        minimum=1, maximum=1024),
    Key("mount.catalog_reserve_bytes", "size", 64 << 20,
        "Space kept allocated in the state dir on the hot disk and given back the first time a catalog commit "
        "finds the disk full, so a broker can still delete segments (each unlink commits) to free space. 0: "
        "none; a full disk then answers such unlinks EIO.", minimum=0),
    Key("mount.reserve_on_truncate", "choice", "segments",
        "Allocate the range a truncate grows a file by (fallocate), so a full hot disk refuses the truncate (the "
        "broker then refuses sends) instead of failing the writeback of mapped pages the broker has already "
        "acknowledged. segments: the store's CommitLog, ConsumeQueue, index and timer segments (what a broker "
        "maps); all: every file; off: every file sparse, as on a native disk. A reserved segment counts as used "
        "in statfs from its creation (one segment per log ahead of the broker's writes).",
        choices=("segments", "all", "off")),
    Key("mount.attr_timeout", "float", 1.0, "Seconds the kernel may cache file attributes and names.",
        minimum=0, maximum=3600),
    Key("mount.read_ahead_kb", "int", 1024,
        "Kernel read-ahead of the mount (set through /sys/class/bdi after mounting; 0 keeps the kernel's).",
        minimum=0, maximum=65536),
    Key("mount.write_prime_kb", "int", 1024,
        "Read this much of a file into the page cache, through a helper process, ahead of a writer that fills it "
        "page by page inside its size (a broker's preallocated ConsumeQueue): its writes then skip the kernel's "
        "READ of each new 4 KiB page. The kernel caps it at mount.read_ahead_kb. 0: off (and with "
        "tiering.enabled=false: no helpers).",
        minimum=0, maximum=65536),
    Key("mount.max_background", "int", 64,
        "FUSE max_background requests (fusectl; 0 keeps the kernel's). Higher lets more read-ahead overlap.",
        minimum=0, maximum=65535),
    Key("mount.log_file", "path", "", "Daemon log file. Empty: HOT_DIR/.tierfs/tierfs.log."),
    Key("mount.log_level", "choice", "info", "Daemon log level.",
        choices=("debug", "info", "warning", "error")),
    # --- objectstore: where sealed segments go ----------------------------------------------------
    Key("objectstore.url", "str", "",
        "Where tiered segments live: file:///ABS/PATH (posix backend: another disk, NFS) or s3://BUCKET/PREFIX. "
        "Empty: file://HOT_DIR/.tierfs/objects (embedded demo default, same disk)."),
    Key("objectstore.endpoint_url", "str", "", "S3 endpoint URL (MinIO, Ceph RGW, ...). Empty: AWS."),
    Key("objectstore.region", "str", "", "S3 region. Empty: from the standard AWS configuration."),
    Key("objectstore.addressing", "choice", "auto", "S3 addressing style.", choices=("auto", "path", "virtual")),
    Key("objectstore.access_key_id", "str", "",
        "S3 access key. Empty: the standard credential chain (env, ~/.aws, instance role).", secret=True),
    Key("objectstore.secret_access_key", "str", "", "S3 secret key (never logged or shown).", secret=True),
    Key("objectstore.max_concurrency", "int", 16, "Most object store requests in flight.", minimum=1, maximum=512),
    Key("objectstore.max_attempts", "int", 5, "Attempts per request (with backoff) before it counts as failed.",
        minimum=1, maximum=50),
    Key("objectstore.read_timeout_seconds", "float", 30.0,
        "Longest a read of evicted bytes waits on the object store before it fails with EIO.", minimum=0.1),
    Key("objectstore.payload_signing", "choice", "auto",
        "Whether an S3 upload's SigV4 signature also covers a SHA-256 of its body (CPU: about as much as lz4 per "
        "uploaded byte). Without it, anyone able to alter the traffic can alter the stored bytes undetected by "
        "the server (upload.verify=full still reads them back). auto: not over verified TLS (TLS protects the "
        "body) nor to a loopback endpoint (127.0.0.0/8, ::1, localhost); signed otherwise. always, never: as said.",
        choices=("auto", "always", "never")),
    Key("objectstore.chunk_bytes", "size", 16 << 20,
        "Segments are stored as chunk objects of this size (a multiple of cache.block_bytes).", minimum=1 << 16),
    Key("store.id", "str", "", "Store id in object keys (<store-id>/seg/...). Empty: generated once, kept in "
        "HOT_DIR/.tierfs/store-id."),
    Key("store.roots", "str", "",
        "Store roots below the mount root, comma-separated relative dirs (e.g. 'master,slave'; '.' is the root). "
        "Empty: found by layout (dirs holding commitlog/, consumequeue/, index/ or dledger-<id>/, up to 3 levels "
        "down)."),
    # --- seal, upload, eviction ---------------------------------------------------------------------
    Key("tiering.enabled", "bool", True, "Seal, upload and evict segments. Off: a plain local passthrough."),
    Key("tiering.rpo_seconds", "float", 10.0,
        "Continuous tiering of active files (needs objectstore.url): every this many seconds the bytes written to "
        "active segments go up as append objects, mutable files as blobs, then a catalog snapshot naming them, "
        "so the bucket holds a consistent point no older than this (for --takeover and --follow). 0: off "
        "(active files reach the bucket only in the periodic snapshot).", minimum=0),
    Key("seal.quiet_seconds", "float", 10.0,
        "A segment is sealed only after its content is complete, flushed, and unwritten for this long.", minimum=0),
    Key("seal.scan_interval_seconds", "float", 30.0, "Period of the full scan for sealable segments.",
        minimum=0.1),
    Key("upload.concurrency", "int", 2, "Segments uploaded at once (oldest first).", minimum=1, maximum=64),
    Key("upload.verify", "choice", "full",
        "full: read every uploaded object back and check crc32c; head: check sizes only.", choices=("full", "head")),
    Key("upload.dedup", "choice", "auto",
        "Store the chunks of sealed segments content-addressed (<store-id>/cas/<sha256>), so byte-identical "
        "segments (a broker group's replicas under one mount) are stored once. auto: when the store roots are "
        "below the mount root (store.roots, or found by layout: a group's layout) or upload.dedup_group is set; "
        "on: always; off: never (keys per row). Costs a sha256 pass (in the upload's thread) and one catalog "
        "transaction per chunk.",
        choices=("auto", "on", "off")),
    Key("upload.dedup_group", "str", "",
        "A broker group whose replicas run on separate mounts sharing one bucket: their content-addressed chunks "
        "go to groups/<group>/cas/<sha256> (below the bucket prefix), shared by every mount naming the same "
        "group, with a reference marker per mount in the bucket (tierfs.tier.sharedrefs), so the group's "
        "byte-identical segments are stored once. Letters, digits, '.', '_', '-'. Empty: per-store cas only."),
    Key("upload.dedup_group_grace_seconds", "float", 30.0,
        "Deleting a group's shared chunk: how long the deleter waits after putting its tombstone before it lists "
        "the other mounts' markers again (an upload of the same bytes that saw the tombstone puts them again).",
        minimum=0),
    Key("upload.retry_max_seconds", "float", 60.0, "Longest backoff between upload retries.", minimum=0.1),
    Key("upload.bandwidth_bytes_per_second", "size", 0,
        "Cap on upload bandwidth shared by all uploaders (so tiering never starves the broker's replication "
        "link). 0: unlimited.", minimum=0),
    Key("delete.grace_seconds", "float", 300.0,
        "Objects of deleted or replaced segments are kept this long (set days to keep deleted segments).",
        minimum=0),
    Key("cache.max_bytes", "size", 8 << 30,
        "Local budget for bytes of tiered segments (resident blocks); eviction keeps them under it.", minimum=0),
    Key("cache.high_watermark", "float", 0.9, "Eviction starts above this share of cache.max_bytes.",
        minimum=0.01, maximum=1.0),
    Key("cache.low_watermark", "float", 0.75, "Eviction stops below this share of cache.max_bytes.",
        minimum=0.0, maximum=1.0),
    Key("cache.block_bytes", "size", 1 << 20, "Unit of residency, fetch and eviction.", minimum=1 << 12),
    Key("cache.verify_bytes", "size", 4 << 10,
        "Finer crc32c unit recorded at upload (divides cache.block_bytes): a random read of an evicted "
        "raw segment then fetches and checks only the units it touches instead of whole blocks. The table (4 bytes "
        "per unit: 1 MiB per tiered GiB at 4KiB) is one object per segment beside its chunks, referenced by the "
        "catalog row and loaded when the segment is read (cache.unit_tables_bytes). 0: whole blocks only.",
        minimum=0),
    Key("cache.unit_tables_bytes", "size", 64 << 20,
        "Memory for the verification tables (cache.verify_bytes) of segments being read, least recently used "
        "dropped first; a dropped table is fetched again when its segment is read by units.", minimum=1 << 16),
    Key("readahead.initial_blocks", "int", 2, "Read-ahead window when a stream starts sequential.", minimum=0),
    Key("readahead.batch_blocks", "int", 2, "Window growth per sequential hit (additive increase).", minimum=1),
    Key("readahead.max_blocks", "int", 64, "Largest read-ahead window per stream.", minimum=1),
    Key("readahead.budget_bytes", "size", 256 << 20,
        "Global cap on prefetched bytes in flight, so many readers cannot exhaust memory.", minimum=1 << 20),
    Key("readahead.named_units", "bool", False,
        "With cache.verify_bytes set, a ConsumeQueue page of a tiered queue prefetches the verification units of "
        "the CommitLog records it names: the fewest bytes, about one GET per record. false: their whole blocks, in "
        "GETs of up to 16 MiB: more bytes, far fewer requests (a lagging consumer of a 5% topic: 4.6x the bytes, "
        "a fraction of the GETs)."),
    Key("readahead.named_gap_bytes", "size", 0,
        "With readahead.named_units: CommitLog records a ConsumeQueue page names that lie at most this far apart are "
        "fetched by one ranged GET (the gap's bytes too, checked and dropped), up to 1 MiB a GET: fewer requests for "
        "more bytes. 0: only records in adjacent units share a GET.", minimum=0),
    Key("broker.max_index_num", "int", 20_000_000, "The broker's maxIndexNum (IndexFile seal rule).", minimum=1),
    Key("broker.max_hash_slot_num", "int", 5_000_000, "The broker's maxHashSlotNum (IndexFile seal rule).",
        minimum=1),
    # --- statfs: what the broker is told about capacity ------------------------------------------
    Key("statfs.capacity_bytes", "size", 0,
        "Capacity reported by statfs (the broker's disk-ratio retention reads it). 0: the hot dir's own size.",
        minimum=0),
    # --- catalog snapshots and the writer lease ----------------------------------------------------
    Key("snapshot.interval_seconds", "float", 300.0,
        "Period of catalog snapshots to <store-id>/meta/ (also taken at unmount), for read-only mounts "
        "from the bucket. 0: only at unmount.", minimum=0),
    Key("lease.ttl_seconds", "float", 120.0,
        "The writer lease object expires this long after its last renewal; a writable mount of the same store "
        "id elsewhere is refused until then.", minimum=5),
    # --- compaction: the PySpark pipeline ------------------------------------------------------------
    Key("compaction.enabled", "bool", True, "The daemon schedules the Spark pipeline (one job at a time)."),
    Key("compaction.interval_seconds", "float", 3600.0, "Period of scheduled pipeline runs.", minimum=1),
    Key("compaction.min_age_seconds", "float", 3600.0,
        "Only segments tiered at least this long ago are compacted and archived.", minimum=0),
    Key("compaction.stages", "str", "segments,index,archive",
        "Stages the scheduled job runs: any of segments (lz4c), index (.cidx sidecars), archive (Parquet)."),
    Key("compaction.spark_submit", "path", "",
        "spark-submit to launch jobs with. Empty: `python -m tierfs.spark` (PySpark from the venv)."),
    Key("objectstore.posix_shared", "bool", False,
        "The file:// object store is shared storage every Spark executor sees at the same path (NFS). "
        "Without it, a file:// store is refused for a non-local spark.master."),
    Key("archive.format", "choice", "delta",
        "How the archive stage keeps messages: delta (one Delta Lake table, <objectstore.url>/tables/messages, "
        "partitioned by topic and date, each segment generation committed exactly once) or parquet (plain files "
        "per segment under <store-id>/archive/, for readers without a table engine).", choices=("delta", "parquet")),
    Key("archive.broker_name", "str", "",
        "The broker column of the archive table's rows (the brokerName of this store's broker group): stores "
        "archiving under one name (a master and its slaves) commit each segment once, keyed by its base offset "
        "and content. Empty: the brokerName in a store root's brokerIdentity file (5.x controller mode), else the "
        "store id, each store root on its own."),
    Key("archive.retention_days", "float", 0.0,
        "Rows of the archive table (archive.format = delta) whose store date is older than this many days are "
        "expired by the archive job (a Delta delete, then a vacuum of the unreferenced files). 0: kept forever; "
        "rows outlive the broker's own retention either way.", minimum=0),
    Key("archive.vacuum_grace_hours", "int", 168,
        "Files of the archive table are deleted only by its vacuum, once unreferenced this long (queries reading "
        "an older table version keep theirs until then; also covers a job still writing before its commit).",
        minimum=0),
    Key("archive.max_lag_seconds", "float", 300.0,
        "Freshness of the archive: a sealed CommitLog segment reaches it within this long of its last write. "
        "The daemon runs an archive-only job once the oldest unarchived tiered segment is half this old (sooner "
        "when jobs take longer); tierfs_archive_lag_seconds and `tierfs status` show the lag. 0: scheduled runs "
        "only.", minimum=0),
    Key("archive.retention", "str", "",
        "Per-topic retention of the archive (archive.format = parquet): TOPIC=DAYS,...,*=DAYS (days after the "
        "message date). Empty: keep forever."),
    Key("archive.catalog", "choice", "none",
        "Where readers find the archive table (archive.format = delta) by name. none: by its location only (the "
        "Delta log beside the objects is its catalog; readers run CREATE TABLE ... USING DELTA LOCATION "
        "themselves). hive: after its commits the archive job registers it in the Hive Metastore at "
        "archive.catalog_uri as the external Delta table archive.catalog_table (created if missing, never "
        "re-pointed; a metastore that is down fails only the registration, retried by the next job).",
        choices=("none", "hive")),
    Key("archive.catalog_uri", "str", "",
        "The Hive Metastore of archive.catalog = hive: thrift://HOST:PORT (several, comma-separated, are tried in "
        "turn)."),
    Key("archive.catalog_table", "str", "tierfs.messages",
        "DATABASE.TABLE the archive table is registered as (archive.catalog = hive); the database is created if "
        "missing. Letters, digits and '_'."),
    Key("spark.master", "str", "local[*]",
        "Spark master for pipeline jobs. Any other spark.* key is passed through to the SparkSession."),
    # --- metrics -------------------------------------------------------------------------------------
    Key("metrics.listen", "str", "",
        "HOST:PORT for a Prometheus HTTP listener (e.g. 127.0.0.1:9464). Empty: off; /.tierfs/metrics "
        "always serves the same text."),
)

_BY_NAME = {k.name: k for k in SCHEMA}


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for name, value in tree.items():
        full = f"{prefix}{name}"
        if isinstance(value, Mapping):
            yield from _flatten(value, full + ".")
        else:
            yield full, value


_SECTIONS = sorted({k.name.rpartition(".")[0] for k in SCHEMA})
_KEYS_HINT = " 'tierfs config-doc' lists every key."


def _suggest(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(_BY_NAME), n=1)
    key_hint = f" Did you mean '{close[0]}'?" if close else ""
    section = name.rpartition(".")[0]
    if section and section not in _SECTIONS:
        return (f" There is no section [{section}]; sections are {', '.join(_SECTIONS)}.{key_hint}{_KEYS_HINT}")
    return key_hint or _KEYS_HINT


class Config:
    """Effective configuration: defaults, then the TOML file, then `-o` overrides, all validated."""

    def __init__(self, values: Mapping[str, Any] | None = None, source: str = "defaults"):
        self._values: dict[str, Any] = {k.name: k.default for k in SCHEMA}
        self.source = source
        for name, raw in (values or {}).items():
            self.set(name, raw)

    def set(self, name: str, raw: Any) -> None:
        key = _BY_NAME.get(name)
        if key is None and name.startswith("spark.") and len(name) > 6:
            self._values[name] = _toml_scalar(name, raw)  # any Spark setting passes through to the job
            return
        if key is None:
            raise ConfigError(f"unknown config key '{name}'.{_suggest(name)}")
        value = key.parse(raw)
        check = _CHECKS.get(name)
        if check is not None:
            check(key, value)
        self._values[name] = value

    def spark_conf(self) -> dict[str, str]:
        """Every spark.* setting (spark.master included), as strings, for the SparkSession builder."""
        return {k: _spark_str(v) for k, v in self._values.items() if k.startswith("spark.")}

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def as_dict(self, redact: bool = True) -> dict[str, Any]:
        out = {k.name: ("<redacted>" if (redact and k.secret and self._values[k.name]) else self._values[k.name])
               for k in SCHEMA}
        out.update((k, v) for k, v in self._values.items() if k not in out)  # spark.* pass-through
        return out

    def render_toml(self, redact: bool = True) -> str:
        """The effective configuration as TOML, grouped by section (what /.tierfs/config shows)."""
        lines: list[str] = [f"# effective configuration (source: {self.source})"]
        sections: dict[str, list[str]] = {}
        for name, value in self.as_dict(redact).items():
            sec, _, leaf = name.rpartition(".")
            sections.setdefault(sec, []).append(f"{leaf} = {_toml_value(value)}")
        for sec, rows in sections.items():
            lines += [f"\n[{sec}]", *rows]
        return "\n".join(lines) + "\n"

    @classmethod
    def load(cls, path: str | None = None, overrides: Iterable[str] = ()) -> "Config":
        """Defaults, then the file, then the overrides. Every bad key or value is reported at once, so a config
        file with three mistakes takes one round trip, not three."""
        cfg = cls(source=path or "defaults")
        errors: list[str] = []
        if path:
            try:
                tree = tomllib.loads(Path(path).read_text())
            except FileNotFoundError:
                raise ConfigError(f"config file {path!r} does not exist; pass an existing TOML file to --config") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
            for name, value in _flatten(tree):
                try:
                    cfg.set(name, value)
                except ConfigError as e:
                    errors.append(f"{path}: {e}")
        overridden: list[str] = []
        for item in overrides:
            try:
                pairs = parse_overrides(item)
            except ConfigError as e:
                errors.append(str(e))
                continue
            for name, value in pairs.items():
                try:
                    cfg.set(name, value)
                    overridden.append(name)
                except ConfigError as e:
                    errors.append(str(e))
        if not errors:
            errors += check_together(cfg)
        if len(errors) == 1:
            raise ConfigError(errors[0])
        if errors:
            raise ConfigError(f"{len(errors)} configuration errors:\n  " + "\n  ".join(errors))
        if overridden:
            cfg.source += " + -o " + ",".join(dict.fromkeys(overridden))
        return cfg


def _toml_scalar(name: str, raw: Any) -> Any:
    if isinstance(raw, (dict, list)):
        raise ConfigError(f"config key '{name}': invalid value {raw!r}; allowed: a string, number or boolean")
    return raw


def _spark_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_retention(text: str) -> dict[str, float]:
    """'TopicA=7,*=30' -> {'TopicA': 7.0, '*': 30.0} (days)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        topic, sep, days = part.partition("=")
        if not sep or not topic.strip():
            raise ValueError(part)
        value = float(days)
        if not math.isfinite(value) or value < 0:
            raise ValueError(part)
        out[topic.strip()] = value
    return out


def _check_retention(key: "Key", value: str) -> None:
    try:
        parse_retention(value)
    except ValueError:
        raise ConfigError(f"config key '{key.name}': invalid value {value!r}; allowed: TOPIC=DAYS pairs separated "
                          f"by commas, '*' for every other topic, e.g. 'orders=30,*=7'") from None


def _check_listen(key: "Key", value: str) -> None:
    host, sep, port = value.rpartition(":")
    if value and (not sep or not host or not port.isdigit() or not 0 < int(port) < 65536):
        raise ConfigError(f"config key '{key.name}': invalid value {value!r}; allowed: HOST:PORT such as "
                          f"127.0.0.1:9464, or empty for no listener")


def _check_stages(key: "Key", value: str) -> None:
    stages = [s.strip() for s in value.split(",") if s.strip()]
    bad = [s for s in stages if s not in ("segments", "index", "archive")]
    if bad or not stages:
        raise ConfigError(f"config key '{key.name}': invalid value {value!r}; allowed: a comma-separated subset "
                          f"of segments, index, archive")


def _checked_by(module: str, func: str, allowed: str) -> Callable[["Key", Any], None]:
    """A key's check from a pure `func(value) -> why it is wrong, or None` of `module` (imported when used: no
    I/O, no cycle at import)."""
    def check(key: "Key", value: str) -> None:
        import importlib  # noqa: PLC0415

        why = getattr(importlib.import_module(module), func)(value)
        if why:
            raise ConfigError(f"config key '{key.name}': invalid value {value!r}: {why}; allowed: {allowed}")
    return check


def check_together(cfg: "Config") -> list[str]:
    """What is wrong with keys that only make sense together (checked once every key is set)."""
    errors = []
    if cfg["archive.catalog"] == "hive":
        if not cfg["archive.catalog_uri"]:
            errors.append("config key 'archive.catalog' is 'hive' but 'archive.catalog_uri' is empty: set "
                          "archive.catalog_uri = \"thrift://HOST:9083\" (the Hive Metastore), or archive.catalog "
                          "= \"none\"")
        if cfg["archive.format"] != "delta":
            errors.append("config key 'archive.catalog' is 'hive' but 'archive.format' is "
                          f"{cfg['archive.format']!r}: only the Delta table (archive.format = \"delta\") is "
                          "registered in a catalog; set archive.format = \"delta\" or archive.catalog = \"none\"")
    return errors


_CHECKS: dict[str, Callable[["Key", Any], None]] = {
    "archive.catalog_uri": _checked_by("tierfs.spark.catalog", "check_uris",
                                       "thrift://HOST:PORT of a Hive Metastore, e.g. 'thrift://metastore.example:9083'"),
    "archive.catalog_table": _checked_by("tierfs.spark.catalog", "check_table_name",
                                         "DATABASE.TABLE of letters, digits and '_', e.g. 'tierfs.messages'"),
    "store.roots": _checked_by("tierfs.tier.storeroots", "check_roots",
                               "relative directories separated by commas, e.g. 'master,slave'"),
    "archive.retention": _check_retention,
    "metrics.listen": _check_listen,
    "compaction.stages": _check_stages,
}


def parse_overrides(text: str) -> dict[str, str]:
    """`a.b=1,c.d=x` -> {'a.b': '1', 'c.d': 'x'}. A bare word is refused: every override names its key."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"option '{part}' has no value; write it as -o {part}=VALUE")
        out[name.strip()] = value.strip()
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def schema_markdown() -> str:
    """The README configuration table, generated so docs and code cannot drift."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for k in SCHEMA:
        rows.append(f"| `{k.name}` | `{_toml_value(k.default)}` | {k.allowed()} | {k.doc} |")
    return "\n".join(rows)
