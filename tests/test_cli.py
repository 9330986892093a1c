"""The `tierfs` command line as an operator meets it: every refusal exits 2 and names the key, the value and what
is allowed (or the path and the fix); status, umount and config-doc do what they say.

Configuration and path errors need no FUSE (the CLI refuses before mounting); anything that mounts uses the
fixtures, which always unmount. A test that expects a refusal but gets a mount is still cleaned up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mountutil import TIERFS_CMD, Mount, daemon_env, pid_alive, requires_fuse, run, run_python

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


def tierfs(*args, timeout: float = 60, env=None) -> subprocess.CompletedProcess:
    return run([*TIERFS_CMD, *[str(a) for a in args]], timeout=timeout, env=daemon_env(env))


@pytest.fixture
def dirs(tmp_path):
    """An empty hot dir and mountpoint; whatever a test mounts on them by mistake is unmounted at teardown."""
    hot, mnt = tmp_path / "hot", tmp_path / "mnt"
    hot.mkdir()
    mnt.mkdir()
    yield hot, mnt
    Mount(hot, mnt).cleanup()


def assert_refused(r: subprocess.CompletedProcess, *needles: str, hot: Path | None = None) -> None:
    assert r.returncode == 2, f"exit {r.returncode}, expected 2\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, f"{n!r} not in: {r.stderr}"
    if hot is not None:  # refused before anything was started or written
        assert not (hot / ".tierfs").exists(), os.listdir(hot / ".tierfs")


# A matrix of refusals costs one interpreter start instead of one per case: every argv goes through
# tierfs.cli.main() (what `python -m tierfs` runs as sys.exit(main())) in one fresh process, stdout/stderr captured
# per case. test_refusals_from_the_real_process checks that a real `python -m tierfs` process exits the same way.
BATCH_DRIVER = r"""
import contextlib, io, json, sys
from tierfs.cli import main
results = {}
for case_id, argv in json.load(sys.stdin).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    results[case_id] = {"returncode": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}
json.dump(results, sys.stdout)
"""


class Refusals:
    """Cases registered by id, each with its own empty hot dir and mountpoint, run together on first access."""

    def __init__(self, base: Path):
        self.base = base
        self.argv: dict[str, list[str]] = {}
        self.dirs: dict[str, tuple[Path, Path]] = {}
        self._results: dict[str, subprocess.CompletedProcess] | None = None

    def add(self, case_id: str, make_argv) -> None:
        d = self.base / f"case{len(self.argv)}"
        hot, mnt = d / "hot", d / "mnt"
        hot.mkdir(parents=True)
        mnt.mkdir()
        self.dirs[case_id] = (hot, mnt)
        self.argv[case_id] = [str(a) for a in make_argv(d, hot, mnt)]

    def __getitem__(self, case_id: str) -> tuple[subprocess.CompletedProcess, Path]:
        if self._results is None:
            r = run([sys.executable, "-c", BATCH_DRIVER], input=json.dumps(self.argv), timeout=120,
                    env=daemon_env(), check=True)
            self._results = {k: subprocess.CompletedProcess(["tierfs", *self.argv[k]], v["returncode"], v["stdout"],
                                                            v["stderr"]) for k, v in json.loads(r.stdout).items()}
        return self._results[case_id], self.dirs[case_id][0]

    def cleanup(self) -> None:
        for hot, mnt in self.dirs.values():  # only does something if a refusal regressed into a mount
            Mount(hot, mnt).cleanup()


# ------------------------------------------------------------------------------------------ configuration


BAD_OVERRIDES = [
    # unknown key, with a did-you-mean
    ("mount.log_levl=debug", ["unknown config key 'mount.log_levl'", "Did you mean 'mount.log_level'?"]),
    ("statfs.capacity=1GiB", ["unknown config key 'statfs.capacity'", "Did you mean 'statfs.capacity_bytes'?"]),
    ("nosuch.thing=1", ["unknown config key 'nosuch.thing'", "There is no section [nosuch]", "tierfs config-doc"]),
    # wrong type
    ("mount.max_tasks=abc", ["'mount.max_tasks'", "invalid value 'abc'", "allowed: an integer from 1 to 1024"]),
    ("mount.max_tasks=2.5", ["'mount.max_tasks'", "invalid value '2.5'", "an integer"]),
    ("mount.allow_other=maybe", ["'mount.allow_other'", "invalid value 'maybe'", "allowed: true or false"]),
    ("mount.attr_timeout=soon", ["'mount.attr_timeout'", "invalid value 'soon'", "a number from 0 to 3600"]),
    ("statfs.capacity_bytes=10XB", ["'statfs.capacity_bytes'", "invalid value '10XB'", "a byte size such as"]),
    # out of range
    ("mount.max_tasks=0", ["'mount.max_tasks'", "invalid value '0'", "from 1 to 1024"]),
    ("mount.max_tasks=1025", ["'mount.max_tasks'", "invalid value '1025'", "from 1 to 1024"]),
    ("mount.attr_timeout=-1", ["'mount.attr_timeout'", "invalid value '-1'", "from 0 to 3600"]),
    ("mount.attr_timeout=inf", ["'mount.attr_timeout'", "invalid value 'inf'", "from 0 to 3600"]),
    ("statfs.capacity_bytes=-5", ["'statfs.capacity_bytes'", "invalid value '-5'", ">= 0"]),
    # bad choice
    ("mount.log_level=verbose", ["'mount.log_level'", "invalid value 'verbose'",
                                 "allowed: one of debug, info, warning, error"]),
    # a path must be absolute
    ("mount.log_file=relative.log", ["'mount.log_file'", "invalid value 'relative.log'", "an absolute path"]),
    # malformed -o
    ("mount.log_level", ["option 'mount.log_level' has no value", "-o mount.log_level=VALUE"]),
    ("mount.max_tasks=8,mount.allow_other", ["option 'mount.allow_other' has no value"]),
    ("=debug", ["config key ''"]),
]


NAN_OVERRIDES = ["mount.attr_timeout=nan", "cache.high_watermark=nan"]
BAD_USAGE = [["mount"], ["mount", "only-one"], ["frobnicate"], [], ["status"], ["mount", "a", "b", "--bogus"]]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    cases = Refusals(tmp_path_factory.mktemp("refusals"))
    for override, _ in BAD_OVERRIDES:
        cases.add(f"o:{override}", lambda d, hot, mnt, o=override: ["mount", hot, mnt, "-o", o])
    for override in NAN_OVERRIDES:
        cases.add(f"o:{override}", lambda d, hot, mnt, o=override: ["mount", hot, mnt, "-o", o])
    for i, (text, _) in enumerate(BAD_TOML):
        def toml_case(d, hot, mnt, text=text):
            (d / "tierfs.toml").write_text(text)
            return ["mount", hot, mnt, "--config", d / "tierfs.toml"]
        cases.add(f"toml{i}", toml_case)
    cases.add("missing-config", lambda d, hot, mnt: ["mount", hot, mnt, "--config", d / "nope.toml"])
    for argv in BAD_USAGE:
        cases.add("usage:" + " ".join(argv), lambda d, hot, mnt, a=argv: a)
    yield cases
    cases.cleanup()


@pytest.mark.parametrize("override,needles", BAD_OVERRIDES, ids=[o for o, _ in BAD_OVERRIDES])
def test_bad_override_exits_2_naming_key_value_and_allowed(refusals, override, needles):
    r, hot = refusals[f"o:{override}"]
    assert_refused(r, *needles, hot=hot)


@pytest.mark.parametrize("override", NAN_OVERRIDES)
def test_nan_is_refused(refusals, override):
    """NaN passes every `<` / `>` range check; libfuse would turn a NaN timeout into an endless cache."""
    key = override.partition("=")[0]
    from tierfs.config import SCHEMA

    if key not in {k.name for k in SCHEMA}:
        pytest.skip(f"{key} is not in this version's schema")
    r, hot = refusals[f"o:{override}"]
    assert_refused(r, f"'{key}'", "invalid value 'nan'", hot=hot)


BAD_TOML = [
    ('[mount]\nlog_levl = "debug"\n', ["unknown config key 'mount.log_levl'", "Did you mean 'mount.log_level'?"]),
    ('[mount]\nmax_tasks = "many"\n', ["'mount.max_tasks'", "invalid value 'many'", "an integer from 1 to 1024"]),
    ("[mount]\nmax_tasks = 1.5\n", ["'mount.max_tasks'", "invalid value 1.5", "an integer"]),
    ("[mount]\nmax_tasks = true\n", ["'mount.max_tasks'", "invalid value True", "an integer"]),
    ("[mount]\nallow_other = 2\n", ["'mount.allow_other'", "invalid value 2", "true or false"]),
    ("[mount]\nmax_tasks = 5000\n", ["'mount.max_tasks'", "invalid value 5000", "from 1 to 1024"]),
    ('[mount]\nlog_level = "loud"\n', ["'mount.log_level'", "invalid value 'loud'", "one of debug, info"]),
    ("[statfs]\ncapacity_bytes = -1\n", ["'statfs.capacity_bytes'", "invalid value -1", ">= 0"]),
    ("mount = 5\n", ["unknown config key 'mount'"]),
    ("[mount]\nmax_tasks = \n", ["is not valid TOML"]),
    ("[mount\nmax_tasks = 4\n", ["is not valid TOML"]),
]


@pytest.mark.parametrize("i", range(len(BAD_TOML)), ids=[f"toml{i}" for i in range(len(BAD_TOML))])
def test_bad_config_file_exits_2(refusals, i):
    r, hot = refusals[f"toml{i}"]
    needles = BAD_TOML[i][1]
    assert_refused(r, *needles, hot=hot)
    if "TOML" in needles[0]:
        assert str(hot.parent / "tierfs.toml") in r.stderr  # names the file


def test_missing_config_file_exits_2(refusals):
    r, hot = refusals["missing-config"]
    assert_refused(r, f"config file '{hot.parent / 'nope.toml'}' does not exist", hot=hot)


@pytest.mark.parametrize("argv", BAD_USAGE, ids=lambda a: " ".join(a) or "none")
def test_bad_usage_exits_2_with_usage(refusals, argv):
    r, _ = refusals["usage:" + " ".join(argv)]
    assert r.returncode == 2 and "usage: tierfs" in r.stderr, r.stderr


@pytest.mark.parametrize("case_id,make_argv", [
    ("o:mount.max_tasks=abc", lambda d, hot, mnt: ["mount", hot, mnt, "-o", "mount.max_tasks=abc"]),
    ("toml0", lambda d, hot, mnt: ["mount", hot, mnt, "--config", d / "tierfs.toml"]),
    ("usage:frobnicate", lambda d, hot, mnt: ["frobnicate"]),
], ids=["override", "toml", "usage"])
def test_refusals_from_the_real_process(refusals, case_id, make_argv):
    """The batch above runs main() in-process; a real `python -m tierfs` must exit and print the same."""
    batch, hot = refusals[case_id]
    argv = make_argv(hot.parent, hot, hot.parent / "mnt")
    r = tierfs(*argv)
    assert (r.returncode, r.stderr.replace("__main__.py", "tierfs"), r.stdout) == \
        (2, batch.stderr.replace("__main__.py", "tierfs"), batch.stdout)


# ------------------------------------------------------------------------------------------ paths


def test_missing_hot_dir(dirs, tmp_path):
    _, mnt = dirs
    missing = tmp_path / "no-hot"
    assert_refused(tierfs("mount", missing, mnt), f"hot dir '{missing}' does not exist", f"mkdir -p {missing}")


def test_hot_dir_is_a_file(dirs, tmp_path):
    _, mnt = dirs
    f = tmp_path / "file"
    f.write_text("x")
    assert_refused(tierfs("mount", f, mnt), f"hot dir '{f}' is not a directory")


def test_missing_mountpoint(dirs, tmp_path):
    hot, _ = dirs
    missing = tmp_path / "no-mnt"
    assert_refused(tierfs("mount", hot, missing), f"mountpoint '{missing}' does not exist", f"mkdir -p {missing}",
                   hot=hot)


def test_non_empty_mountpoint(dirs):
    hot, mnt = dirs
    (mnt / "something").write_text("x")
    assert_refused(tierfs("mount", hot, mnt), f"mountpoint {mnt} is not empty", hot=hot)


def test_mountpoint_inside_hot_dir(dirs):
    hot, _ = dirs
    inner = hot / "store"
    inner.mkdir()
    assert_refused(tierfs("mount", hot, inner), f"mountpoint {inner} is inside the hot dir {hot}")


def test_hot_dir_inside_mountpoint(tmp_path):
    mnt = tmp_path / "mnt"
    hot = mnt / "hot"
    hot.mkdir(parents=True)
    try:
        # the mountpoint is not empty either; the nesting is what must be reported
        assert_refused(tierfs("mount", hot, mnt), f"hot dir {hot} is inside the mountpoint {mnt}")
    finally:
        Mount(hot, mnt).cleanup()


def test_same_dir_for_both(dirs):
    hot, _ = dirs
    assert_refused(tierfs("mount", hot, hot), "inside the hot dir")


@requires_fuse
def test_already_mounted(mount_store, tmp_path):
    m = mount_store()
    other = tmp_path / "other-hot"
    other.mkdir()
    assert_refused(tierfs("mount", other, m.mnt), f"mountpoint {m.mnt} is already a mount",
                   f"tierfs umount {m.mnt}", hot=other)
    assert m.alive() and m.status()["hot_dir"] == str(m.hot)


@requires_fuse
def test_dead_mount_is_refused_with_the_fix(mount_store):
    m = mount_store(options=["mount.attr_timeout=0"])  # see the next test for the cached case
    os.kill(m.pid, signal.SIGKILL)
    m.wait_exit()
    assert m.is_mounted(), "a SIGKILLed daemon leaves its (dead) mount behind"
    r = tierfs("mount", m.hot, m.mnt)
    assert_refused(r, f"mountpoint {m.mnt} is a dead mount left by a crashed daemon",
                   f"fusermount3 -uz {m.mnt}")
    m.kill()  # lazy-unmounts the dead mount
    m.mount()  # and the same dirs mount again
    assert m.status()["pid"] == m.pid


@requires_fuse
def test_dead_mount_is_recognised_while_attributes_are_cached(mount_store):
    """Right after a crash the kernel still answers stat(MNT) from its attribute cache; the refusal must still
    name the dead mount and its fix (not 'already a mount; tierfs umount')."""
    m = mount_store(options=["mount.attr_timeout=30"])
    os.stat(m.mnt)
    os.kill(m.pid, signal.SIGKILL)
    m.wait_exit()
    assert_refused(tierfs("mount", m.hot, m.mnt), f"mountpoint {m.mnt} is a dead mount left by a crashed daemon")


# ------------------------------------------------------------------------------------------ status


@requires_fuse
def test_status_text_and_json(mounted):
    r = tierfs("status", mounted.mnt)
    assert r.returncode == 0 and r.stdout.startswith("tierfs status"), r.stderr
    assert re.search(rf"\bpid\s+{mounted.pid}\b", r.stdout), r.stdout
    r = tierfs("status", mounted.mnt, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["pid"] == mounted.pid
    assert d["hot_dir"] == str(mounted.hot) and d["mountpoint"] == str(mounted.mnt)
    assert d["open_files"] == 0
    assert d["statfs_capacity_bytes"] > 0


def test_status_and_umount_of_a_plain_dir_exit_2(tmp_path):
    for cmd in (["status"], ["status", "--json"], ["umount"]):
        r = tierfs(*cmd, tmp_path)
        assert_refused(r, f"{tmp_path} is not a tierfs mount")
        assert r.stdout == ""
    missing = tmp_path / "missing"
    assert_refused(tierfs("status", missing), f"{missing} is not a tierfs mount")


@requires_fuse
def test_status_of_a_crashed_daemon(mount_store):
    m = mount_store()
    os.kill(m.pid, signal.SIGKILL)
    m.wait_exit()
    r = tierfs("status", m.mnt)
    assert r.returncode == 1 and "Transport endpoint is not connected" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ umount


FLUSH_WRITER = r"""
import mmap, os
fd = os.open("seg", os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, 1 << 20)
m = mmap.mmap(fd, 1 << 20)
m[0:9] = b"via-mmap!"          # never msync'ed: dirty pages in the kernel when this process exits
m[500000:500005] = b"tail!"
fd2 = os.open("cfg", os.O_WRONLY | os.O_CREAT, 0o644)
os.write(fd2, b"via-write")      # never fsync'ed
"""


@requires_fuse
def test_umount_flushes_and_daemon_exits_0(mounted):
    run_python(FLUSH_WRITER, cwd=mounted.mnt)
    pid = mounted.pid
    r = tierfs("umount", mounted.mnt)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"tierfs: unmounted {mounted.mnt}"
    assert not mounted.is_mounted(any_state=True)
    assert not pid_alive(pid)
    assert not mounted.pid_file.exists(), "pid file left: not a clean shutdown"
    assert mounted.daemon_exit_code() == 0
    assert "clean exit" in mounted.log_text()
    seg = mounted.hot_path("seg").read_bytes()
    assert len(seg) == 1 << 20 and seg[:9] == b"via-mmap!" and seg[500000:500005] == b"tail!"
    assert mounted.hot_path("cfg").read_bytes() == b"via-write"


@requires_fuse
def test_umount_of_a_crashed_daemons_mount_clears_it(mount_store):
    m = mount_store()
    os.kill(m.pid, signal.SIGKILL)
    m.wait_exit()
    r = tierfs("umount", m.mnt)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"the daemon of {m.mnt} had crashed; cleared the dead mount" in r.stderr
    assert not m.is_mounted(any_state=True)
    m.mount()  # and it mounts again at once
    assert m.status()["pid"] == m.pid


# An init (PID 1) that reaps orphans late, like some container inits: the exited daemon is a zombie meanwhile.
LATE_REAPER = r"""
import ctypes, os, subprocess, sys, time
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER
r = subprocess.run(sys.argv[2:], capture_output=True, text=True)
print(r.returncode, flush=True)
sys.stdin.readline()          # the test has asked for the unmount
time.sleep(float(sys.argv[1]))
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""


