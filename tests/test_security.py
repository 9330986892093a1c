"""Security (issue 5 point 4) on real mounts. Covered elsewhere, and not repeated here:
- secrets redacted in every control file, the log and `status --json`: test_cli.py::test_secret_keys_are_redacted_everywhere
- object keys only from validated relative paths (no '..', absolute paths, control characters):
  test_objectstore.py::test_key_validation, test_bad_input.py::test_odd_segment_paths_never_stop_tiering, and the
  hostile-snapshot checks in test_readonly.py
- the control directory is read-only in every mode: test_readonly.py
- permission bits, ownership, setuid clearing and umask: test_fs_semantics.py
"""

from __future__ import annotations

import os
import stat
import time

from test_tiering import TIER_OPTS, copy_in, reference_store, s3_opts  # noqa: F401


def mount_options(mnt) -> set[str]:
    for line in open("/proc/mounts"):
        dev, where, fstype, opts, *_ = line.split()
        if where == str(mnt):
            return set(opts.split(","))
    raise AssertionError(f"{mnt} is not in /proc/mounts")


def test_allow_other_only_when_configured(mount_store):
    m = mount_store()
    assert "allow_other" not in mount_options(m.mnt)
    m2 = mount_store(options=["mount.allow_other=true"])
    assert "allow_other" in mount_options(m2.mnt)


def test_credentials_never_reach_logs_even_when_the_store_refuses_them(mount_store, reference_store, rgw):
    """Wrong credentials make every request fail and get logged: the secret must appear in none of it, and the
    settings file kept for offline tools is readable by its owner only."""
    secret = "Wr0ngS3cretValue-never-print"
    opts = s3_opts(rgw, "sec-wrong-key", f",objectstore.secret_access_key={secret},objectstore.max_attempts=1")
    m = mount_store(options=[opts])
    copy_in(reference_store, m.mnt)
    deadline = time.monotonic() + 30
    while "failed" not in m.log_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "failed" in m.log_text(), "uploads with a wrong secret should fail and be logged"
    texts = [m.log_text(), *(p.read_text(errors="replace") for p in m.state_dir.glob("daemon*.stderr*"))]
    texts += [(m.ctl / f).read_text() for f in os.listdir(m.ctl)]
    assert not any(secret in t for t in texts)
    store_json = m.state_dir / "store.json"
    assert stat.S_IMODE(store_json.stat().st_mode) == 0o600
