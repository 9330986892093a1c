"""A randomized model-based test of the engine (issue 10): a seeded sequence of create / append / mmap write /
fsync / rename / unlink while open / read through the open unlinked fd / truncate / re-create under the same name /
remount, on a mount with a tiny budget, zero grace and aggressive seal and eviction, checked after every step
against a plain in-memory model of the same files. Every byte must be equal and no read may fail.

The files are ConsumeQueue segments made of valid units, so most of them seal, tier and get evicted while the
sequence runs. `TIERFS_MODEL_SEED` replays a failure (the seed is in every assertion message);
`TIERFS_MODEL_STEPS` sets the length; the long run is `-m slow`.
"""

from __future__ import annotations

import mmap
import os
import random
import struct
import time

import pytest

from mountutil import wait_for

MODEL_OPTS = ("tiering.enabled=true,cache.max_bytes=0,cache.block_bytes=4KiB,objectstore.chunk_bytes=64KiB,"
              "seal.quiet_seconds=0.05,seal.scan_interval_seconds=0.1,delete.grace_seconds=0")
DIR = "consumequeue/TopicM/0"
NAMES = [f"{i * 6000:020d}" for i in range(6)]
UNIT = 20


def unit(i: int, tag: int) -> bytes:
    return struct.pack(">qiq", i * 100, 100, tag)


class Model:
    """The files as a plain local directory would hold them, and the fds held open on unlinked ones."""

    def __init__(self, m, rng: random.Random, seed: int):
        self.m, self.rng, self.seed = m, rng, seed
        self.files: dict[str, bytearray] = {}
        self.held: list[tuple[int, bytes]] = []  # (fd on the mount, content) of unlinked files
        self.log: list[str] = []

    def path(self, name: str):
        return self.m.mnt / DIR / name

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

    def rename(self, name: str) -> None:
        to = self.rng.choice(NAMES)
        if to == name:
            return
        os.rename(self.path(name), self.path(to))
        self.files[to] = self.files.pop(name)

    def unlink_while_open(self, name: str) -> None:
        fd = os.open(self.path(name), os.O_RDONLY)
        os.unlink(self.path(name))
        self.held.append((fd, bytes(self.files.pop(name))))

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

    def pause(self) -> None:
        time.sleep(self.rng.choice((0.02, 0.1, 0.3)))  # lets seal, upload and eviction run between steps

    # ---------------------------------------------------------------- checks

    def check(self, step: int) -> None:
        where = f"seed {self.seed}, step {step}, after {self.log[-3:]}"
        assert sorted(os.listdir(self.m.mnt / DIR)) == sorted(self.files), where
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
        free = [n for n in NAMES if n not in self.files]
        choices = []
        if free:
            choices += [("create", rng.choice(free))] * 3
        if have:
            name = rng.choice(have)
            choices += [("append", name)] * 3 + [("mmap_write", name)] * 3 + [("fsync", name), ("rename", name),
                        ("unlink_while_open", name), ("truncate", name), ("recreate", name)]
            if not self.files[name]:
                choices = [c for c in choices if c[0] != "mmap_write"]
        if self.held:
            choices.append(("close_one", None))
        choices += [("pause", None)] * 3
        if rng.random() < 0.01:
            choices = [("remount", None)]
        op, arg = rng.choice(choices)
        self.log.append(f"{op}({arg})" if arg else op)
        getattr(self, op)(*(() if arg is None else (arg,)))
        self.check(i)


def run_model(mount_store, steps: int) -> None:
    seed = int(os.environ.get("TIERFS_MODEL_SEED") or random.randrange(1 << 31))
    print(f"model seed {seed}, {steps} steps")
    m = mount_store(options=[MODEL_OPTS])
    (m.mnt / DIR).mkdir(parents=True)
    model = Model(m, random.Random(seed), seed)
    for i in range(steps):
        model.step(i)
    while model.held:
        model.close_one()
    # at rest every complete file tiers and is evicted, and still reads back exactly
    for name in model.files:
        model.fsync(name)

    def settled() -> bool:
        files = {f["path"]: f for f in m.status()["files"]}
        return all(files.get(f"{DIR}/{n}", {}).get("state") == "tiered" for n, d in model.files.items() if d)
    wait_for(settled, timeout=120, what=f"every file tiered at rest (seed {seed})")
    model.check(steps)
    assert m.alive()
    assert "Traceback" not in m.log_text(), f"seed {seed}: {m.log_tail(40)}"


def test_model_random_operations_against_a_local_directory(mount_store):
    run_model(mount_store, int(os.environ.get("TIERFS_MODEL_STEPS", "1000")))


@pytest.mark.slow
def test_model_long_run(mount_store):
    run_model(mount_store, int(os.environ.get("TIERFS_MODEL_STEPS", "20000")))
