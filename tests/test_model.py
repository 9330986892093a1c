"""A randomized model-based test of the whole product (issues 10, 27, 28): a seeded walk of thousands of operations
through a real tierfs mount, checked against a plain in-memory model of the same files (hard links share one
content object, as they share one inode). Every byte must be equal and no read may fail.

The walk: create / append / mmap write / a write at any offset (evicted ones too) through whatever name the file
has / fsync / rename (also over another file) / hard link / unlink / unlink while open and a write through
/proc/self/fd of the unlinked file / RENAME_EXCHANGE / rename of the topic directory / truncate / re-create under
the same name / remount / kill -9 and mount again / **takeover**: the daemon is killed with its whole hot dir and
`tierfs mount --takeover --force` builds the store again from the bucket in a new, empty hot dir, from the latest
catalog snapshot; / **compaction**: one `tierfs compact` per run (a real Spark job, lz4c objects swapped in) while
the walk goes on.

The mount has a budget of 0 bytes (every tiered block is evicted at once, every check of a tiered file fetches),
zero grace, aggressive sealing, and a file:// bucket with continuous tiering each second: every round publishes a
catalog snapshot, so the kept snapshots roll and the janitor really deletes the objects of unlinked, rewritten
and compacted segments during the run; any object deleted while something still referred to it shows as a read
that fails or differs later.

What a takeover must serve: the model's state at a moment T after which nothing was written, once every file was
fsync'd before T and a continuous-tiering round that started after T has published its point. Data not fsync'd
(an mmap write still in the kernel's page cache of a tiered file) is not owed to a snapshot, so the walk fsyncs
every file first, as the kill -9 step does.

The files are ConsumeQueue segments made of valid units, so most of them seal, tier and get evicted while the
walk runs. After every step the files it touched are read back; every FULL_CHECK_EVERY steps and after every
remount, kill, takeover and compaction all of them, and the file id stamped on each hot inode must be the id of
its catalog row (one file, one identity). At rest every file must tier and be evicted and read back exactly, and
`tierfs fsck --deep` must find every object a row names whole. The run must have evicted bytes, fetched them back,
deleted objects and swapped a compacted segment in (issue 28: a walk that never tiered tests nothing).

`TIERFS_MODEL_SEED` replays a failure (the seed is in every assertion message and printed at the start);
`TIERFS_MODEL_STEPS` sets the length; the long run is `-m slow`.
"""

from __future__ import annotations

import collections
import ctypes
import json
import mmap
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from mountutil import TIERFS_CMD, Mount, stop_process, wait_for
from tierfs.tier import identity

MODEL_OPTS = ("tiering.enabled=true,cache.max_bytes=0,cache.block_bytes=4KiB,objectstore.chunk_bytes=64KiB,"
              "seal.quiet_seconds=0.05,seal.scan_interval_seconds=0.1,delete.grace_seconds=0")
STORE_ID = "model"
# a round (and its snapshot) every second: a takeover point is never far, and kept snapshots roll quickly
BUCKET_OPTS = (f"store.id={STORE_ID},tiering.rpo_seconds=1,snapshot.interval_seconds=1,lease.ttl_seconds=60,"
               "compaction.enabled=false,spark.master=local[1]")
ROOT = "consumequeue"
TOPICS = ("TopicM", "TopicN")  # the topic directory is renamed between these two
QUEUES = ("0", "1")
NAMES = [f"{i * 6000:020d}" for i in range(6)] + ["x.bin"]  # x.bin: a name that is no segment (never sealed)
UNIT = 20
RENAME_EXCHANGE = 2
FULL_CHECK_EVERY = 20
FULL_CHECK_OPS = frozenset(("remount", "kill9", "takeover", "rename_topic", "finish_compaction"))
_libc = ctypes.CDLL(None, use_errno=True)


def unit(i: int, tag: int) -> bytes:
    return struct.pack(">qiq", i * 100, 100, tag)


