"""`tierfs fsck` against real stores made through a real mount (posix object store and Ceph RGW): clean when
mounted and unmounted, then damaged by hand (a deleted object, a corrupted object, orphans, a hole punched in a
resident block, a hot file deleted behind the catalog's back, a stale multipart upload), found, repaired where that
is safe, and the store still reads back through a new mount."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pty
import select
import sqlite3
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
from mountutil import TIERFS_CMD, evict, run, wait_for
from test_tiering import (  # noqa: F401
    TIER_OPTS,
    copy_in,
    reference_store,
    s3_opts,
    segments,
    status,
    wait_tiered_and_evicted,
)

from tierfs.objectstore import ObjectStore
from tierfs.tier import storeconfig
from tierfs.tier.evictor import punch_hole
from tierfs.tier.lease import LeaseRecord, lease_key

BLOCK = 64 * 1024
CHUNK = 256 * 1024


def fsck(target, *args: str, timeout: float = 120) -> tuple[int, dict, str]:
    """Run `tierfs fsck TARGET --json ARGS`: (exit code, report, stderr)."""
    r = run([*TIERFS_CMD, "fsck", str(target), "--json", *args], timeout=timeout)
    try:
        report = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"fsck printed no JSON (exit {r.returncode}): {r.stdout!r} {r.stderr!r}") from None
    assert report["exit_code"] == r.returncode
    return r.returncode, report, r.stderr


def kinds(report: dict) -> dict[str, int]:
    return report["summary"]


def rows(hot: Path) -> dict[str, dict]:
    db = sqlite3.connect(f"file:{hot / '.tierfs' / 'catalog.db'}?mode=ro", uri=True)
    try:
        cols = ("path", "kind", "size", "state", "generation", "objects", "resident", "block_bytes", "chunk_bytes")
        out = {}
        for r in db.execute(f"SELECT {','.join(cols)} FROM files"):
            d = dict(zip(cols, r))
            d["objects"] = json.loads(d["objects"])
            out[d["path"]] = d
        return out
    finally:
        db.close()


def resident(row: dict, b: int) -> bool:
    return bool(row["resident"][b >> 3] & (1 << (b & 7)))


def chunk_blocks(row: dict, i: int) -> range:
    per = CHUNK // BLOCK
    return range(i * per, min((i + 1) * per, -(-row["size"] // BLOCK)))


def pending_deletes(hot: Path) -> set[str]:
    db = sqlite3.connect(f"file:{hot / '.tierfs' / 'catalog.db'}?mode=ro", uri=True)
    try:
        return {r[0] for r in db.execute("SELECT key FROM pending_deletes")}
    finally:
        db.close()


def run_on_tty(args: list[str], timeout: float = 120) -> str:
    """Run a command with stdout and stderr on a pseudo-terminal; everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 0x0 terminal shows no bar
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        os.close(master)
    return out.decode(errors="replace")


