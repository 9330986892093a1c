"""Prometheus metrics of one daemon (DESIGN §11): `/.tierfs/metrics` and the optional `metrics.listen` listener.

Two sources feed one `CollectorRegistry` per daemon:
* `StateCollector` reads the live state at scrape time (catalog entries, upload backlog, cache, read-ahead
  streams, EngineStats counters, FsStats per-op log-bucket histograms). Nothing is counted twice on the hot path:
  the FUSE front keeps its own cheap FsStats and this collector converts them only when scraped.
* `Transfers` holds real prometheus Histograms of upload and download latency and size; the engine observes into
  them through its `observe` hook (event, seconds, bytes), so the engine never imports prometheus_client.

A scrape from the HTTP listener runs in the listener's thread while the trio loop mutates the state. Every dict is
copied with one C-level `list(...)` call (atomic under the GIL) before it is walked, so a scrape can see a
slightly moving picture but never fails; counters stay monotonic because they are only ever incremented.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from tierfs import __version__
from tierfs.config import Config
from tierfs.fs.supervisor import supervisor_failstops
from tierfs.tier.catalog import State

if TYPE_CHECKING:
    from tierfs.fs.operations import TierOperations
    from tierfs.fs.stats import OpStats
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.metrics")

PREFIX = "tierfs_"
# FsStats buckets are log2 with 4 linear sub-buckets; powers of two are exact bucket edges, so these cumulative
# counts are exact (an observation counts in `le` when it took fewer than le seconds, to the nanosecond).
_FUSE_EDGES_NS = [1 << e for e in range(10, 35)]  # 1.0 us .. 17 s
_SIZE_BUCKETS = tuple(float(1 << e) for e in range(12, 32, 2))  # 4 KiB .. 1 GiB
CONTROL_TTL = 0.1
# supervised workers exported from 0 restarts (others appear at their first restart)
_WORKERS = ("sealer", "uploader", "evictor", "janitor", "snapshotter", "compaction", "lease", "upload-sweep",
            "appendlog", "flusher", "primer", "follow")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)


class Transfers:
    """Histograms of object store transfers, observed by the engine (thread-safe, as prometheus_client is)."""

    def __init__(self, registry: CollectorRegistry):
        self.upload_seconds = Histogram(PREFIX + "upload_seconds", "Time to upload and verify one segment.",
                                        buckets=_LATENCY_BUCKETS, registry=registry)
        self.upload_bytes = Histogram(PREFIX + "upload_bytes", "Size of each uploaded segment.",
                                      buckets=_SIZE_BUCKETS, registry=registry)
        self.download_seconds = Histogram(PREFIX + "download_seconds",
                                          "Time of each fetch of evicted blocks (ranged GET + verification).",
                                          buckets=_LATENCY_BUCKETS, registry=registry)
        self.download_bytes = Histogram(PREFIX + "download_bytes", "Bytes of each fetch of evicted blocks.",
                                        buckets=_SIZE_BUCKETS, registry=registry)

    def observe(self, event: str, seconds: float, nbytes: int) -> None:
        """The engine's hook: event 'upload' (one segment tiered) or 'download' (one fetch installed)."""
        if event == "upload":
            self.upload_seconds.observe(seconds)
            self.upload_bytes.observe(nbytes)
        elif event == "download":
            self.download_seconds.observe(seconds)
            self.download_bytes.observe(nbytes)


def fuse_histogram_buckets(st: OpStats) -> list[tuple[str, float]]:
    """An FsStats op histogram as cumulative Prometheus buckets (seconds) ending with +Inf."""
    from tierfs.fs.stats import _bucket

    counts = list(st.buckets)
    out = []
    acc = 0
    b = 0
    for edge in _FUSE_EDGES_NS:
        stop = _bucket(edge)  # first internal bucket at or above the edge
        acc += sum(counts[b:stop])
        b = stop
        out.append((_fmt(edge / 1e9), float(acc)))
    out.append(("+Inf", float(sum(counts))))
    return out