class ModelMount(Mount):
    """A mount that can move: once its daemon is lost with its whole hot dir, `take_over` mounts the store again
    from the bucket (`tierfs mount --takeover --force HOLDER --from URL`) into a new, empty hot dir at the same
    mountpoint, as an operator replacing a dead node does; later mounts are plain mounts of that hot dir."""

    def __init__(self, hot: Path, mnt: Path, bucket: str, options: tuple[str, ...]):
        super().__init__(hot, mnt, options=options)
        self.bucket = bucket
        self._force: str | None = None  # the lost writer's holder, for the next mount only

    def mount_args(self) -> list[str]:
        if self._force is None:
            return super().mount_args()
        cmd = ["mount", "--takeover", "--from", f"{self.bucket}/{STORE_ID}", "--force", self._force,
               str(self.hot), str(self.mnt)]
        for o in self.options:
            cmd += ["-o", o]
        return cmd

    def take_over(self, hot: Path) -> None:
        """Mount from the bucket into `hot` (empty), overriding the lease of the daemon of the current hot dir
        ("host:hot dir" names it: the lease holder of a lost node as an operator knows it)."""
        self._force = f"{socket.gethostname()}:{self.hot}"
        self.hot, self.log = hot.resolve(), hot.resolve() / ".tierfs" / "tierfs.log"
        try:
            self.mount()
        finally:
            self._force = None

    def engine_totals(self) -> dict:
        return self.status()["totals"]["engine"]


@dataclass
class Seen:
    """What the run did to the store, summed over every daemon it started (counters start at 0 in each)."""

    evicted_bytes: int = 0
    fetched_bytes: int = 0  # every GET of tiered bytes (blocks installed, or units and blocks read from memory)
    janitor_deletes: int = 0  # objects the janitor deleted (log lines of every hot dir)
    remounts: int = 0
    kills: int = 0
    takeovers: int = 0
    swaps: int = 0  # segments a compaction job swapped to lz4c objects

    def daemon_gone(self, totals: dict) -> None:
        self.evicted_bytes += int(totals["evicted_bytes"])
        self.fetched_bytes += int(totals["fetch_bytes"])

    def hot_dir_gone(self, log_text: str) -> None:
        self.janitor_deletes += sum(int(n) for n in re.findall(r"deleted (\d+) objects$", log_text, re.M))


