"""Shared fixtures: real tierfs mounts made through the CLI, always cleaned up.

    mount_store(hot=None, options=(), config_text=None, env=None, *, mnt=None, mount=True) -> Mount
        Factory. Creates (if needed) a hot dir and an empty mountpoint under tmp_path, writes config_text to a
        TOML file passed with --config, passes `options` as `-o` arguments and `env` (merged over the runner's
        environment, minus TIERFS_FAILPOINTS) to the CLI and so to the daemon. Every Mount it made is unmounted
        at teardown (CLI umount, else SIGKILL by pid + fusermount3 -uz), even when the test failed.
    mounted -> Mount
        One default mount on tmp_path/hot at tmp_path/mnt.

    rgw -> ceph_rgw.RGW
        Session-wide single-node Ceph + radosgw (see tests/ceph_rgw.py), registered here as a plugin.

The whole FUSE part of the suite is skipped with the reason when /dev/fuse (or fusermount3) is missing, except
where every test must run (TIERFS_REQUIRE_ALL=1, set by mount-scripts/test: see tests/must_run.py): there a session
on a machine that lacks a prerequisite refuses to start, and a test that skips anyway fails.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Iterable, Mapping

import pytest

import must_run
from mountutil import FUSE_SKIP_REASON, Mount

# The Ceph RGW (S3) session fixture `rgw`, for tests that do not import it themselves (tests/ceph_rgw.py), and
# `fault_proxy`, a fault-injecting proxy in front of it (tests/faultproxy.py).
pytest_plugins = ("ceph_rgw", "faultproxy")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Where every test must run, a machine that lacks a prerequisite fails the run at once, saying what."""
    if must_run.required():
        from ceph_rgw import missing_binaries  # registered as a plugin below first, so pytest rewrites its asserts

        missing = must_run.missing_prerequisites(missing_binaries())
        if missing:
            pytest.exit("TIERFS_REQUIRE_ALL=1 (every test must run here) but this machine lacks:\n  "
                        + "\n  ".join(missing), returncode=pytest.ExitCode.USAGE_ERROR)


def _fail_if_must_run(report: pytest.TestReport | pytest.CollectReport) -> None:
    """A skip where every test must run becomes a failure, unless the test does not apply (must_run.NOT_APPLICABLE).
    Catches every skip: markers, pytest.skip in a test or fixture, importorskip in a module."""
    if not (report.skipped and must_run.required()) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not must_run.not_applicable(reason):
        report.outcome = "failed"
        report.longrepr = f"TIERFS_REQUIRE_ALL=1: this test must run here, but it skipped: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    _fail_if_must_run(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report = yield
    _fail_if_must_run(report)
    return report


@pytest.fixture
def fuse_required() -> None:
    if FUSE_SKIP_REASON is not None:
        pytest.skip(FUSE_SKIP_REASON)


@pytest.fixture
def mount_store(tmp_path: Path, fuse_required: None):
    made: list[Mount] = []
    seq = itertools.count()

    def factory(hot: str | os.PathLike | None = None, options: Iterable[str] = (), config_text: str | None = None,
                env: Mapping[str, str] | None = None, *, mnt: str | os.PathLike | None = None,
                mount: bool = True) -> Mount:
        n = next(seq)
        suffix = "" if n == 0 else str(n)
        hot_dir = Path(hot) if hot is not None else tmp_path / f"hot{suffix}"
        hot_dir.mkdir(parents=True, exist_ok=True)
        mnt_dir = Path(mnt) if mnt is not None else tmp_path / f"mnt{suffix}"
        mnt_dir.mkdir(parents=True, exist_ok=True)
        config = None
        if config_text is not None:
            config = tmp_path / f"tierfs{suffix}.toml"
            config.write_text(config_text)
        m = Mount(hot_dir, mnt_dir, options=options, config=config, env=env)
        made.append(m)
        if mount:
            m.mount()
        return m

    yield factory

    problems = []
    for m in reversed(made):
        try:
            m.cleanup()
        except Exception as e:  # keep cleaning the others, then report
            problems.append(f"{m}: {e}")
    if problems:
        pytest.fail("mount cleanup failed: " + "; ".join(problems))


@pytest.fixture
def mounted(mount_store) -> Mount:
    return mount_store()