def _fmt(x: float) -> str:
    return repr(float(x))


class StateCollector:
    """Reads the daemon's live state when scraped."""

    def __init__(self, ops: TierOperations, config: Config):
        self.ops = ops
        self.cache_budget = int(config["cache.max_bytes"])
        self.readahead_budget = int(config["readahead.budget_bytes"])
        self.readahead_max = int(config["readahead.max_blocks"])
        self.failstops = supervisor_failstops()  # None: not started by a supervisor

    def collect(self) -> Iterator[Metric]:
        yield from self._fuse()
        if self.ops.engine is not None:
            yield from self._engine()

    def _fuse(self) -> Iterator[Metric]:
        st = self.ops.stats
        eng = self.ops.engine
        info = GaugeMetricFamily(PREFIX + "info", "Version and store id of this daemon.",
                                 labels=["version", "store_id"])
        info.add_metric([__version__, eng.store_id if eng is not None else ""], 1)
        yield info
        yield GaugeMetricFamily(PREFIX + "uptime_seconds", "Seconds since mount.", value=time.time() - st.started)
        if self.failstops is not None:
            count, last = self.failstops
            yield CounterMetricFamily(PREFIX + "supervisor_remounts", "Fail-stops of this mount's supervisor (tierfs "
                                      "supervise): daemons that died and were replaced, the store's holders "
                                      "killed, since the supervisor started.", value=count)
            yield GaugeMetricFamily(PREFIX + "supervisor_last_failstop_timestamp_seconds", "Unix time of the "
                                    "supervisor's last fail-stop (0: none).", value=last)
        yield GaugeMetricFamily(PREFIX + "open_files", "File handles open through the mount.",
                                value=len(self.ops._fh_inode))
        yield CounterMetricFamily(PREFIX + "fuse_read_bytes", "Bytes answered to FUSE reads.", value=st.bytes_read)
        yield CounterMetricFamily(PREFIX + "fuse_written_bytes", "Bytes taken by FUSE writes.",
                                  value=st.bytes_written)
        lat = HistogramMetricFamily(PREFIX + "fuse_op_seconds", "FUSE operation latency by operation.",
                                    labels=["op"])
        errs = CounterMetricFamily(PREFIX + "fuse_op_errors",
                                   "FUSE operations answered with an unexpected error, by operation (ENOENT, EEXIST, "
                                   "ENOTEMPTY and EAGAIN are expected answers and not counted).", labels=["op"])
        for name, op in sorted(st.ops.items()):  # sorted() copies in C: safe against concurrent inserts
            lat.add_metric([name], fuse_histogram_buckets(op), sum_value=op.total_ns / 1e9)
            errs.add_metric([name], op.errors)
        yield lat
        yield errs

    def _engine(self) -> Iterator[Metric]:
        eng = self.ops.engine
        assert eng is not None
        files: dict[tuple, int] = {}
        size: dict[tuple, int] = {}
        local: dict[tuple, int] = {}
        waiting = (State.SEALED, State.UPLOADING)
        bl_files = bl_bytes = 0
        bl_since = float("inf")
        # the one per-row loop of a scrape: keep it lean (a copy of the live dict, which the trio loop may grow
        # under a listener-thread scrape)
        for e in list(eng.entries.values()):
            st = e.state
            k = (e.kind, st)
            files[k] = files.get(k, 0) + 1
            size[k] = size.get(k, 0) + e.size
            local[k] = local.get(k, 0) + e.resident_bytes()
            if st in waiting:
                bl_files += 1
                bl_bytes += e.size
                bl_since = min(bl_since, e.state_since)
        entries = eng.entries
        for rel, (kind, nbytes, local_bytes, _) in list(eng.sealer.hot_segments.items()):  # never sealed: no catalog row
            if rel not in entries:
                k = (kind, State.HOT)
                files[k] = files.get(k, 0) + 1
                size[k] = size.get(k, 0) + nbytes
                local[k] = local.get(k, 0) + local_bytes
        fam_files = GaugeMetricFamily(PREFIX + "files", "Segments by kind and state (hot ones without a catalog row "
                                      "as of the engine's last scan).", labels=["kind", "state"])
        fam_bytes = GaugeMetricFamily(PREFIX + "bytes", "Logical size of segments by kind and state.",
                                      labels=["kind", "state"])
        fam_local = GaugeMetricFamily(PREFIX + "local_bytes", "Bytes of segments present in the hot dir (tiered: "
                                      "the resident blocks).", labels=["kind", "state"])
        for k in sorted(files, key=lambda k: (k[0], k[1].value)):
            labels = [k[0], k[1].value]
            fam_files.add_metric(labels, files[k])
            fam_bytes.add_metric(labels, size[k])
            fam_local.add_metric(labels, local[k])
        yield fam_files
        yield fam_bytes
        yield fam_local

        bl_age = max(time.time() - bl_since, 0.0) if bl_files else 0.0
        yield GaugeMetricFamily(PREFIX + "upload_backlog_files", "Sealed segments waiting for or in upload.",
                                value=bl_files)
        yield GaugeMetricFamily(PREFIX + "upload_backlog_bytes", "Bytes of segments waiting for or in upload.",
                                value=bl_bytes)
        yield GaugeMetricFamily(PREFIX + "upload_backlog_oldest_seconds",
                                "Age of the oldest segment waiting for upload (0: none).", value=bl_age)

        restarts = CounterMetricFamily(PREFIX + "worker_restarts", "Restarts of a supervised background worker "
                                       "after it failed (the mount stays up).", labels=["worker"])
        got_restarts = dict(eng.workers.restarts)  # one C-level copy: the loop may add a worker meanwhile
        for name in sorted(set(_WORKERS) | set(got_restarts)):  # each from 0, so increase() sees its first
            restarts.add_metric([name], got_restarts.get(name, 0))
        yield restarts
        yield from self._lease(eng)
        yield from self._archive(eng)
        alog = getattr(eng, "appendlog", None)
        if alog is not None:
            lag = GaugeMetricFamily(PREFIX + "rpo_lag_seconds", "Achieved RPO: age of the oldest write the bucket "
                                    "does not hold yet, per kind (0: it holds all).", labels=["kind"])
            got = alog.lag()
            for kind in sorted({"commitlog", "consumequeue", "index", "mutable", *got}):
                lag.add_metric([kind], got.get(kind, 0.0))
            yield lag
            yield CounterMetricFamily(PREFIX + "append_objects", "Append objects of active segments uploaded.",
                                      value=alog.puts)
            yield CounterMetricFamily(PREFIX + "append_bytes", "Bytes of append objects uploaded.",
                                      value=alog.put_bytes)
            yield CounterMetricFamily(PREFIX + "rpo_rounds", "Continuous-tiering rounds that published a "
                                      "consistent point.", value=alog.rounds)
        s = eng.stats
        yield CounterMetricFamily(PREFIX + "uploads", "Segments uploaded and verified.", value=s.uploads)
        yield CounterMetricFamily(PREFIX + "uploaded_bytes", "Bytes of segments uploaded and verified.",
                                  value=s.upload_bytes)
        yield CounterMetricFamily(PREFIX + "fetches", "Fetches of evicted blocks (ranged GETs) installed.",
                                  value=s.fetches)
        yield CounterMetricFamily(PREFIX + "fetched_bytes", "Bytes fetched from the object store.",
                                  value=s.fetch_bytes)
        yield CounterMetricFamily(PREFIX + "prefetched_bytes", "Bytes fetched by read-ahead.",
                                  value=s.prefetch_bytes)
        reads = CounterMetricFamily(PREFIX + "tiered_reads", "Reads of tiered segments: answered from resident "
                                    "blocks (local) or after a fetch (waited).", labels=["result"])
        reads.add_metric(["local"], s.reads_local)
        reads.add_metric(["waited"], s.reads_waited)
        yield reads
        total = s.reads_local + s.reads_waited
        yield GaugeMetricFamily(PREFIX + "cache_hit_ratio", "Share of tiered reads answered without waiting for "
                                "the object store, since mount (1 with no reads yet).",
                                value=s.reads_local / total if total else 1.0)
        yield GaugeMetricFamily(PREFIX + "cache_bytes", "Resident bytes of tiered segments (the local cache).",
                                value=eng.cache_bytes)
        yield GaugeMetricFamily(PREFIX + "cache_budget_bytes", "The cache budget (cache.max_bytes).",
                                value=self.cache_budget)
        yield CounterMetricFamily(PREFIX + "evicted_bytes", "Bytes evicted (punched out of hot files).",
                                  value=s.evicted_bytes)
        yield CounterMetricFamily(PREFIX + "evicted_blocks", "Blocks evicted.",
                                  value=s.evicted_blocks)
        yield CounterMetricFamily(PREFIX + "rewrites", "Writes that turned a tiered segment hot again (gen+1).",
                                  value=s.rewrites)
        yield CounterMetricFamily(PREFIX + "identical_rewrites", "Writes into tiered segments that changed nothing.",
                                  value=s.identical_rewrites)
        errors = CounterMetricFamily(PREFIX + "errors", "Tiering errors by type.", labels=["type"])
        errors.add_metric(["fetch"], s.fetch_errors)
        errors.add_metric(["corrupt_object"], s.corrupt_objects)
        errors.add_metric(["upload"], s.upload_failures)
        # continuous tiering's append objects that failed (a file deleted before its upload is not one)
        errors.add_metric(["append_upload"], alog.put_failures if alog is not None else 0)
        errors.add_metric(["lease_renewal"], eng.lease.renew_failures if eng.lease is not None else 0)
        yield errors
        # failing uploads or fetches, or lease renewals (the one request an idle writable mount keeps making)
        downs = [t for t in (eng.store_down_since, eng.lease.failing_since if eng.lease is not None else None) if t]
        yield GaugeMetricFamily(PREFIX + "objectstore_down_seconds",
                                "How long the object store has been failing uploads, fetches or lease renewals "
                                "(0: answering).", value=time.time() - min(downs) if downs else 0.0)

        yield from self._hot_dir(eng.hot)

        windows = [ra.window for ra in list(eng.cache.streams.values())]
        yield GaugeMetricFamily(PREFIX + "readahead_streams", "Open read streams of tiered segments.",
                                value=len(windows))
        edges = []
        e = 1
        while e < self.readahead_max:
            edges.append(e)
            e *= 2
        edges.append(self.readahead_max)
        buckets = [(str(x), sum(1 for w in windows if w <= x)) for x in edges] + [("+Inf", len(windows))]
        yield GaugeHistogramMetricFamily(PREFIX + "readahead_window_blocks",
                                         "Read-ahead windows (blocks) of the open streams right now.",
                                         buckets=buckets, gsum_value=sum(windows))
        yield GaugeMetricFamily(PREFIX + "prefetch_inflight_bytes", "Prefetched bytes in flight.",
                                value=eng.cache.prefetch_inflight)
        yield GaugeMetricFamily(PREFIX + "prefetch_budget_bytes", "The read-ahead budget (readahead.budget_bytes).",
                                value=self.readahead_budget)

    @staticmethod
    def _archive(eng: Engine) -> Iterator[Metric]:
        """Freshness of the archive (archive.max_lag_seconds): what waits now, and what the last job achieved."""
        c = eng.compactor
        lag = c.archive_lag()
        if lag is not None:
            yield GaugeMetricFamily(PREFIX + "archive_lag_seconds", "Age (since its last write) of the oldest sealed "
                                    "CommitLog segment not archived yet; 0 when none waits.", value=lag)
        if c.last_archive_lag is not None:
            yield GaugeMetricFamily(PREFIX + "archive_last_lag_seconds", "Worst time from last write to the archive "
                                    "of the segments the last archiving job committed.", value=c.last_archive_lag)
        yield GaugeMetricFamily(PREFIX + "archive_max_lag_seconds", "The freshness bound (archive.max_lag_seconds).",
                                value=float(eng.config["archive.max_lag_seconds"]))

    @staticmethod
    def _lease(eng: Engine) -> Iterator[Metric]:
        """The writer lease of a writable mount (none on a read-only one): while it is not held, nothing is
        uploaded, deleted or snapshotted; fenced means taken over for good (only a remount writes again)."""
        lease = eng.lease
        if lease is None:
            return
        yield GaugeMetricFamily(PREFIX + "lease_held", "1 while this mount holds the store id's writer lease "
                                "(uploads, deletes and snapshots run), 0 while it does not.",
                                value=1 if lease.held() else 0)
        yield GaugeMetricFamily(PREFIX + "lease_fenced", "1 once another mount took the writer lease over: this "
                                "daemon never writes to the store again (remount it).", value=1 if lease.fenced else 0)

    @staticmethod
    def _hot_dir(hot: str | os.PathLike) -> Iterator[Metric]:
        """Space of the hot dir's file system as the broker's writes and the catalog need it (statvfs)."""
        try:
            sv = os.statvfs(hot)
        except OSError as e:
            log.warning("metrics: statvfs of the hot dir %s failed: %s", hot, e)
            return
        yield GaugeMetricFamily(PREFIX + "hot_dir_size_bytes", "Size of the hot dir's file system.",
                                value=sv.f_blocks * sv.f_frsize)
        yield GaugeMetricFamily(PREFIX + "hot_dir_free_bytes", "Bytes of the hot dir's file system available to "
                                "unprivileged writers (statvfs f_bavail).", value=sv.f_bavail * sv.f_frsize)


