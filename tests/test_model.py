"""A randomized model-based test of the engine (issues 10, 27): a seeded sequence of create / append / mmap write /
write through any name / fsync / rename (also over another file) / hard link / unlink / unlink while open / a write
through /proc/self/fd of an unlinked file / RENAME_EXCHANGE / rename of the topic directory / truncate / re-create
under the same name / remount / kill -9 and mount again, on a mount with a tiny budget, zero grace and aggressive
seal and eviction, checked after every step against a plain in-memory model of the same files (hard links share
one content object, as they share one inode). Every byte must be equal and no read may fail.

The files are ConsumeQueue segments made of valid units, so most of them seal, tier and get evicted while the
sequence runs. `TIERFS_MODEL_SEED` replays a failure (the seed is in every assertion message);
`TIERFS_MODEL_STEPS` sets the length; the long run is `-m slow`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import struct
import time

import pytest

from mountutil import wait_for

MODEL_OPTS = ("tiering.enabled=true,cache.max_bytes=0,cache.block_bytes=4KiB,objectstore.chunk_bytes=64KiB,"
              "seal.quiet_seconds=0.05,seal.scan_interval_seconds=0.1,delete.grace_seconds=0")
ROOT = "consumequeue"
TOPICS = ("TopicM", "TopicN")  # the topic directory is renamed between these two
QUEUES = ("0", "1")
NAMES = [f"{i * 6000:020d}" for i in range(6)] + ["x.bin"]  # x.bin: a name that is no segment (never sealed)
UNIT = 20
RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def unit(i: int, tag: int) -> bytes:
    return struct.pack(">qiq", i * 100, 100, tag)


class Model:
    """The files as a plain local directory would hold them, and the fds held open on unlinked ones."""

    def __init__(self, m, rng: random.Random, seed: int):
        self.m, self.rng, self.seed = m, rng, seed
        self.topic = TOPICS[0]
        # "<queue>/<name>" -> content; hard links are one bytearray under several names
        self.files: dict[str, bytearray] = {}
        self.held: list[tuple[int, bytearray]] = []  # (fd on the mount, content) of unlinked files
        self.log: list[str] = []

    def groups(self) -> list[list[str]]:
        """The names of each file (hard links share one content object)."""
        out: dict[int, list[str]] = {}
        for n, d in self.files.items():
            out.setdefault(id(d), []).append(n)
        return list(out.values())

    def path(self, name: str):
        return self.m.mnt / ROOT / self.topic / name

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

    def odd_mix(self, *names: str) -> bool:
        """A hard-linked file that would have both a segment name and x.bin: its catalog row keeps one name, and
        a HOT row named x.bin is never sealed through its other link (a known limit, not modelled)."""
        for name in names:
            group = self.links(name) if name in self.files else [name]
            if len(group) > 1 and any(n.endswith("x.bin") for n in group):
                return True
        return False

    def rename(self, name: str) -> None:
        to = self.rng.choice(self.all_names())
        if to == name or (to.endswith("x.bin") and len(self.links(name)) > 1):
            return
        if to in self.files and self.files[to] is self.files[name]:
            return  # two links of one file: rename(2) does nothing
        os.rename(self.path(name), self.path(to))
        self.files[to] = self.files.pop(name)

    def link(self, name: str) -> None:
        to = self.rng.choice([n for n in self.all_names() if n not in self.files] or [name])
        if to == name or to.endswith("x.bin") or any(n.endswith("x.bin") for n in self.links(name)):
            return
        os.link(self.path(name), self.path(to))
        self.files[to] = self.files[name]

    def unlink(self, name: str) -> None:
        os.unlink(self.path(name))
        del self.files[name]

    def exchange(self, name: str) -> None:
        other = self.rng.choice(sorted(self.files))
        if other == name or self.files[other] is self.files[name] or (
                (name.endswith("x.bin") or other.endswith("x.bin"))
                and (len(self.links(name)) > 1 or len(self.links(other)) > 1)):
            return
        a, b = os.fsencode(self.path(name)), os.fsencode(self.path(other))
        assert _libc.renameat2(-100, a, -100, b, RENAME_EXCHANGE) == 0, os.strerror(ctypes.get_errno())
        self.files[name], self.files[other] = self.files[other], self.files[name]

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

    def remount(self) -> None:
        while self.held:
            os.close(self.held.pop()[0])
        self.m.umount()
        self.m.mount()

    def kill9(self) -> None:
        """kill -9 the daemon and mount again: after an fsync of every file, nothing may be lost."""
        while self.held:
            os.close(self.held.pop()[0])
        for name in self.files:
            self.fsync(name)
        self.m.kill()
        self.m.mount()

    def pause(self) -> None:
        time.sleep(self.rng.choice((0.02, 0.1, 0.3)))  # lets seal, upload and eviction run between steps

    # ---------------------------------------------------------------- checks

    def check(self, step: int) -> None:
        where = f"seed {self.seed}, step {step}, after {self.log[-3:]}"
        assert sorted(os.listdir(self.m.mnt / ROOT)) == [self.topic], where
        for q in QUEUES:
            want = sorted(n.partition("/")[2] for n in self.files if n.startswith(q + "/"))
            assert sorted(os.listdir(self.path(q))) == want, where
        for name, want in self.files.items():
            fd = os.open(self.path(name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                got = os.pread(fd, len(want) + 1, 0)
            finally:
                os.close(fd)
            assert got == want, f"{name}: {len(got)} bytes read, {len(want)} expected, " \
                                f"{sum(a != b for a, b in zip(got, want))} differ ({where})"
        for fd, want in self.held:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got = os.pread(fd, len(want) + 1, 0)
            assert got == want, f"open unlinked file: {sum(a != b for a, b in zip(got, want))} bytes differ ({where})"

    def step(self, i: int) -> None:
        rng = self.rng
        have = sorted(self.files)
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
        choices += [("pause", None)] * 3 + [("rename_topic", None)] * (rng.random() < 0.1)
        r = rng.random()
        if r < 0.01:
            choices = [("remount", None)]
        elif r < 0.015:
            choices = [("kill9", None)]
        op, arg = rng.choice(choices)
        self.log.append(f"{op}({arg})" if arg else op)
        getattr(self, op)(*(() if arg is None else (arg,)))
        self.check(i)


def run_model(mount_store, steps: int) -> None:
    seed = int(os.environ.get("TIERFS_MODEL_SEED") or random.randrange(1 << 31))
    print(f"model seed {seed}, {steps} steps")
    m = mount_store(options=[MODEL_OPTS])
    model = Model(m, random.Random(seed), seed)
    for q in QUEUES:
        model.path(q).mkdir(parents=True)
    for i in range(steps):
        model.step(i)
    while model.held:
        model.close_one()
    # at rest every complete file tiers and is evicted, and still reads back exactly
    for name in model.files:
        model.fsync(name)

    def settled() -> bool:
        files = {f["path"]: f for f in m.status()["files"]}
        # one row per file (a hard-linked one has it under one of its names); x.bin alone never tiers
        return all(any(files.get(f"{ROOT}/{model.topic}/{n}", {}).get("state") == "tiered" for n in names)
                   for names in model.groups() if model.files[names[0]] and not all(n.endswith("x.bin")
                                                                                   for n in names))

    wait_for(settled, timeout=120, what=f"every file tiered at rest (seed {seed})")
    model.check(steps)
    assert m.alive()
    assert "Traceback" not in m.log_text(), f"seed {seed}: {m.log_tail(40)}"


@pytest.mark.parametrize("seed", [1, 27, None])  # fixed seeds, and one random one (printed; replay it with
def test_model_random_operations_against_a_local_directory(mount_store, seed, monkeypatch):  # TIERFS_MODEL_SEED)
    if seed is not None and not os.environ.get("TIERFS_MODEL_SEED"):
        monkeypatch.setenv("TIERFS_MODEL_SEED", str(seed))
    run_model(mount_store, int(os.environ.get("TIERFS_MODEL_STEPS", "1000")))


@pytest.mark.slow
def test_model_long_run(mount_store):
    run_model(mount_store, int(os.environ.get("TIERFS_MODEL_STEPS", "20000")))
