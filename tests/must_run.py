"""Where the suite must run whole, a test that cannot run is a failure, never a skip.

`mount-scripts/test` (which .ci/run calls) sets TIERFS_REQUIRE_ALL=1: a CI machine without /dev/fuse, root,
fio, stress-ng or the Ceph binaries would otherwise pass green having skipped most of the suite. There the
session refuses to start, naming everything missing (`missing_prerequisites`), and conftest.py turns any skip that
still happens into a failure unless its reason is in NOT_APPLICABLE: a test that does not apply to one parameter,
whatever the machine. Without the variable (a developer's laptop) skips stay skips. TIERFS_REQUIRE_RGW=1 alone
makes only the Ceph RGW fixture strict (tests/ceph_rgw.py).
"""

from __future__ import annotations

import os
import shutil

from mountutil import fuse_unavailable_reason, is_root

# Tools the tests run as processes: binary -> Debian package (mount-scripts/test installs them).
TOOLS = {"fio": "fio", "stress-ng": "stress-ng", "prometheus": "prometheus", "promtool": "prometheus"}

# Skip reasons (substrings) that say "not this parameter", never "not this machine": they stay skips.
NOT_APPLICABLE = (
    "4.9 has no ",  # tests/test_broker.py: a 5.x feature, parametrized over both broker versions
)


def required() -> bool:
    """Must every test run here (CI)?"""
    return os.environ.get("TIERFS_REQUIRE_ALL") == "1"


def rgw_required() -> bool:
    """Must the S3 tests run against a real Ceph RGW here?"""
    return required() or os.environ.get("TIERFS_REQUIRE_RGW") == "1"


def missing_tool_reason(binary: str) -> str | None:
    """Why a test that runs `binary` cannot run here, or None."""
    if shutil.which(binary) is None:
        return f"{binary} is not installed (apt-get install {TOOLS.get(binary, binary)})"
    return None


def missing_prerequisites(ceph_missing: list[str]) -> list[str]:
    """What this machine lacks that some test needs: FUSE, root, the tools, the Ceph binaries (`ceph_missing`)."""
    out = [r for r in [fuse_unavailable_reason(), *map(missing_tool_reason, TOOLS)] if r]
    if not is_root():
        out.append(f"not root (uid {os.geteuid()}): the tests of other users, tmpfs hot dirs, mount helpers and "
                   "quickstart need root")
    if ceph_missing:
        out.append(f"Ceph RGW binaries missing: {', '.join(ceph_missing)}")
    return out


def not_applicable(reason: str) -> bool:
    return any(s in reason for s in NOT_APPLICABLE)
