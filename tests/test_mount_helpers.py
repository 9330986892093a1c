"""mount(8) integration and the systemd unit: `mount -t fuse.tierfs`, an fstab line, and the unit's commands."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from mountutil import Mount, fuse_unavailable_reason, is_root

REPO = Path(__file__).resolve().parent.parent
HELPER = REPO / "mount-scripts" / "mount.tierfs"
SBIN = Path("/sbin/mount.fuse.tierfs")

pytestmark = pytest.mark.skipif(fuse_unavailable_reason() is not None or not is_root(),
                                reason=fuse_unavailable_reason() or "needs root to install a mount helper")


@pytest.fixture
def mount_helper():
    """Install the helper as /sbin/mount.fuse.tierfs for the test (restoring whatever was there)."""
    previous = os.readlink(SBIN) if SBIN.is_symlink() else None
    if SBIN.exists() and previous is None:
        pytest.skip(f"{SBIN} exists and is not our symlink; not touching it")
    if SBIN.is_symlink():
        SBIN.unlink()
    SBIN.symlink_to(HELPER)
    yield
    SBIN.unlink()
    if previous is not None:
        SBIN.symlink_to(previous)


def _dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    hot, mnt = tmp_path / "hot", tmp_path / "mnt"
    hot.mkdir()
    mnt.mkdir()
    cfg = tmp_path / "store.toml"
    cfg.write_text('[mount]\nlog_level = "debug"\n')
    return hot, mnt, cfg


def test_mount_t_fuse_tierfs_with_config(tmp_path, mount_helper):
    hot, mnt, cfg = _dirs(tmp_path)
    m = Mount(hot, mnt)
    try:
        r = subprocess.run(["mount", "-t", "fuse.tierfs", str(hot), str(mnt), "-o",
                            f"config={cfg},_netdev,noatime,tiering.enabled=false"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert m.is_mounted()
        text = (mnt / ".tierfs" / "config").read_text()
        assert 'log_level = "debug"' in text and "enabled = false" in text
    finally:
        m.cleanup()


def test_fstab_line(tmp_path, mount_helper):
    hot, mnt, cfg = _dirs(tmp_path)
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{hot} {mnt} fuse.tierfs config={cfg},_netdev,noauto 0 0\n")
    m = Mount(hot, mnt)
    try:
        r = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert m.is_mounted()
    finally:
        m.cleanup()


def test_unknown_mount_option_is_refused(tmp_path, mount_helper):
    hot, mnt, _ = _dirs(tmp_path)
    r = subprocess.run(["mount", "-t", "fuse.tierfs", str(hot), str(mnt), "-o", "bogus"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unknown option 'bogus'" in r.stderr


def test_systemd_unit_commands_match_the_cli():
    unit = (REPO / "mount-scripts" / "tierfs@.service").read_text()
    start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    stop = re.search(r"^ExecStop=(.*)$", unit, re.M).group(1)
    assert "mount" in start and "--foreground" in start and "--config" in start
    assert "umount" in stop
    assert "EnvironmentFile=/etc/tierfs/%i.env" in unit
    from tierfs.cli import build_parser

    args = build_parser().parse_args(["mount", "/h", "/m", "--config", "/c.toml", "--foreground"])
    assert args.foreground and args.config == "/c.toml"