def _nothing_to_copy() -> Generator[None, None, None]:
    """The metrics view takes no snapshot on the loop: StateCollector copies what it reads itself."""
    return
    yield  # a generator


class Metrics:
    """One daemon's registry; `text()` is the exposition served at /.tierfs/metrics and by the listener.

    Made (and its listener bound) before the engine exists, so a taken port refuses the mount before anything
    else is held; `install` then connects it to the FUSE front and the engine."""

    def __init__(self, config: Config):
        self.config = config
        disable_created_metrics()  # no `_created` series: they double the output and mean nothing here
        self.registry = CollectorRegistry(auto_describe=False)
        self.transfers = Transfers(self.registry)
        self.listen = str(config["metrics.listen"])
        self._server = None
        self._cached: tuple[float, str] = (-1.0, "")

    def install(self, ops: TierOperations) -> None:
        """Read `ops` at scrape time, take the engine's transfer observations, add /.tierfs/metrics."""
        self.registry.register(StateCollector(ops, self.config))
        if ops.engine is not None:
            ops.engine.observe = self.transfers.observe
        # rendered in a worker thread like an HTTP scrape (the collector reads only copies it makes in single C
        # calls), so a scrape of 100,000 rows never stops the FUSE requests on the loop
        ops.control.add_snapshot("metrics", _nothing_to_copy, lambda _: self.control_text())

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def control_text(self) -> str:
        """The control file renders on every lookup, getattr and open (a `cat` is 2-3 of them): reuse a scrape
        for CONTROL_TTL seconds, so one `cat` costs one scrape and its size matches its content."""
        now = time.monotonic()
        at, text = self._cached
        if now - at > CONTROL_TTL or at < 0:
            text = self.text()
            self._cached = (time.monotonic(), text)  # from when it finished: a slow scrape is reused, not redone
        return text

    def start_listener(self) -> None:
        """Serve the registry over HTTP when metrics.listen is set; a bind failure names the key."""
        if not self.listen:
            return
        host, _, port = self.listen.rpartition(":")
        host = host.strip("[]")
        try:
            self._server, _ = start_http_server(int(port), addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(e.errno, f"config key 'metrics.listen': cannot listen on {self.listen}: {e.strerror}") \
                from None
        log.info("metrics listener on http://%s/metrics", self.listen)

    def stop_listener(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