def make_stale_upload(backend: str, store: ObjectStore, key: str, rgw) -> str:
    """An upload a crashed writer left behind: a posix temp file, or an S3 multipart upload with one part."""
    if backend == "posix":
        root = Path(store.url[len("file://"):])
        d = root / key.rsplit("/", 1)[0]
        d.mkdir(parents=True, exist_ok=True)
        name = f".tierfs-tmp.0123456789abcdef.{key.rsplit('/', 1)[1]}"
        (d / name).write_bytes(b"partial upload")
        return name
    client = rgw.client()
    full = f"{store.prefix}/{key}" if store.prefix else key
    up = client.create_multipart_upload(Bucket=store.bucket, Key=full)
    client.upload_part(Bucket=store.bucket, Key=full, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 1024)
    return up["UploadId"]


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_fsck_finds_and_repairs_damage(mount_store, reference_store, backend, request):
    rgw = request.getfixturevalue("rgw") if backend == "s3" else None
    m = mount_store(options=[TIER_OPTS if rgw is None else s3_opts(rgw, "fsck", ",snapshot.interval_seconds=1")])
    copy_in(reference_store, m.mnt)
    n_segs = len(segments(reference_store))
    wait_for(lambda: len([f for f in status(m)["files"] if f["state"] == "tiered"]) >= n_segs // 2, timeout=90,
             what="tiering")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]], timeout=90)

    # --- mounted: a read-only check by mountpoint or hot dir; --repair refused
    code, rep, err = fsck(m.mnt)
    assert code == 0 and rep["clean"] and rep["target"]["mounted"], rep
    assert rep["target"]["hot_dir"] == str(m.hot)
    assert err == ""  # no progress bar when not on a terminal
    code, rep, _ = fsck(m.hot)
    assert code == 0 and rep["target"]["mounted"] and rep["target"]["mountpoint"] == str(m.mnt), rep
    r = run([*TIERFS_CMD, "fsck", str(m.mnt), "--repair"], timeout=60)
    assert r.returncode == 2 and "needs the store unmounted" in r.stderr and "tierfs umount" in r.stderr, r.stderr
    m.umount()

    # --- unmounted and intact: clean, also --deep; a progress bar only on a terminal
    code, rep, _ = fsck(m.hot, "--deep")
    assert code == 0 and rep["clean"], rep
    assert rep["checked"]["bytes_verified"] == sum(r["size"] for r in rows(m.hot).values() if r["state"] == "tiered")
    tty = run_on_tty([*TIERFS_CMD, "fsck", str(m.hot), "--deep"])
    assert "verifying objects" in tty and "clean: no damage found" in tty, tty
    tty = run_on_tty([*TIERFS_CMD, "fsck", str(m.hot), "--json"])
    assert "verifying" not in tty and "listing" not in tty and json.loads(tty)["clean"], tty

    # --- damage it
    sc = storeconfig.load(m.state_dir)
    store = sc.open()
    sid = sc.store_id
    cat = {p: r for p, r in rows(m.hot).items() if r["state"] == "tiered"}
    commitlogs = sorted(p for p, r in cat.items() if r["kind"] == "commitlog")

    def evicted_chunk(path: str) -> int | None:
        r = cat[path]
        return next((i for i in range(len(r["objects"]))
                     if not any(resident(r, b) for b in chunk_blocks(r, i))), None)

    evicted = [p for p in commitlogs if evicted_chunk(p) is not None]
    assert len(evicted) >= 2, "need two evicted commitlog segments"
    lost_path, corrupt_path = evicted[0], evicted[1]
    lost_key = cat[lost_path]["objects"][evicted_chunk(lost_path)]
    store.delete(lost_key)  # the only copy of those blocks: cannot be repaired
    corrupt_key = cat[corrupt_path]["objects"][evicted_chunk(corrupt_path)]
    data = bytearray(store.get(corrupt_key))
    data[1000] ^= 0xFF  # same size: only --deep sees it
    store.put(corrupt_key, bytes(data))

    whole = sorted(p for p, r in cat.items() if all(resident(r, b) for b in range(-(-r["size"] // BLOCK)))
                   and r["kind"] != "commitlog")
    reupload_path, gone_path = whole[0], whole[1]
    reupload_key = cat[reupload_path]["objects"][0]
    store.delete(reupload_key)  # every block is resident and verified locally: re-uploaded by --repair
    gone_keys = cat[gone_path]["objects"]
    os.unlink(m.hot / gone_path)  # deleted behind the catalog's back

    hole_path = next(p for p in commitlogs if resident(cat[p], 3))
    hole_off = 3 * BLOCK + 8192
    assert (reference_store / hole_path).read_bytes()[hole_off:hole_off + 4096] != bytes(4096)
    fd = os.open(m.hot / hole_path, os.O_RDWR)
    punch_hole(fd, hole_off, 4096)
    os.close(fd)

    orphan = f"{sid}/seg/commitlog/99999999999999999999/0.raw/000000"
    store.put(orphan, b"left behind")
    kept_orphan = f"{sid}/seg/checkpoint/0.raw/000000"  # a hot file without a row may depend on it
    store.put(kept_orphan, b"maybe needed")
    stale_key = f"{sid}/seg/commitlog/{commitlogs[0].split('/')[1]}/0.raw/000009"
    stale_id = make_stale_upload(backend, store, stale_key, rgw)

    # --- found
    code, rep, _ = fsck(m.hot)
    assert code == 1 and not rep["clean"]
    assert kinds(rep) == {"missing_object": 2, "row_without_hot_file": 1, "false_resident": 1,
                          "orphan_object": 2, "stale_upload": 1}, rep["findings"]
    by_kind = {}
    for f in rep["findings"]:
        by_kind.setdefault(f["kind"], []).append(f)
    assert {f["key"] for f in by_kind["missing_object"]} == {lost_key, reupload_key}
    assert by_kind["false_resident"][0]["path"] == hole_path and by_kind["false_resident"][0]["block"] == 3
    assert by_kind["row_without_hot_file"][0]["path"] == gone_path
    assert {f["key"] for f in by_kind["orphan_object"]} == {orphan, kept_orphan}
    assert by_kind["stale_upload"][0]["key"] == stale_key and by_kind["stale_upload"][0]["upload_id"] == stale_id
    code, rep, _ = fsck(m.hot, "--deep")
    assert code == 1 and kinds(rep).get("corrupt_object") == 1, rep["findings"]
    corrupt = next(f for f in rep["findings"] if f["kind"] == "corrupt_object")
    assert corrupt["key"] == corrupt_key and "crc32c" in corrupt["detail"]
    human = run([*TIERFS_CMD, "fsck", str(m.hot)], timeout=120)
    assert human.returncode == 1 and "damage found: 7 problems; run with --repair" in human.stdout, human.stdout
    assert (rgw.secret_key if rgw else "\0") not in human.stdout + json.dumps(rep)

    # --- not while another writer holds the store id's lease: its new objects would look orphaned from here
    now = time.time()
    other = LeaseRecord(epoch=999_999, holder="elsewhere:/hot", host="elsewhere", hot_dir="/hot", pid=1,
                        mountpoint="/mnt", acquired_at=now, expires_at=now + 600)
    store.put(lease_key(sid, other.epoch), other.encode())
    r = run([*TIERFS_CMD, "fsck", str(m.hot), "--repair"], timeout=120)
    assert r.returncode == 2 and "held by another writable mount (host elsewhere" in r.stderr, r.stderr
    store.delete(lease_key(sid, other.epoch))

    # --- repaired where safe
    code, rep, _ = fsck(m.hot, "--deep", "--repair")
    assert code == 1
    done = {(f["kind"], f["key"] or f["path"]): f for f in rep["findings"]}
    assert done[("missing_object", reupload_key)]["repaired"].startswith("re-uploaded")
    assert done[("false_resident", hole_path)]["repaired"].startswith("restored block 3")
    assert done[("row_without_hot_file", gone_path)]["repaired"]
    assert done[("orphan_object", orphan)]["repaired"]
    assert done[("stale_upload", stale_key)]["repaired"]
    assert not done[("missing_object", lost_key)]["repaired"] and "only copy" in \
        done[("missing_object", lost_key)]["unrepaired"]
    assert not done[("corrupt_object", corrupt_key)]["repaired"]
    assert not done[("orphan_object", kept_orphan)]["repaired"] and "kept" in done[("orphan_object", kept_orphan)][
        "unrepaired"]
    assert rep["repaired"] == 5
    # what the repairs did, seen from outside
    assert store.head(orphan) is None and store.head(kept_orphan) is not None
    assert not list(store.list_multipart_uploads(stale_key))
    ref = (reference_store / reupload_path).read_bytes()
    assert store.get(reupload_key) == ref[:CHUNK]
    assert (m.hot / hole_path).read_bytes()[hole_off:hole_off + 4096] == \
        (reference_store / hole_path).read_bytes()[hole_off:hole_off + 4096]
    assert gone_path not in rows(m.hot) and set(gone_keys) <= pending_deletes(m.hot)
    # what is left is what cannot be repaired safely
    code, rep, _ = fsck(m.hot, "--deep")
    assert code == 1 and kinds(rep) == {"missing_object": 1, "corrupt_object": 1, "orphan_object": 1}, rep
    store.delete(kept_orphan)
    store.close()

    # --- the repaired store still serves every byte it can, and EIO (never wrong bytes) for the lost chunk
    m.mount()
    for rel in (hole_path, reupload_path):
        evict(m.mnt / rel)
        assert (m.mnt / rel).read_bytes() == (reference_store / rel).read_bytes(), rel
    lost_chunk = cat[lost_path]["objects"].index(lost_key)
    evict(m.mnt / lost_path)
    with open(m.mnt / lost_path, "rb") as f:
        f.seek(lost_chunk * CHUNK + 4096)
        with pytest.raises(OSError) as ei:
            f.read(4096)
    assert ei.value.errno == errno.EIO
    if rgw is not None:
        # the bucket's kept catalog snapshots still name the dropped row's objects (a read-only mount may be
        # serving one of them): they go only once newer snapshots have replaced every such one
        from tierfs.tier.snapshot import KEEP  # noqa: PLC0415
        for i in range(KEEP):
            seq = status(m)["snapshot"].get("seq", 0)
            (m.mnt / f"marker{i}").write_text(str(i))
            wait_for(lambda: status(m)["snapshot"].get("seq", 0) > seq, timeout=60, what="a newer snapshot")
    with sc.open() as store:
        wait_for(lambda: all(store.head(k) is None for k in gone_keys), timeout=30,
                 what="objects of the dropped row deleted by the daemon")


def test_fsck_usage_errors(tmp_path):
    r = run([*TIERFS_CMD, "fsck", str(tmp_path / "nope")], timeout=60)
    assert r.returncode == 2 and "no such file or directory" in r.stderr
    r = run([*TIERFS_CMD, "fsck", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "neither a tierfs mountpoint nor a hot dir" in r.stderr
    (tmp_path / ".tierfs").mkdir()
    sqlite3.connect(tmp_path / ".tierfs" / "catalog.db").close()
    r = run([*TIERFS_CMD, "fsck", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "store.json does not exist" in r.stderr, r.stderr
    r = run([*TIERFS_CMD, "fsck"], timeout=60)
    assert r.returncode == 2 and "HOT_DIR_OR_MOUNTPOINT" in r.stderr
