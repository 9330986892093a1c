"""Fail-stop when the daemon dies (issue 28): `tierfs mount --supervise`, then kill -9 of the daemon.

The writer is a SYNC_FLUSH broker at its worst (RocketMQ 4.9's MappedFile.flush): it writes 4 KiB records into
a shared mapping, msyncs each, and acknowledges the record after msync returns *even when msync failed*. Without
the supervisor, the kernel aborts the connection when the daemon dies, msync fails and the writer acknowledges
records that were never durable. With it, msync waits until the supervisor has SIGKILLed the writer, so every
acknowledged record is in the file byte for byte after the remount, and the writer never saw a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from mountutil import Mount, pid_alive, read_line, requires_fuse, spawn_python, stop_process, wait_for

pytestmark = requires_fuse

REC = 4096
RECORDS = 1 << 14  # a 64 MiB file: the writer never reaches its end before the kill
KILLS = 3
ACKS_BEFORE_KILL = 200

WRITER = r"""
import mmap, os, sys
path, rec, records = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, rec * records)
m = mmap.mmap(fd, rec * records, mmap.MAP_SHARED)
print("ready", flush=True)
for seq in range(records):
    m[seq * rec:(seq + 1) * rec] = seq.to_bytes(8, "little") * (rec // 8)
    try:
        m.flush(seq * rec, rec)  # msync(MS_SYNC)
    except OSError as e:  # swallowed, as 4.9's MappedFile.flush does
        print(f"err {seq} {e.errno}", flush=True)
    print(f"ack {seq}", flush=True)
sys.stdin.read()
"""


def record(seq: int) -> bytes:
    return seq.to_bytes(8, "little") * (REC // 8)


class SupervisedMount(Mount):
    """`tierfs mount --supervise HOT MNT ...`: Mount.pid is the current daemon; the supervisor is stopped by
    pid at cleanup if the unmount did not end it."""

    supervisor: int | None = None
    kill_units: tuple[str, ...] = ()

    def mount_args(self) -> list[str]:
        return [*super().mount_args(), "--supervise", *[a for u in self.kill_units for a in ("--kill-unit", u)]]

    def mount(self) -> "SupervisedMount":
        super().mount()
        assert self.last_result is not None
        self.supervisor = int(re.search(r"supervisor pid (\d+)", self.last_result.stdout).group(1))
        return self

    def state(self) -> dict:
        return json.loads((self.state_dir / "supervisor.json").read_text())

    def cleanup(self) -> None:
        """Stop the supervisor first (SIGTERM: its daemon unmounts, it exits), so that no remount of its races
        with the clean-up; then whatever is left goes as for any Mount."""
        try:
            try:
                self.pid = self.state()["daemon"]
            except (OSError, ValueError):
                pass
            if self.supervisor is not None and pid_alive(self.supervisor):
                os.kill(self.supervisor, signal.SIGTERM)
                wait_for(lambda: not pid_alive(self.supervisor), 60, what="the supervisor to exit on SIGTERM")
            super().cleanup()
        finally:
            if self.supervisor is not None and pid_alive(self.supervisor):
                os.kill(self.supervisor, signal.SIGKILL)


@pytest.fixture
def supervised(tmp_path: Path, fuse_required: None):
    hot, mnt = tmp_path / "hot", tmp_path / "mnt"
    hot.mkdir()
    mnt.mkdir()
    m = SupervisedMount(hot, mnt)
    try:
        yield m.mount()
    finally:
        m.cleanup()


def test_daemon_kill_stops_the_writer_before_it_can_acknowledge_a_failed_msync(supervised: SupervisedMount):
    """Three rounds: a writer acknowledges >= 200 records, the daemon is SIGKILLed; the writer must die by
    SIGKILL without one failed msync, a new daemon must serve the same hot dir, and every acknowledged record of
    every round must be in its file byte for byte (read through the new mount)."""
    m = supervised
    acked: dict[str, int] = {}
    for kill in range(1, KILLS + 1):
        daemon = m.pid
        name = f"data.{kill}"
        writer = spawn_python(WRITER, m.path(name), REC, RECORDS)
        try:
            assert read_line(writer) == "ready"
            last, errors = -1, []
            while last < ACKS_BEFORE_KILL:
                kind, seq, *rest = read_line(writer).split()
                last = int(seq) if kind == "ack" else last
                errors += [] if kind == "ack" else [(seq, rest)]
            os.kill(daemon, signal.SIGKILL)
            writer.wait(120)
            printed = bytes(writer.__dict__.get("_line_buf", b"")) + writer.stdout.buffer.read()
            for line in printed.decode().splitlines():  # what it printed before it died (read_line's buffer too)
                kind, seq, *rest = line.split()
                last = int(seq) if kind == "ack" else last
                errors += [] if kind == "ack" else [(seq, rest)]
        finally:
            stop_process(writer)
        assert not errors, f"the writer saw failed msyncs (seq, errno) before it was stopped: {errors[:5]}"
        assert writer.returncode == -signal.SIGKILL, "the writer was not SIGKILLed by the supervisor"
        acked[name] = last
        wait_for(lambda: m.state()["remounts"] == kill, 120, 0.1, what=f"remount {kill} by the supervisor")
        m.pid = m.state()["daemon"]
        assert m.pid != daemon and pid_alive(m.pid) and m.is_mounted()
        assert pid_alive(m.supervisor)
    lost = {}
    for name, last in acked.items():
        with open(m.path(name), "rb") as f:
            data = f.read((last + 1) * REC)
        bad = [s for s in range(last + 1) if data[s * REC:(s + 1) * REC] != record(s)]
        if bad:
            lost[name] = (len(bad), bad[:5])
    assert not lost, f"acknowledged records lost or torn after the kill (file: count, first seqs): {lost}"
    print(f"\nfail-stop: {KILLS} daemon kills, acknowledged records per round {acked}, all read back")


def test_unmount_ends_the_supervisor(supervised: SupervisedMount):
    """`tierfs umount` of a supervised mount is a clean stop, not a death: no remount, the supervisor exits 0."""
    m = supervised
    m.umount()
    wait_for(lambda: not pid_alive(m.supervisor), 30, what="the supervisor to exit")
    assert not m.is_mounted(any_state=True)
    assert not (m.state_dir / "supervisor.json").exists()


def test_sigterm_to_the_supervisor_unmounts_cleanly(supervised: SupervisedMount):
    """systemctl stop (SIGTERM to the supervisor only, KillMode=mixed): the daemon unmounts and exits cleanly
    (its pid file goes), then the supervisor exits; nothing is remounted."""
    m = supervised
    os.kill(m.supervisor, signal.SIGTERM)
    wait_for(lambda: not pid_alive(m.supervisor), 60, what="the supervisor to exit on SIGTERM")
    assert not pid_alive(m.pid) and not m.is_mounted(any_state=True)
    assert not m.pid_file.exists(), f"the daemon did not exit cleanly:\n{m.log_tail()}"


def test_kill_unit_goes_through_systemctl_before_the_remount(tmp_path: Path, fuse_required: None):
    """--kill-unit UNIT: the supervisor runs `systemctl kill --signal=SIGKILL UNIT` (a stub here, first on PATH)
    when the daemon dies, and remounts."""
    stub, calls = tmp_path / "bin", tmp_path / "systemctl.calls"
    stub.mkdir()
    (stub / "systemctl").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (stub / "systemctl").chmod(0o755)
    for d in ("hot", "mnt"):
        (tmp_path / d).mkdir()
    m = SupervisedMount(tmp_path / "hot", tmp_path / "mnt", env={"PATH": f"{stub}:{os.environ['PATH']}"})
    m.kill_units = ("rocketmq-broker@a.service",)
    try:
        m.mount()
        os.kill(m.pid, signal.SIGKILL)
        wait_for(lambda: m.state()["remounts"] == 1, 120, 0.1, what="the remount by the supervisor")
        assert calls.read_text() == "kill --signal=SIGKILL rocketmq-broker@a.service\n"
        m.pid = m.state()["daemon"]
        assert m.is_mounted()
    finally:
        m.cleanup()
