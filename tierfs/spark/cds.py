"""A class-data sharing (AppCDS) archive for the job's driver JVM: about half its start-up CPU is loading, parsing
and verifying Spark's classes, the same ones every job. The first job on a machine records them
(-XX:ArchiveClassesAtExit, written when its JVM exits); later jobs map them (-XX:SharedArchiveFile) and start in
about half the time (2 cores: session start 4 -> 2 s, JVM CPU 6 -> 3.6 s).

The archive is one file per Java runtime, Spark jars and classpath settings, in TIERFS_SPARK_CDS_DIR (default
$XDG_CACHE_HOME/tierfs/spark-cds or ~/.cache/tierfs/spark-cds; "off" turns this off). The JVM itself refuses an
archive of another runtime or classpath and starts without it; a job whose cache directory cannot be written
just runs without one. Only the driver JVM that `python -m tierfs.spark` starts is concerned: cluster executors
and a driver started by spark-submit run as configured.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "TIERFS_SPARK_CDS_DIR"
# Settings that change the driver's classpath or modules, so the classes an archive would hold.
_CLASSPATH_KEYS = ("spark.driver.extraClassPath", "spark.jars", "spark.jars.packages", "spark.driver.extraJavaOptions")
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"  # the JVM reports skipped classes and unusable archives on stdout
_EXIT_WAIT_S = 120.0
_STALE_S = 3600.0  # a recording older than this was abandoned


@dataclass(frozen=True)
class Plan:
    """What one job does: map `archive`, or record into `tmp` and publish it as `archive` after the JVM exits."""

    archive: Path
    tmp: Path | None
    java: Path | None = None  # the runtime that checks a recorded archive before it is published

    @property
    def java_options(self) -> str:
        if self.tmp is None:
            return f"-XX:SharedArchiveFile={self.archive} {_QUIET}"
        return f"-XX:ArchiveClassesAtExit={self.tmp} {_QUIET}"


def cache_dir() -> Path | None:
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "off") else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or (os.path.join(os.path.expanduser("~"), ".cache")
                                                 if os.path.expanduser("~") != "~" else None)
    return Path(base) / "tierfs" / "spark-cds" if base else None


def _java() -> Path | None:
    """The java that Spark's launcher runs: $JAVA_HOME/bin/java, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return Path(found).resolve() if found and os.path.exists(found) else None


def _key(spark_home: Path, conf: dict[str, str], java: Path) -> str:
    h = hashlib.sha256()
    st = java.stat()
    parts: list = [str(java), st.st_size, st.st_mtime_ns]
    jars = spark_home / "jars"
    for p in sorted(jars.iterdir()) if jars.is_dir() else []:
        s = p.stat()
        parts.append((p.name, s.st_size, s.st_mtime_ns))
    parts.append({k: conf.get(k, "") for k in _CLASSPATH_KEYS})
    h.update(json.dumps(parts, default=str).encode())
    return h.hexdigest()[:24]


def _drop_stale(d: Path) -> None:
    """Archives a killed job was recording (its JVM never finished the file)."""
    now = time.time()
    for p in d.glob(".driver-*.tmp"):
        try:
            if now - p.stat().st_mtime > _STALE_S:
                p.unlink()
        except OSError:
            pass


def plan(conf: dict[str, str]) -> Plan | None:
    """The archive for a driver started with `conf`, or None (turned off, no java found, cache not writable, or the
    job's own Java options already manage class sharing)."""
    opts = conf.get("spark.driver.extraJavaOptions", "")
    if any(o in opts for o in ("SharedArchiveFile", "ArchiveClassesAtExit", "-Xshare")):
        return None
    d, java = cache_dir(), _java()
    if d is None or java is None:
        return None
    try:
        from pyspark.find_spark_home import _find_spark_home

        archive = d / f"driver-{_key(Path(_find_spark_home()), conf, java)}.jsa"
        if archive.is_file():
            return Plan(archive, None, java)
        d.mkdir(parents=True, exist_ok=True)
        _drop_stale(d)
        tmp = d / f".{archive.name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        if not os.access(d, os.W_OK):
            return None
        return Plan(archive, tmp, java)
    except (OSError, ImportError):
        return None


def _maps(java: Path | None, archive: Path) -> bool:
    """Whether *java* starts with *archive* mapped (a truncated or damaged archive crashes it)."""
    if java is None:
        return False
    r = subprocess.run([str(java), f"-XX:SharedArchiveFile={archive}", *_QUIET.split(), "-version"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=_EXIT_WAIT_S)
    return r.returncode == 0


def discard(p: Plan) -> None:
    """Remove an archive the driver could not start with (the next job records a new one)."""
    try:
        p.archive.unlink(missing_ok=True)
    except OSError:
        pass


def publish(p: Plan | None, sc_class) -> None:
    """After the session stopped: when this job records an archive, end the driver JVM (it writes the archive on
    exit) and move the archive into place, atomically, for the next jobs. Never raises."""
    if p is None or p.tmp is None:
        return
    try:
        gateway = getattr(sc_class, "_gateway", None)
        proc = getattr(gateway, "proc", None)
        if proc is not None:
            gateway.shutdown()
            if proc.stdin is not None:
                proc.stdin.close()  # the gateway JVM exits when its stdin closes
            # a JVM killed while writing leaves a truncated archive, and a JVM that maps one crashes: publish
            # only what a clean exit wrote and a JVM maps
            if proc.wait(_EXIT_WAIT_S) == 0 and p.tmp.is_file() and _maps(p.java, p.tmp):
                os.replace(p.tmp, p.archive)
    except Exception:  # noqa: BLE001 - OSError, TimeoutExpired, py4j errors: the job's result stands
        pass
    finally:
        try:
            p.tmp.unlink(missing_ok=True)
        except OSError:
            pass
