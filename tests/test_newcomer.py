"""A newcomer's first hour (issue 11), on real mounts and real processes: quickstart twice in a row, a mount
started from the directory holding the clone, the modes of the daemon's own files, a broker-like process running
as its own user, and the CLI's rough edges."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mountutil import files_under, is_root, lazy_unmount, pid_alive, run, wait_for
from test_tiering import TIER_OPTS, copy_in, reference_store, segments  # noqa: F401 (reference_store: a fixture)

REPO = Path(__file__).resolve().parent.parent
TIERFS = Path(sys.executable).parent / "tierfs"  # the console script a user runs
BROKER_UID, BROKER_GID = 1234, 2345


def _private(root: Path) -> list[str]:
    """Every file or directory under root that group or others may read, write or enter."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, ""]:
            p = Path(dirpath, name) if name else Path(dirpath)
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue  # the live daemon removed it meanwhile (an object past its grace period)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                bad.append(f"{stat.S_IMODE(st.st_mode):o} {p}")
    return bad


def _force_unmount(hot: Path, mnt: Path) -> None:
    """Teardown for mounts a script made: CLI umount, else SIGKILL the daemon by its pid file and clear it."""
    if not any(line.split()[1] == str(mnt) for line in open("/proc/self/mounts")):
        return
    r = run([TIERFS, "umount", mnt], timeout=90)
    if r.returncode == 0:
        return
    try:
        pid = int((hot / ".tierfs" / "daemon.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), timeout=30, what=f"daemon {pid} to die")
    except (OSError, ValueError):
        pass
    lazy_unmount(mnt)


# ----------------------------------------------------------------------------- 1, 3, 7 (PATH, reinstall)


@pytest.mark.skipif(not is_root(), reason="quickstart installs system packages as root")
def test_quickstart_twice_in_a_row(tmp_path, fuse_required):
    """The second run reuses everything and is fast (it failed with KeyError: 'segments' when the compaction job
    had nothing left to do); neither run reinstalls the venv the test suite installed with [test] extras; the
    daemon's files, its jobs (Spark's log4j2 configuration) and the embedded object store are private."""
    qs, mnt, bin_dir = tmp_path / "qs", tmp_path / "store", tmp_path / "bin"
    bin_dir.mkdir()
    env = {**os.environ, "TIERFS_QUICKSTART_DIR": str(qs), "TIERFS_LINK_DIR": str(bin_dir)}
    env.pop("TIERFS_FAILPOINTS", None)
    try:
        first = run([REPO / "mount-scripts" / "quickstart", mnt], timeout=240, env=env)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert "segments compacted" in first.stdout
        t0 = time.monotonic()
        second = run([REPO / "mount-scripts" / "quickstart", mnt], timeout=120, env=env)
        took = time.monotonic() - t0
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert "reusing the tierfs mount" in second.stdout and "store already written" in second.stdout
        assert "nothing to do" in second.stdout
        assert took < 60, f"the second quickstart took {took:.1f} s"
        for out in (first, second):
            assert "installing tierfs" not in out.stdout, "the venv was reinstalled"
        assert os.readlink(bin_dir / "tierfs") == str(TIERFS)
        state = qs / "hot" / ".tierfs"
        assert list((state / "jobs").glob("*/spark-log4j2.properties")), "the Spark job did not run"
        assert [p for p in files_under(state / "objects") if p.suffix == ".lz4c"]
        assert _private(state) == []
    finally:
        _force_unmount(qs / "hot", mnt)


# ----------------------------------------------------------------------------- 2


def test_mount_from_the_directory_holding_the_clone(tmp_path, fuse_required):
    """`cd /tmp && tierfs/mount-scripts/quickstart`: a `tierfs/` folder in the current directory must not shadow
    the installed package in the daemon, and the daemon must not keep that directory busy."""
    fake = tmp_path / "tierfs"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the current directory shadowed the tierfs package')\n")
    hot, mnt = tmp_path / "hot", tmp_path / "mnt"
    hot.mkdir()
    mnt.mkdir()
    try:
        r = run([TIERFS, "mount", "hot", "mnt"], cwd=tmp_path, timeout=90)
        assert r.returncode == 0, r.stderr
        pid = int((hot / ".tierfs" / "daemon.pid").read_text())
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        (mnt / "f").write_text("x")
        assert (hot / "f").read_text() == "x"
        r = run([TIERFS, "umount", "mnt"], cwd=tmp_path, timeout=90)
        assert r.returncode == 0, r.stderr
    finally:
        _force_unmount(hot.resolve(), mnt.resolve())


# ----------------------------------------------------------------------------- 3


def test_daemon_state_is_private_and_new_files_keep_the_callers_mode(mount_store):
    """State files 0600, dirs 0700, also when an older version left them world-writable; files made through the
    mount keep exactly the caller's mode and umask (the daemon's own umask must not reach them)."""
    hot = mount_store(mount=False).hot
    state = hot / ".tierfs"
    state.mkdir(mode=0o777)
    os.chmod(state, 0o777)  # as an older daemon (umask 0) left it
    m = mount_store(hot=hot, options=["seal.quiet_seconds=0.2,seal.scan_interval_seconds=0.2"])
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for name in ("daemon.pid", "daemon.lock", "store-id", "tierfs.log", "catalog.db"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((state / "jobs").stat().st_mode) == 0o700
    r = m.cli("compact", m.mnt, "--json", timeout=60)  # nothing tiered yet: a job that does nothing, no Spark
    assert r.returncode == 0, r.stderr
    assert _private(state) == []
    code = ("import os, sys\nos.umask(0o002)\nos.mkdir('d', 0o777)\n"
            "os.close(os.open('d/f', os.O_CREAT | os.O_WRONLY, 0o666))\nos.mkfifo('p', 0o666)")
    run([sys.executable, "-c", code], cwd=m.mnt, check=True)
    for rel, mode in (("d", 0o775), ("d/f", 0o664), ("p", 0o664)):
        assert stat.S_IMODE(os.lstat(m.path(rel)).st_mode) == mode, rel
        assert stat.S_IMODE(os.lstat(m.hot_path(rel)).st_mode) == mode, rel


# ----------------------------------------------------------------------------- 4

BROKER_LIKE = r"""
import fcntl, mmap, os, sys
os.makedirs("commitlog", exist_ok=True)
lock = os.open("lock", os.O_CREAT | os.O_RDWR, 0o644)
fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
fd = os.open("commitlog/00000000000000000000", os.O_CREAT | os.O_RDWR, 0o644)
os.ftruncate(fd, 1 << 20)
with mmap.mmap(fd, 1 << 20) as m:
    m[:11] = b"hello-store"
    m.flush()
os.fsync(fd)
os.rename("commitlog/00000000000000000000", "commitlog/00000000000001048576")
assert os.pread(fd, 11, 0) == b"hello-store"
print(sorted(n for n in os.listdir(".") if n != ".tierfs"), os.stat("commitlog/00000000000001048576").st_uid)
"""


@pytest.mark.skipif(not is_root(), reason="needs another user")
def test_broker_running_as_its_own_user_with_allow_other(mount_store, tmp_path):
    """The README's non-root recipe: the hot dir belongs to the broker's user, root mounts it with
    mount.allow_other, and the broker (mkdir, fcntl lock, create, mmap, fsync, rename) works as that user.
    Without allow_other, `tierfs mount` says why the broker would be refused."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the broker's user")
    hot = tmp_path / "hot"
    hot.mkdir()
    os.chown(hot, BROKER_UID, BROKER_GID)
    plain = mount_store(hot=hot)
    assert "mount.allow_other" in plain.last_result.stderr, plain.last_result.stderr
    r = subprocess.run([python, "-c", "import os; os.listdir('.')"], cwd=plain.mnt, user=BROKER_UID,
                       group=BROKER_GID, extra_groups=[], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "Permission denied" in r.stderr  # what the warning foretold
    plain.umount()
    m = mount_store(hot=hot, options=["mount.allow_other=true"], mnt=plain.mnt)
    assert "allow_other" not in m.last_result.stderr
    r = subprocess.run([python, "-c", BROKER_LIKE], cwd=m.mnt, user=BROKER_UID, group=BROKER_GID, extra_groups=[],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['commitlog',", "'lock']", str(BROKER_UID)]
    for p in ("commitlog", "lock", "commitlog/00000000000001048576"):
        st = m.hot_path(p).stat()
        assert (st.st_uid, st.st_gid) == (BROKER_UID, BROKER_GID), p


# ----------------------------------------------------------------------------- 7


def test_config_errors_are_all_reported_and_point_to_config_doc(tmp_path):
    """Every bad key of a config file at once; an unknown section names the sections and `tierfs config-doc`."""
    (tmp_path / "hot").mkdir()
    (tmp_path / "mnt").mkdir()
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[mount]\nmax_tasks = 0\nlog_levl = "debug"\n[cahce]\nmax_bytes = "1GiB"\n')
    r = run([TIERFS, "mount", tmp_path / "hot", tmp_path / "mnt", "--config", cfg, "-o", "statfs.capacity_bytes=-1"])
    assert r.returncode == 2, r.stderr
    assert "4 configuration errors" in r.stderr, r.stderr
    for needle in ("'mount.max_tasks'", "Did you mean 'mount.log_level'?", "There is no section [cahce]",
                   "Did you mean 'cache.max_bytes'?", "tierfs config-doc", "'statfs.capacity_bytes'"):
        assert needle in r.stderr, (needle, r.stderr)
    assert "README" not in r.stderr


def _job(state: Path, job_id: str, applied: dict, note: str = "") -> None:
    d = state / "jobs" / job_id
    d.mkdir(parents=True)
    summary = {"job_id": job_id, "ok": True, "trigger": "schedule", "stages": ["segments"], "applied": applied,
               "skipped": [], "errors": [], "seconds": 1.0, **({"note": note} if note else {})}
    (d / "applied.json").write_text(json.dumps(summary))


def test_cli_rough_edges(mount_store, tmp_path):
    """A second daemon on the same hot dir: one 'tierfs:' and both mountpoints named; /.tierfs/config names the -o
    overrides; `status` in units without Python dict syntax, keeping the last job that did something after many
    no-op runs; `query`: singular/plural, and a clear error for a topic the store does not have."""
    hot = mount_store(mount=False).hot
    state = hot / ".tierfs"
    _job(state, "20200101-000000-useful", {"segments": 7, "indexes": 2, "archive": 1})
    for i in range(22):
        _job(state, f"20200101-0001{i:02d}-noop", {}, "nothing to do")
    m = mount_store(hot=hot, options=["mount.log_level=debug", "broker.max_hash_slot_num=500",
                                      "broker.max_index_num=2000"])
    r = run([sys.executable, str(REPO / "examples" / "producer.py"), m.mnt, "--commitlog-size", str(1 << 20),
             "--cq-size", "6000", "--index-slots", "500", "--index-items", "2000", "--messages", "50", "--topics",
             "2", "--queues", "1"], timeout=60)
    assert r.returncode == 0, r.stderr

    other = tmp_path / "mnt-second"
    other.mkdir()
    r = run([TIERFS, "mount", hot, other], timeout=60)
    assert r.returncode != 0
    assert r.stderr.count("tierfs: ") == 1, r.stderr
    assert f"at {other}" in r.stderr and f"at {m.mnt}" in r.stderr, r.stderr

    assert (m.ctl / "config").read_text().splitlines()[0].endswith(
        "+ -o mount.log_level,broker.max_hash_slot_num,broker.max_index_num)")

    r = m.cli("compact", m.mnt, "--json")  # nothing tiered: a no-op job, and a prune of the job dirs
    assert r.returncode == 0, r.stderr
    assert (state / "jobs" / "20200101-000000-useful").is_dir()
    text = run([TIERFS, "status", m.mnt], check=True).stdout
    assert "{" not in text and "[" not in text, text
    assert re.search(r"hot_dir_bytes_free\s+[\d.]+ [KMGT]iB", text), text
    assert "20200101-000000-useful ok: 7 segments compacted, 2 index sidecars, 1 commitlogs archived" in text, text

    r = run([TIERFS, "query", m.mnt, "--topic", "NoSuchTopic", "--key", "k-0"])
    assert r.returncode == 1 and "topic 'NoSuchTopic' does not exist in this store" in r.stderr, r.stderr
    assert "TopicTest0" in r.stderr
    r = run([TIERFS, "query", m.mnt, "--topic", "TopicTest0", "--key", "k-0"], check=True)
    assert "1 message (" in r.stderr, r.stderr
    r = run([TIERFS, "query", m.mnt, "--topic", "TopicTest0", "--key", "no-such-key"], check=True)
    assert "no message of topic 'TopicTest0' has key 'no-such-key'" in r.stderr and "0 messages (" in r.stderr


def test_readme_documents_every_cli_option_and_the_non_root_recipe():
    """README: every option of every `tierfs` command, how to get `tierfs` on PATH, and allow_other for a
    broker running as its own user."""
    import argparse

    from tierfs.cli import build_parser

    readme = (REPO / "README.md").read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{cmd} {opt}" for cmd, p in sub.choices.items() for a in p._actions for opt in a.option_strings
               if opt not in ("-h", "--help") and f"`{opt}" not in readme and f"[{opt}" not in readme]
    assert missing == []
    assert "export PATH=" in readme and "mount.allow_other=true" in readme and "user_allow_other" in readme


# ----------------------------------------------------------------------------- 5

PATH_MAX_OPS = r"""
import os, sys
base, n = sys.argv[1], int(sys.argv[2])
comps = ["d%03d" % i + "x" * 246 for i in range(n)]  # 250 bytes each (NAME_MAX is 255)
for i in range(1, n + 1):  # each level by its full path through the mount
    os.mkdir(base + "/" + "/".join(comps[:i]), 0o755)
d = base + "/" + "/".join(comps)
name = min(4095 - len(d) - 1 - 1, 255)  # PATH_MAX counts the NUL
f, g = d + "/" + "f" * name, d + "/" + "g" * name
fd = os.open(f, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
os.write(fd, b"hello")
os.close(fd)
os.chmod(f, 0o600)
os.chown(f, 1234, 2345)
os.truncate(f, 2)
os.utime(f, ns=(10**18, 10**18))
os.link(f, g)
os.unlink(g)
os.symlink("target", g)
assert os.readlink(g) == "target"
os.unlink(g)
os.rename(f, g)
with open(g, "rb") as fh:
    assert fh.read() == b"he"
st = os.stat(g)
assert (st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime_ns) == (0o600, 1234, 2345, 10**18), st
assert os.listdir(d) == [os.path.basename(g)]
os.unlink(g)
os.mkdir(f, 0o700)
os.rmdir(f)
os.mknod(f, 0o644)
os.unlink(f)
print(len(f))
"""


@pytest.mark.skipif(not is_root(), reason="chown to another user needs root")
def test_paths_close_to_path_max(mount_store, tmp_path):
    """Every namespace and attribute operation on a path just under PATH_MAX through the mount, with a hot dir
    whose own path is much longer than the mountpoint's (prefixing it made them all fail with ENAMETOOLONG)."""
    hot = tmp_path / ("h" * 180) / ("h" * 180)  # SQLite opens at most 512-byte paths: the catalog limits this
    mnt = tmp_path / "m"
    m = mount_store(hot=hot, mnt=mnt)
    levels = (4095 - len(str(m.mnt)) - 200) // 251
    r = run([sys.executable, "-c", PATH_MAX_OPS, m.mnt, str(levels)], timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 3900 and len(str(m.hot)) + int(r.stdout) - len(str(m.mnt)) > 4096
    assert m.alive()


# ----------------------------------------------------------------------------- 8


def test_store_roots_below_the_mount_root_are_tiered(mount_store, reference_store):
    """A master's and a slave's store under one mount (storePathRootDir = MNT/master, MNT/slave): both are found by
    their layout, sealed, uploaded, evicted and read back exactly, with a status section and a query each."""

    m = mount_store(options=[TIER_OPTS])
    for root in ("master", "slave"):
        (m.mnt / root).mkdir()
        copy_in(reference_store, m.mnt / root)
    sealed = [rel for rel in segments(reference_store) if rel.startswith("commitlog/")][:-1]  # the last is active
    want = [f"{root}/{rel}" for root in ("master", "slave") for rel in sealed]

    def tiered_and_evicted() -> bool:
        files = {f["path"]: f for f in json.loads((m.ctl / "status.json").read_text())["files"]}
        return all(files.get(p, {}).get("state") == "tiered" for p in want) and all(
            any(files[p]["resident_bytes"] < files[p]["size"] for p in want if p.startswith(root))
            for root in ("master/", "slave/"))

    wait_for(tiered_and_evicted, timeout=60, what="both stores' sealed CommitLog segments tiered and evicted")
    for p in want:
        assert (m.mnt / p).read_bytes() == (reference_store / p.split("/", 1)[1]).read_bytes(), p
    text = (m.ctl / "status").read_text()
    assert "store master" in text and "store slave" in text, text
    stores = json.loads((m.ctl / "status.json").read_text())["totals"]["stores"]
    assert stores["master"]["commitlog"]["tiered"] >= len(sealed) and stores["slave"]["commitlog"]["tiered"] >= len(sealed)
    r = run([TIERFS, "query", m.mnt, "--store", "slave", "--topic", "TopicTest0", "--key", "k-0"], check=True)
    assert "1 message (" in r.stderr, r.stderr


def test_store_root_paths_and_archive_names():
    """Classification by layout below the mount root, and archive part names that keep two stores apart."""
    from tierfs.spark.archive import part_name
    from tierfs.store.paths import Kind, classify, split_root
    from tierfs.tier.storeroots import check_roots, parse_roots

    assert classify("slave/commitlog/00000000000000000000") is Kind.COMMITLOG
    assert classify("a/b/consumequeue/T/0/00000000000000000000") is Kind.CONSUMEQUEUE
    assert classify("m/index/20240101000000000") is Kind.INDEX
    for mutable in ("consumequeue/x/commitlog/00000000000000000000", ".tierfs/commitlog/00000000000000000000",
                    "index/x/commitlog/00000000000000000000", "slave/config/topics.json"):
        assert classify(mutable) is Kind.MUTABLE, mutable
    assert split_root("a/b/consumequeue/T/0/00000000000000000000") == ("a/b", "consumequeue/T/0/00000000000000000000")
    assert split_root("commitlog/00000000000000000000") == ("", "commitlog/00000000000000000000")
    assert part_name("commitlog/00000000000000000000") == "00000000000000000000"
    assert part_name("slave/commitlog/00000000000000000000") == "slave~00000000000000000000"
    assert parse_roots(" master, slave/ ,.") == ["master", "slave", ""]
    assert check_roots("../x") and check_roots("a/commitlog") and check_roots("master,slave") is None
