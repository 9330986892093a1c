"""Issue 27, finding 6: the writer lease names one daemon process, and fencing is decided by the store.

Before: the holder id was host + hot dir, so a second mount with the same host name and hot dir path (a pod
rescheduled while its old node is cut off) took the lease without --force, and the old daemon later took it
back; uploads checked the lease by the local clock only, before a bandwidth wait that can outlast the ttl; the
Spark archive deleted superseded objects with no lease check at all.

Real processes: two `tierfs mount` daemons of one store id on the same hot dir *path* (the first one frozen while
its directory is moved aside, as its node would be cut off). In process: the store's fence at the moment of the
call, the claim/renew race decided by compare-and-swap, and the archive sweep's fence.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import signal
import time
import types
import uuid
from pathlib import Path

import pytest
from mountutil import wait_for
from test_rpo import TakeoverMount, status
from test_tiering import TIER_OPTS, copy_in, reference_store  # noqa: F401 (a fixture)

from ceph_rgw import rgw  # noqa: F401  (session fixture)
from tierfs.objectstore import ObjectStore, ObjectStoreError, open_store
from tierfs.tier.lease import LeaseHeld, WriterLease, lease_key, lease_prefix

ID_GAP = 1_000_000  # tierfs.tier.takeover: a takeover's generations start this far above the old writer's


def _stores(kind: str, tmp_path: Path, request) -> tuple[ObjectStore, ObjectStore]:
    """Two handles on one store, as two daemons on two hosts would have."""
    if kind == "posix":
        return open_store(f"file://{tmp_path}/objects"), open_store(f"file://{tmp_path}/objects")
    r = request.getfixturevalue("rgw")
    bucket = r.make_bucket("tierfs-lease-fencing")
    url = f"s3://{bucket}/{uuid.uuid4().hex[:12]}"
    opts = dict(endpoint_url=r.endpoint_url, access_key=r.access_key, secret_key=r.secret_key, max_attempts=3)
    return open_store(url, **opts), open_store(url, **opts)


@pytest.mark.parametrize("kind", ["posix", "rgw"])
def test_a_write_is_fenced_at_the_call_not_before_the_wait(kind, tmp_path, request):
    """An upload that checked the lease, then waited (for bandwidth; here inside its producer) while another
    mount took the lease over, is refused by the store at the PUT, although the old holder's own clock still says
    it holds the lease (ttl 600 s). Before: the PUT landed."""
    sa, sb = _stores(kind, tmp_path, request)
    old = WriterLease(sa, "sid", tmp_path / "hot-a", tmp_path / "mnt", ttl=600, host="a")
    new = WriterLease(sb, "sid", tmp_path / "hot-b", tmp_path / "mnt", ttl=600, host="b")
    old.acquire()
    sa.put("sid/seg/commitlog/0/1.raw/000000", b"before")

    def chunks():
        yield b"x" * 1000
        new.acquire(force=old.id)  # the takeover happens while the upload waits
        yield b"y" * 1000

    assert old.held()  # by its clock
    with pytest.raises(ObjectStoreError, match="refused: fenced"):
        sa.put_stream("sid/seg/commitlog/0/1.raw/000001", chunks())
    assert sb.head("sid/seg/commitlog/0/1.raw/000001") is None
    assert old.fenced and not old.held()
    for call in (lambda: sa.delete("sid/seg/commitlog/0/1.raw/000000"),
                 lambda: sa.delete_many(["sid/seg/commitlog/0/1.raw/000000"]),
                 lambda: sa.put("sid/meta/catalog-latest.json", b"{}")):
        with pytest.raises(ObjectStoreError, match="refused"):
            call()
    assert sb.get("sid/seg/commitlog/0/1.raw/000000") == b"before"
    sb.put("sid/seg/commitlog/0/2.raw/000000", b"new writer")  # the new holder writes
    new.release()
    with pytest.raises(LeaseHeld):
        old.acquire()  # released, but never again for a daemon that was taken over
    assert [i.key for i in sb.list(lease_prefix("sid"))] == [lease_key("sid", new.epoch)]


class _RenewsFirst:
    """A taker's view of the store in which the holder renews between the taker's read and its first write."""

    def __init__(self, store: ObjectStore, holder: WriterLease):
        self.store, self.holder = store, holder

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def _renew_once(self) -> None:
        holder, self.holder = self.holder, None
        if holder is not None:
            holder.renew()

    def put_if_match(self, key: str, data: bytes, etag: str | None, metadata=None) -> str | None:
        self._renew_once()
        return self.store.put_if_match(key, data, etag, metadata)

    def put_if_absent(self, key: str, data: bytes, metadata=None) -> bool:
        self._renew_once()
        return self.store.put_if_absent(key, data, metadata)


@pytest.mark.parametrize("kind", ["posix", "rgw"])
def test_a_renewal_and_a_takeover_are_decided_by_the_store(kind, tmp_path, request):
    """The lease in force looks expired to a taker (the holder was slow to renew); the holder renews after the
    taker read it and before the taker acts. The store lets exactly one win: here the renewal, so the taker
    reads again, finds the lease live and is refused. Before: the taker created the next epoch over a lease its
    holder had just renewed, and both wrote."""
    sa, sb = _stores(kind, tmp_path, request)
    holder = WriterLease(sa, "sid", tmp_path / "hot-a", tmp_path / "mnt", ttl=600, host="a")
    holder.acquire()
    cur = holder.current()
    stale = dataclasses.replace(cur, expires_at=time.time() - 1)  # as if the holder's renewals had been late
    sa.put(lease_key("sid", cur.epoch), stale.encode())
    taker = WriterLease(_RenewsFirst(sb, holder), "sid", tmp_path / "hot-b", tmp_path / "mnt", ttl=600, host="b")
    with pytest.raises(LeaseHeld, match="host a"):
        taker.acquire()
    assert taker.epoch == 0 and holder.held() and holder.current().epoch == cur.epoch
    holder.verify()  # still ours by the store's word
    holder.renew()


def test_archive_sweep_refuses_once_the_lease_moved(tmp_path):
    """The Spark archive's driver deletes superseded and expired parts only while the lease in force is the one
    its daemon held when the job started (recorded in the daemon's state dir, which holds the job dir)."""
    from tierfs.spark.job import _sweep
    from tierfs.tier import layout
    from tierfs.tier.lease import last_holder

    store = open_store(f"file://{tmp_path}/objects")
    hot = tmp_path / "hot"
    state = hot / ".tierfs"
    (state / "jobs" / "job1").mkdir(parents=True)
    daemon = WriterLease(store, "sid", hot, tmp_path / "mnt", ttl=600)
    daemon.acquire()
    assert json.loads((state / "lease.json").read_text())["epoch"] == daemon.epoch
    old_part = layout.archive_key("sid", "T", "2999-01-01", "commitlog/00000000000000000000", 5)
    store.put(old_part, b"PAR1-old")
    inp = types.SimpleNamespace(store={"url": f"file://{tmp_path}/objects", "options": {}}, store_id="sid",
                                retention={"*": 10_000.0}, today=dt.date(2999, 1, 2),
                                job_dir=state / "jobs" / "job1")
    archived = [{"path": "commitlog/00000000000000000000", "generation": 9}]
    at_start = last_holder(state, "sid")  # what run_job reads as the job starts
    (tmp_path / "hot2" / ".tierfs").mkdir(parents=True)
    other = WriterLease(open_store(f"file://{tmp_path}/objects"), "sid", tmp_path / "hot2", tmp_path / "mnt2",
                        ttl=600)
    other.acquire(force=daemon.id)  # taken over while the job ran
    result = {"archive": archived, "errors": []}
    _sweep(inp, result, at_start)
    assert store.get(old_part) == b"PAR1-old"
    assert result["errors"] and "moved since this job started" in result["errors"][0]["error"], result
    result = {"archive": archived, "errors": []}  # a job of the new holder deletes it
    _sweep(inp, result, last_holder(tmp_path / "hot2" / ".tierfs", "sid"))
    assert not result["errors"] and result["archive_superseded"] == [old_part] and store.head(old_part) is None


def _seg_keys(objects: Path, sid: str) -> set[str]:
    return {i.key for i in open_store(f"file://{objects}").list(f"{sid}/seg/")}


def _generation(key: str) -> int:
    return int(re.search(r"/(\d+)\.(raw|lz4c)(/|$)", key).group(1))


def _take_over_same_path(b: TakeoverMount, a, a_id: str, path: Path) -> dict:
    """B on the same hot dir path as A: refused naming A, then forced; unmounted again. B's lease status."""
    refused = b._cli_mount()
    assert refused.returncode != 0, "a second daemon with the same host and hot dir path took the lease"
    assert f"pid {a.pid}" in refused.stderr and "held by another writable tierfs mount" in refused.stderr
    assert f"--force '{a_id}'" in refused.stderr, refused.stderr
    shutil.rmtree(path / ".tierfs")  # the refused daemon's log: a takeover needs an empty hot dir
    b.force = a_id
    b.mount()
    lease_b = status(b)["lease"]
    assert lease_b["held"] and lease_b["holder"] != a_id and lease_b["holder"].endswith(f":{path}")
    b.umount()  # releases the lease: free for anyone but A
    return lease_b


def test_same_host_and_hot_dir_path_is_another_holder(tmp_path, mount_store, reference_store):  # noqa: F811
    """A writable mount A uploads under a tight bandwidth cap; it is frozen (its node cut off) and its hot dir
    moved aside; a takeover mount B on a new, empty hot dir at the *same path*, same host name, is refused without
    --force (before: same holder id, so it took the lease at once), then takes it with --force and unmounts
    (releasing it). A, thawed with its own hot dir back, and its clock still within the ttl: its in-flight upload
    is refused by the store (no object of its generations appears), it logs FENCED, and it never takes the
    released lease back (before: it did, at its next renewal)."""
    objects = tmp_path / "objects"
    objects.mkdir()
    opts = [TIER_OPTS, f"objectstore.url=file://{objects},store.id=twin,lease.ttl_seconds=60,"
                       "tiering.rpo_seconds=0,snapshot.interval_seconds=1,upload.bandwidth_bytes_per_second=32768"]
    path = tmp_path / "hot"
    a = mount_store(path, options=opts)
    copy_in(reference_store, a.mnt)

    def uploading() -> bool:
        st = status(a)
        return st["snapshot"].get("seq") and any(f["state"] == "uploading" for f in st["files"])
    wait_for(uploading, timeout=60, what="a snapshot, and an upload in flight (throttled)")
    a_id = status(a)["lease"]["holder"]
    aside = tmp_path / "hot-a-aside"
    os.kill(a.pid, signal.SIGSTOP)
    try:
        before = _seg_keys(objects, "twin")
        path.rename(aside)
        path.mkdir()
        (tmp_path / "mnt-b").mkdir()
        b = TakeoverMount(f"file://{objects}/twin", path, tmp_path / "mnt-b", options=opts)
        try:
            lease_b = _take_over_same_path(b, a, a_id, path)
        finally:
            b.cleanup()
        path.rename(tmp_path / "hot-b-aside")
        aside.rename(path)
    finally:
        if aside.exists() and not path.exists():
            aside.rename(path)
        os.kill(a.pid, signal.SIGCONT)
    wait_for(lambda: any("upload of" in line and "refused: fenced" in line for line in a.log_text().splitlines()),
             timeout=60, what="A's in-flight upload refused by the store")
    wait_for(lambda: "WRITER LEASE NOT HELD" in a.log_text(), timeout=60, what="A's renewal loop to give up")
    assert "FENCED" in a.log_text()
    st = status(a)["lease"]
    assert st["fenced"] and not st["held"] and st["epoch"] < lease_b["epoch"]
    store = open_store(f"file://{objects}")
    epochs = [i.key for i in store.list(lease_prefix("twin"))]
    assert epochs == [lease_key("twin", lease_b["epoch"])], epochs  # A took nothing back
    late = sorted(k for k in _seg_keys(objects, "twin") - before if _generation(k) < ID_GAP)
    assert not late, f"objects written by the superseded writer: {late}"