class Model:
    """The files as a plain local directory would hold them, and the fds held open on unlinked ones."""

    def __init__(self, m: ModelMount, rng: random.Random, seed: int, steps: int, tmp: Path):
        self.m, self.rng, self.seed, self.tmp = m, rng, seed, tmp
        self.topic = TOPICS[0]
        # "<queue>/<name>" -> content; hard links are one bytearray under several names
        self.files: dict[str, bytearray] = {}
        self.held: list[tuple[int, bytearray]] = []  # (fd on the mount, content) of unlinked files
        self.log: list[str] = []
        self.seen = Seen()
        self.op_seconds: collections.Counter[str] = collections.Counter()
        self.op_count: collections.Counter[str] = collections.Counter()
        # one compaction per run, started at a random step of its first half; at least one takeover, in its
        # second half if no random step made one before
        self.compact_at = rng.randrange(steps // 8, max(steps // 8 + 1, steps // 2))
        self.takeover_at = rng.randrange(steps // 2, max(steps // 2 + 1, steps * 9 // 10))
        self.compaction: subprocess.Popen | None = None
        self.frozen: set[str] = set()  # the names of the file the running compaction must swap: left alone

    def groups(self) -> list[list[str]]:
        """The names of each file (hard links share one content object)."""
        out: dict[int, list[str]] = {}
        for n, d in self.files.items():
            out.setdefault(id(d), []).append(n)
        return list(out.values())

    def path(self, name: str):
        return self.m.mnt / ROOT / self.topic / name

    def rel(self, name: str) -> str:
        return f"{ROOT}/{self.topic}/{name}"

    def all_names(self) -> list[str]:
        return [f"{q}/{n}" for q in QUEUES for n in NAMES]

    def units(self, start: int, n: int) -> bytes:
        tag = self.rng.randrange(1 << 40)
        return b"".join(unit(start + i, tag + i) for i in range(n))

    # ---------------------------------------------------------------- steps

    def create(self, name: str) -> None:
        data = self.units(0, self.rng.randrange(1, 700))
        with open(self.path(name), "wb") as f:
            f.write(data)
            if self.rng.random() < 0.7:
                f.flush()
                os.fsync(f.fileno())
        self.files[name] = bytearray(data)

    def append(self, name: str) -> None:
        cur = self.files[name]
        data = self.units(len(cur) // UNIT, self.rng.randrange(1, 300))
        with open(self.path(name), "ab") as f:
            f.write(data)
            if self.rng.random() < 0.5:
                f.flush()
                os.fsync(f.fileno())
        cur += data

    def mmap_write(self, name: str) -> None:
        cur = self.files[name]
        n = len(cur) // UNIT
        first = self.rng.randrange(n)
        count = min(self.rng.randrange(1, 200), n - first)
        data = self.units(first, count)
        fd = os.open(self.path(name), os.O_RDWR)
        try:
            with mmap.mmap(fd, len(cur)) as mp:
                mp[first * UNIT:first * UNIT + len(data)] = data
                if self.rng.random() < 0.3:
                    mp.flush()
        finally:
            os.close(fd)
        cur[first * UNIT:first * UNIT + len(data)] = data

    def fsync(self, name: str) -> None:
        fd = os.open(self.path(name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def links(self, name: str) -> list[str]:
        return [n for n, d in self.files.items() if d is self.files[name]]

    def rename(self, name: str) -> None:
        to = self.rng.choice(self.all_names())
        if to == name or to in self.frozen or (to.endswith("x.bin") and len(self.links(name)) > 1):
            return
        if to in self.files and self.files[to] is self.files[name]:
            return  # two links of one file: rename(2) does nothing
        os.rename(self.path(name), self.path(to))
        self.files[to] = self.files.pop(name)
        self.log[-1] += f" -> {to}"

    def link(self, name: str) -> None:
        to = self.rng.choice([n for n in self.all_names() if n not in self.files] or [name])
        if to == name or to.endswith("x.bin") or any(n.endswith("x.bin") for n in self.links(name)):
            return
        os.link(self.path(name), self.path(to))
        self.files[to] = self.files[name]
        self.log[-1] += f" -> {to}"

    def unlink(self, name: str) -> None:
        os.unlink(self.path(name))
        del self.files[name]

    def exchange(self, name: str) -> None:
        other = self.rng.choice(sorted(self.files))
        if other == name or other in self.frozen or self.files[other] is self.files[name] or (
                (name.endswith("x.bin") or other.endswith("x.bin"))
                and (len(self.links(name)) > 1 or len(self.links(other)) > 1)):
            return
        a, b = os.fsencode(self.path(name)), os.fsencode(self.path(other))
        assert _libc.renameat2(-100, a, -100, b, RENAME_EXCHANGE) == 0, os.strerror(ctypes.get_errno())
        self.files[name], self.files[other] = self.files[other], self.files[name]
        self.log[-1] += f" <-> {other}"

    def rename_topic(self) -> None:
        new = TOPICS[1] if self.topic == TOPICS[0] else TOPICS[0]
        os.rename(self.m.mnt / ROOT / self.topic, self.m.mnt / ROOT / new)
        self.topic = new

    def write_any_name(self, name: str) -> None:
        """A plain write at any offset (evicted ones too) through whatever name the file has now."""
        cur = self.files[name]
        first = self.rng.randrange(len(cur) // UNIT)
        data = self.units(first, min(self.rng.randrange(1, 50), len(cur) // UNIT - first))
        fd = os.open(self.path(name), os.O_RDWR)
        try:
            os.pwrite(fd, data, first * UNIT)
        finally:
            os.close(fd)
        cur[first * UNIT:first * UNIT + len(data)] = data

    def unlink_while_open(self, name: str) -> None:
        fd = os.open(self.path(name), os.O_RDONLY)
        os.unlink(self.path(name))
        self.held.append((fd, self.files.pop(name)))

    def write_through_proc(self) -> None:
        """Reopen a held unlinked file read-write through /proc/self/fd and write into it."""
        fd, cur = self.rng.choice(self.held)
        if len(cur) < UNIT:
            return
        first = self.rng.randrange(len(cur) // UNIT)
        data = self.units(first, min(self.rng.randrange(1, 50), len(cur) // UNIT - first))
        w = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            os.pwrite(w, data, first * UNIT)
        finally:
            os.close(w)
        cur[first * UNIT:first * UNIT + len(data)] = data

    def truncate(self, name: str) -> None:
        cur = self.files[name]
        keep = self.rng.randrange(0, len(cur) // UNIT + 1) * UNIT
        os.truncate(self.path(name), keep)
        del cur[keep:]

    def recreate(self, name: str) -> None:
        os.unlink(self.path(name))
        del self.files[name]
        self.create(name)

    def close_one(self) -> None:
        fd, _ = self.held.pop(self.rng.randrange(len(self.held)))
        os.close(fd)

    def close_all(self) -> None:
        while self.held:
            os.close(self.held.pop()[0])

    def fsync_all(self) -> None:
        for name in self.files:
            self.fsync(name)

    def remount(self) -> None:
        self.close_all()
        self.seen.daemon_gone(self.m.engine_totals())
        self.m.umount()
        self.m.mount()
        self.seen.remounts += 1

    def kill9(self) -> None:
        """kill -9 the daemon and mount again: after an fsync of every file, nothing may be lost."""
        self.close_all()
        self.fsync_all()
        self.seen.daemon_gone(self.m.engine_totals())
        self.m.kill()
        self.m.mount()
        self.seen.kills += 1

    def takeover(self) -> None:
        """The node is lost: every file fsync'd at T, a round that started after T published its point, then the
        daemon is killed and its hot dir removed; a takeover into a new hot dir must serve the model as of T."""
        self.close_all()
        self.fsync_all()
        # Known bug (test_model_findings.py, xfail): a takeover builds a hard-linked file that is not tiered at
        # its point as one file per name. Linked files are waited for until tiered; an empty one never tiers,
        # so the model takes the split (both names empty: nothing to compare until the next write).
        linked = [names for names in self.groups() if len(names) > 1]
        wait_for(lambda: all(self.tiered(names) for names in linked if self.files[names[0]]), timeout=60,
                 what=f"hard-linked files tiered before the takeover (seed {self.seed})")
        for names in linked:
            if not self.files[names[0]]:
                for n in names:
                    self.files[n] = bytearray()
        t = time.time()

        def round_after() -> bool:
            last = self.m.status()["rpo"].get("last_round") or {}
            return last.get("time", 0) > t
        wait_for(round_after, timeout=60, interval=0.1, what=f"a continuous-tiering round after {t} "
                                                               f"(seed {self.seed})")
        self.seen.daemon_gone(self.m.engine_totals())
        self.m.kill()
        self.seen.hot_dir_gone(self.m.log_text())
        shutil.rmtree(self.m.hot)
        self.seen.takeovers += 1
        hot = self.tmp / f"hot-takeover{self.seen.takeovers}"
        hot.mkdir()
        self.m.take_over(hot)

    def evict(self) -> None:
        """`tierfs evict`: every tiered segment not read in the last second loses its local blocks now."""
        res = self.m.cli("evict", self.m.mnt)
        assert res.returncode == 0, f"seed {self.seed}: tierfs evict: {res.stderr}"

    def pause(self) -> None:
        time.sleep(self.rng.choice((0.02, 0.1, 0.2)))  # lets seal, upload and eviction run between steps

    # ---------------------------------------------------------------- compaction

    def start_compaction(self) -> None:
        """`tierfs compact` (segments: raw chunks -> one lz4c object each) runs while the walk goes on. One tiered
        file is left alone until the job is applied, so at least one swap must happen whatever the walk does to
        the others (their swaps may be skipped: written, unlinked or renamed meanwhile)."""
        files = {f["path"]: f for f in self.m.status()["files"]}
        for names in self.groups():
            rows = [files.get(self.rel(n)) for n in names]
            if any(r and r["state"] == "tiered" and r.get("format") == "raw" for r in rows) and \
                    not any(n.endswith("x.bin") for n in names):
                self.frozen = set(names)
                break
        else:
            return  # nothing tiered yet: try again at a later step
        self.compaction = subprocess.Popen([*TIERFS_CMD, "compact", str(self.m.mnt), "--only", "segments", "--json"],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           start_new_session=True)

    def finish_compaction(self) -> None:
        proc = self.compaction
        out, err = proc.communicate(timeout=600)
        self.compaction = None
        where = f"seed {self.seed}: tierfs compact exited {proc.returncode}: {err}\n{out}\n{self.m.log_tail(20)}"
        summary = json.loads(out) if out.strip() else {}
        assert summary.get("applied", {}).get("segments", 0) >= 1, where
        frozen = [self.rel(n) for n in self.frozen]
        assert not [e for e in summary["errors"] if e["path"] in frozen], where
        files = {f["path"]: f for f in self.m.status()["files"]}
        assert any(files.get(p, {}).get("format") == "lz4c" for p in frozen), f"{frozen} not swapped: {where}"
        self.seen.swaps += summary["applied"]["segments"]
        print(f"seed {self.seed}: compaction job {summary.get('seconds')} s, applied {summary['applied']}, "
              f"{len(summary['skipped'])} skipped, {len(summary['errors'])} errors {summary['errors'][:2]}")
        self.frozen = set()

    # ---------------------------------------------------------------- checks

    def check(self, step: int, names: set[str] | None = None, held: bool = True) -> None:
        """Listings always; the content of `names` (None: of every file) and of the held unlinked files."""
        where = f"seed {self.seed}, step {step}, after {self.log[-3:]}"
        assert sorted(os.listdir(self.m.mnt / ROOT)) == [self.topic], where
        for q in QUEUES:
            want = sorted(n.partition("/")[2] for n in self.files if n.startswith(q + "/"))
            assert sorted(os.listdir(self.path(q))) == want, where
        for name in sorted(self.files if names is None else names & self.files.keys()):
            want = self.files[name]
            fd = os.open(self.path(name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                got = os.pread(fd, len(want) + 1, 0)
            finally:
                os.close(fd)
            assert got == want, f"{name}: {len(got)} bytes read, {len(want)} expected, " \
                                f"{sum(a != b for a, b in zip(got, want))} differ ({where})"
        if names is None:
            self.check_identity(where)
        for fd, want in self.held if held else ():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got = os.pread(fd, len(want) + 1, 0)
            assert got == want, f"open unlinked file: {sum(a != b for a, b in zip(got, want))} bytes differ ({where})"

    def check_identity(self, where: str) -> None:
        """One file, one identity: the file id stamped on each file's hot inode is the id of its catalog row
        (a hard-linked file has one row, under one of its names). A split shows here at once; a remount would
        take the row for another file's and delete its objects."""
        rows = {f["path"]: f["file_id"] for f in self.m.status()["files"]}
        for names in self.groups():
            ids = {rows[self.rel(n)] for n in names if self.rel(n) in rows}
            try:
                stamp = int(os.getxattr(self.m.hot / self.rel(names[0]), identity.XATTR))
            except OSError:
                stamp = None  # not sealed yet: no id
            assert not ids or ids == {stamp}, f"{names}: catalog rows of ids {ids}, inode stamped {stamp} ({where})"

    def choose(self, i: int) -> tuple[str, str | None]:
        rng = self.rng
        have = sorted(n for n in self.files if n not in self.frozen)
        free = [n for n in self.all_names() if n not in self.files]
        choices = []
        if free:
            choices += [("create", rng.choice(free))] * 3
        if have:
            name = rng.choice(have)
            choices += [("append", name)] * 3 + [("mmap_write", name)] * 3 + [("fsync", name), ("rename", name),
                        ("unlink_while_open", name), ("truncate", name), ("recreate", name), ("link", name),
                        ("unlink", name), ("exchange", name), ("write_any_name", name)]
            if not self.files[name]:
                choices = [c for c in choices if c[0] not in ("mmap_write", "write_any_name")]
        if self.held:
            choices += [("close_one", None), ("write_through_proc", None)]
        choices += [("pause", None)] * 3 + [("rename_topic", None)] * (rng.random() < 0.1 and not self.frozen)
        r = rng.random()
        if self.compaction is not None:  # the job's daemon must stay up until its swap is applied
            if self.compaction.poll() is not None:
                return "finish_compaction", None
        elif i >= self.compact_at and not self.seen.swaps:
            return "start_compaction", None
        elif r < 0.001 or (i >= self.takeover_at and not self.seen.takeovers):
            return "takeover", None
        elif r < 0.005:
            return "remount", None
        elif r < 0.008:
            return "kill9", None
        elif r < 0.013:
            return "evict", None
        return rng.choice(choices)

    def step(self, i: int) -> None:
        op, arg = self.choose(i)
        self.log.append(f"{op}({arg})" if arg else op)
        before = {n: id(d) for n, d in self.files.items()}
        links = set(self.links(arg)) if arg in self.files else set()
        t0 = time.monotonic()
        getattr(self, op)(*(() if arg is None else (arg,)))
        self.op_seconds[op] += time.monotonic() - t0
        self.op_count[op] += 1
        touched = links | {n for n, d in self.files.items() if before.get(n) != id(d)}
        full = op in FULL_CHECK_OPS or i % FULL_CHECK_EVERY == 0
        t0 = time.monotonic()
        self.check(i, None if full else touched, held=full or op in ("unlink_while_open", "write_through_proc"))
        self.op_seconds["check"] += time.monotonic() - t0
        self.op_count["check"] += 1

    def tiered(self, names: list[str]) -> bool:
        """Is the file of these names tiered (its row is under one of them)?"""
        files = {f["path"]: f for f in self.m.status()["files"]}
        return any(files.get(self.rel(n), {}).get("state") == "tiered" for n in names)

    def settled(self) -> bool:
        """Every complete file tiered and evicted (a hard-linked one has its row under one of its names; x.bin
        alone never tiers)."""
        files = {f["path"]: f for f in self.m.status()["files"]}

        def evicted(row: dict) -> bool:
            return row.get("state") == "tiered" and row.get("resident_bytes") == 0
        return all(any(evicted(files.get(self.rel(n), {})) for n in names)
                   for names in self.groups()
                   if self.files[names[0]] and not all(n.endswith("x.bin") for n in names))


def run_model(tmp_path: Path, steps: int) -> None:
    seed = int(os.environ.get("TIERFS_MODEL_SEED") or random.randrange(1 << 31))
    print(f"model seed {seed}, {steps} steps (replay: TIERFS_MODEL_SEED={seed})")
    (tmp_path / "bucket").mkdir()
    (tmp_path / "mnt").mkdir()
    (tmp_path / "hot").mkdir()
    bucket = f"file://{tmp_path / 'bucket'}"
    m = ModelMount(tmp_path / "hot", tmp_path / "mnt", bucket, (MODEL_OPTS, f"objectstore.url={bucket},{BUCKET_OPTS}"))
    model = Model(m, random.Random(seed), seed, steps, tmp_path)
    t0 = time.monotonic()
    try:
        m.mount()
        for q in QUEUES:
            model.path(q).mkdir(parents=True)
        for i in range(steps):
            model.step(i)
        if model.compaction is not None:
            model.finish_compaction()
            model.check(steps)
        if not model.seen.takeovers:  # the job ran to the end of the walk
            model.takeover()
            model.check(steps)
        model.close_all()
        # at rest every complete file tiers and is evicted, and still reads back exactly
        model.fsync_all()
        wait_for(model.settled, timeout=120, what=f"every file tiered and evicted at rest (seed {seed})")
        model.check(steps)
        # every object a row names exists, whole and with its crc32c, and every resident block is right
        fsck = m.cli("fsck", m.mnt, "--deep", "--json", timeout=120)
        assert fsck.returncode in (0, 1), f"seed {seed}: tierfs fsck exited {fsck.returncode}: {fsck.stderr}"
        findings = json.loads(fsck.stdout)["findings"]
        # known leak, not a loss (see the report of issue 27's model walk): an object no row names is left
        orphans = [f["key"] for f in findings if f["kind"] == "orphan_object"]
        damage = [f for f in findings if f["kind"] != "orphan_object"]
        assert not damage, f"seed {seed}: tierfs fsck: {damage}"
        seen = model.seen
        seen.daemon_gone(m.engine_totals())
        seen.hot_dir_gone(m.log_text())
        assert m.alive()
        assert "Traceback" not in m.log_text(), f"seed {seed}: {m.log_tail(40)}"
    except BaseException:
        print(f"seed {seed}: the walk in {tmp_path / 'walk.log'}, the daemon's log in {m.log}")
        raise
    finally:
        (tmp_path / "walk.log").write_text("\n".join(model.log) + "\n")
        if model.compaction is not None:
            stop_process(model.compaction)
        m.cleanup()
    took = {op: f"{model.op_count[op]}x {s:.1f}s" for op, s in model.op_seconds.most_common()}
    print(f"model seed {seed}: {steps} steps in {time.monotonic() - t0:.0f} s; {seen}; {len(orphans)} orphaned "
          f"objects {orphans[:3]}; {took}")
    # issue 28: a walk that never evicted, fetched, deleted or swapped would prove nothing about those paths
    assert seen.evicted_bytes > 0 and seen.fetched_bytes > 0, f"seed {seed}: nothing evicted or fetched: {seen}"
    assert seen.janitor_deletes > 0, f"seed {seed}: the janitor deleted nothing: {seen}"
    assert seen.takeovers >= 1 and seen.swaps >= 1, f"seed {seed}: {seen}"


@pytest.mark.parametrize("seed", [1, 27, None])  # fixed seeds, and one random one (printed; replay it with
def test_model_random_operations_against_a_local_directory(tmp_path, fuse_required, seed,  # TIERFS_MODEL_SEED)
                                                           monkeypatch):
    if seed is not None and not os.environ.get("TIERFS_MODEL_SEED"):
        monkeypatch.setenv("TIERFS_MODEL_SEED", str(seed))
    run_model(tmp_path, int(os.environ.get("TIERFS_MODEL_STEPS", "2000")))


@pytest.mark.slow
def test_model_long_run(tmp_path, fuse_required):
    run_model(tmp_path, int(os.environ.get("TIERFS_MODEL_STEPS", "20000")))