@requires_fuse
def test_umount_does_not_wait_for_the_zombie_to_be_reaped(tmp_path):
    """The daemonised tierfs is an orphan; once it exits it is a zombie until PID 1 reaps it. umount must treat
    it as gone (a never-reaping init would otherwise make every umount wait 60 s and fail)."""
    hot, mnt = tmp_path / "hot", tmp_path / "mnt"
    hot.mkdir()
    mnt.mkdir()
    delay = 8.0
    reaper = subprocess.Popen([sys.executable, "-c", LATE_REAPER, str(delay), *TIERFS_CMD, "mount", str(hot),
                               str(mnt)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=daemon_env(), start_new_session=True)
    try:
        assert reaper.stdout.readline().strip() == "0"
        reaper.stdin.write("\n")
        reaper.stdin.flush()
        t0 = time.monotonic()
        r = tierfs("umount", mnt, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert took < delay / 2, f"tierfs umount took {took:.1f}s: it waited for the zombie to be reaped"
    finally:
        Mount(hot, mnt).cleanup()
        os.killpg(reaper.pid, signal.SIGKILL)  # our own helper, by its pid (session leader)
        reaper.wait()


# ------------------------------------------------------------------------------------------ effective config


@requires_fuse
def test_overrides_beat_the_config_file_and_show_in_control_dir(mount_store):
    m = mount_store(config_text='[mount]\nlog_level = "warning"\nattr_timeout = 2.5\n',
                    options=["mount.log_level=debug,statfs.capacity_bytes=2GiB"])
    cfg = (m.ctl / "config").read_text()
    assert 'log_level = "debug"' in cfg  # -o wins over the file
    assert "attr_timeout = 2.5" in cfg  # the file wins over the default
    assert "capacity_bytes = 2147483648" in cfg
    assert str(m.config) in cfg.splitlines()[0]
    assert os.statvfs(m.mnt).f_blocks * os.statvfs(m.mnt).f_frsize == 2 << 30


@requires_fuse
def test_secret_keys_are_redacted_everywhere(mount_store):
    from tierfs.config import SCHEMA

    secrets = [k.name for k in SCHEMA if k.secret and k.kind == "str"]
    if not secrets:
        pytest.skip("no secret keys in this version's schema")
    value = "S3CR3T-do-not-show-me"
    m = mount_store(options=[f"{name}={value}" for name in secrets])
    shown = "".join((m.ctl / f).read_text() for f in os.listdir(m.ctl))
    assert value not in shown
    cfg = (m.ctl / "config").read_text()
    for name in secrets:
        assert f'{name.rpartition(".")[2]} = "<redacted>"' in cfg
    assert value not in m.log_text()
    assert value not in tierfs("status", m.mnt, "--json").stdout


# ------------------------------------------------------------------------------------------ documentation


def test_config_doc_lists_every_key():
    from tierfs.config import SCHEMA

    r = tierfs("config-doc")
    assert r.returncode == 0, r.stderr
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", r.stdout, re.M)}
    assert rows == {k.name for k in SCHEMA}
    for k in SCHEMA:
        assert k.allowed() in r.stdout, k.name


def test_readme_documents_every_key():
    readme = REPO / "README.md"
    if not readme.exists():
        pytest.skip("README.md does not exist")
    from tierfs.config import SCHEMA

    text = readme.read_text()
    missing = [k.name for k in SCHEMA if f"`{k.name}`" not in text]
    assert not missing, f"README.md does not document: {missing}"
