"""A broker group's replicas on two mounts sharing a bucket are stored once (issue 29): each mount has its own hot
dir, catalog and store id; with the same upload.dedup_group their sealed segments' chunks go to the group's
content-addressed namespace (groups/<group>/cas/), and each mount marks what it relies on in the bucket
(groups/<group>/refs/<sha256>/<store-id>, tierfs.tier.sharedrefs). Retention on one mount keeps the other's bytes;
once both let go, nothing is left. The race between a deleter and an upload of the same bytes is closed by the
tombstone protocol: a failpoint holds the deleter between its tombstone and its re-list while the other uploads.
Real mounts, the example producer's store, the posix object store and Ceph RGW."""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import pytest

from mountutil import wait_for
from test_dedup import evict_all, mmap_crc, named_keys, pending_deletes
from test_fsck import fsck, kinds
from test_tiering import TIER_OPTS, by_path, copy_in, s3_opts, status
from test_tiering import reference_store  # noqa: F401 (a fixture)

GROUP = "broker-a"
GRACE = 1.0
PAYLOAD = re.compile(r"^[^/]+/(seg|cas)/|^groups/[^/]+/cas/")  # stored segment bytes (not markers, snapshots)


class Bucket:
    """Every object of the shared bucket below its prefix: key -> size (posix directory or an RGW bucket)."""

    def __init__(self, root: Path | None = None, rgw=None, bucket: str = ""):
        self.root, self.rgw, self.bucket = root, rgw, bucket

    def listing(self) -> dict[str, int]:
        if self.rgw is None:
            return {str(p.relative_to(self.root)): p.stat().st_size for p in self.root.rglob("*") if p.is_file()}
        c, out, token = self.rgw.client(), {}, None
        while True:
            kw = {"ContinuationToken": token} if token else {}
            r = c.list_objects_v2(Bucket=self.bucket, Prefix="stores/", **kw)
            out.update({o["Key"][len("stores/"):]: o["Size"] for o in r.get("Contents", [])})
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def payload(self) -> dict[str, int]:
        return {k: v for k, v in self.listing().items() if PAYLOAD.search(k)}

    def group(self, kind: str) -> set[str]:
        return {k for k in self.listing() if k.startswith(f"groups/{GROUP}/{kind}/")}


def group_opts(request, tmp_path: Path, backend: str, bucket: str) -> tuple[str, Bucket]:
    extra = f",upload.dedup_group={GROUP},upload.dedup_group_grace_seconds={GRACE}"
    if backend == "s3":
        rgw = request.getfixturevalue("rgw")
        opts = s3_opts(rgw, bucket, extra)
        store = Bucket(rgw=rgw, bucket=bucket)
    else:
        root = tmp_path / bucket
        root.mkdir()
        opts = f"{TIER_OPTS},objectstore.url=file://{root}{extra}"
        store = Bucket(root)
    return opts.replace("cache.max_bytes=2MiB", "cache.max_bytes=1GiB"), store


def sealed_tiered(m, ref: Path) -> list[str]:
    """Wait until every sealed segment (all but the last CommitLog file) is tiered and nothing waits to upload."""
    commitlogs = sorted(p.name for p in (ref / "commitlog").iterdir())[:-1]
    want = {f"commitlog/{n}" for n in commitlogs}

    def done() -> bool:
        files = by_path(m)
        return all(files.get(p, {}).get("state") == "tiered" for p in want) and \
            status(m)["totals"]["upload_backlog_files"] == 0
    wait_for(done, timeout=120, what="the sealed segments tiered")
    return sorted(p for p, f in by_path(m).items() if f["state"] == "tiered")


def sid_of(m) -> str:
    return (m.state_dir / "store-id").read_text().strip()


def put_object(store: Bucket, key: str) -> None:
    if store.rgw is None:
        from tierfs.objectstore import open_store

        with open_store(f"file://{store.root}") as s:
            s.put(key, b"x")
    else:
        store.rgw.client().put_object(Bucket=store.bucket, Key=f"stores/{key}", Body=b"x")


def markers_of(store: Bucket, keys: set[str], m) -> set[str]:
    sid = sid_of(m)
    return {k for k in store.group("refs") if k.endswith(f"/{sid}") and k.split("/")[3] in
            {x.rsplit("/", 1)[1] for x in keys}}


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_replicas_on_two_mounts_are_stored_once(request, tmp_path, mount_store, reference_store, backend):
    opts, store = group_opts(request, tmp_path, backend, "group-replicas")
    a, b = mount_store(options=[opts]), mount_store(options=[opts])
    for m in (a, b):
        copy_in(reference_store, m.mnt)
    for m in (a, b):
        sealed_tiered(m, reference_store)

    def tiered_of(m) -> list[str]:
        return sorted(p for p, f in by_path(m).items() if f["state"] == "tiered")
    wait_for(lambda: tiered_of(a) == tiered_of(b) and all(status(m)["totals"]["upload_backlog_files"] == 0
                                                         for m in (a, b)),
             timeout=120, what="the same segments tiered on both mounts")
    cl = [p for p in tiered_of(a) if p.startswith("commitlog/")]

    # stored once: every payload object of the bucket against what one replica's rows name
    objects = store.payload()
    tiered = {m: tiered_of(m) for m in (a, b)}
    one = named_keys(a, tiered[a])
    assert named_keys(a, cl) == named_keys(b, cl) and all(k.startswith(f"groups/{GROUP}/cas/") for k in one), \
        sorted(one)[:4]
    ratio = sum(objects.values()) / sum(objects[k] for k in one)
    print(f"stored bytes two mounts / one replica = {ratio:.3f} ({sum(objects.values())} bytes; {backend})")
    assert ratio <= 1.05, (ratio, sorted(objects)[:8])
    assert markers_of(store, one, a) and len(markers_of(store, one, a)) == len(markers_of(store, one, b))

    # both read back once evicted (cat, mmap)
    for m in (a, b):
        evict_all(m, cl)
        for p in cl:
            assert (m.mnt / p).read_bytes() == (reference_store / p).read_bytes(), p
        assert mmap_crc(m.mnt / cl[1]) == zlib.crc32((reference_store / cl[1]).read_bytes())

    # retention on A: its markers go, the objects stay for B, which reads them back after eviction
    shared = named_keys(a, cl)
    for p in cl:
        os.unlink(a.mnt / p)
    wait_for(lambda: pending_deletes(a) == 0, timeout=60, what="A's janitor's pass over its deletes")
    assert shared <= set(store.listing()), "an object B's rows name was deleted"
    assert not markers_of(store, shared - named_keys(a, [p for p in tiered[a] if p not in cl]), a)
    evict_all(b, cl)
    for p in cl:
        assert (b.mnt / p).read_bytes() == (reference_store / p).read_bytes(), p
    assert mmap_crc(b.mnt / cl[0]) == zlib.crc32((reference_store / cl[0]).read_bytes())
    for m in (a, b):
        r = m.cli("fsck", m.mnt)
        assert r.returncode == 0, r.stdout + r.stderr

    # fsck: a marker of A on an object no row of A names is found, and (offline) repaired; B's objects it marks
    # are no orphans of A
    stale = next(iter(markers_of(store, shared, b))).rsplit("/", 1)[0] + "/" + sid_of(a)
    put_object(store, stale)
    code, rep, _ = fsck(a.mnt)
    assert code == 1 and kinds(rep) == {"stale_marker": 1} and rep["findings"][0]["key"] == stale, rep["findings"]
    a.umount()
    code, rep, _ = fsck(a.hot, "--repair")
    assert rep["repaired"] == 1 and stale not in store.listing(), rep["findings"]
    a.remount()
    code, rep, _ = fsck(a.mnt)
    assert code == 0, rep["findings"]

    # retention on both: every segment goes on both mounts, and nothing of the group is left
    for m in (a, b):
        for p in tiered[m]:
            if (m.mnt / p).exists():
                os.unlink(m.mnt / p)
    wait_for(lambda: pending_deletes(a) == 0 and pending_deletes(b) == 0 and not store.group("cas")
             and not store.group("refs") and not store.group("tomb"), timeout=90,
             what="the group's objects, markers and tombs deleted")
    assert not store.payload(), sorted(store.payload())[:8]
    assert a.alive() and b.alive()


@pytest.mark.parametrize("backend", ["posix", "s3"])
@pytest.mark.parametrize("point", ["tombstoned", "decided"])
def test_an_upload_during_a_shared_delete_keeps_its_bytes(request, tmp_path, mount_store, reference_store,
                                                          backend, point):
    """The race: A lets go of a shared chunk no other mount marks and puts its tombstone; a failpoint holds it
    either before it lists the markers again (tombstoned) or after it found none, before it deletes (decided).
    Meanwhile B uploads the same bytes: it marks them, finds the tombstone and waits for it to go. tombstoned:
    A's re-list sees B's marker and keeps the object. decided: A deletes the object, then its tombstone, and only
    then B puts the bytes again. Either way B commits a chunk that is stored and reads back after eviction."""
    opts, store = group_opts(request, tmp_path, backend, f"group-race-{point}")
    a = mount_store(options=[opts], env={"TIERFS_FAILPOINTS": f"sharedrefs.{point}=sleep:25"})
    b = mount_store(options=[opts])
    copy_in(reference_store, a.mnt)
    tiered = sealed_tiered(a, reference_store)
    first = next(p for p in tiered if p.startswith("commitlog/"))
    keys = named_keys(a, [first])
    os.unlink(a.mnt / first)
    wait_for(lambda: f"failpoint sharedrefs.{point}: holding" in a.log_text(), timeout=60,
             what="A holding inside its delete decision")
    assert store.group("tomb") and not markers_of(store, keys, a)

    copy_in(reference_store, b.mnt)
    wait_for(lambda: "a delete of this shared object is being decided" in b.log_text(), timeout=60,
             what="B's upload waiting on A's tombstone")
    assert f"failpoint sharedrefs.{point}: held" not in a.log_text(), "B came after A decided: no race tested"
    sealed_tiered(b, reference_store)
    assert named_keys(b, [first]) == keys
    wait_for(lambda: pending_deletes(a) == 0 and not store.group("tomb"), timeout=60, what="A's delete decided")
    if point == "tombstoned":
        assert "another mount marked it while its delete was decided; kept" in a.log_text(), a.log_tail()
    else:
        assert re.search(r"deleted \d+ shared objects of group", a.log_text()), a.log_tail()
    assert keys <= set(store.listing()), "a chunk B committed was deleted"
    assert markers_of(store, keys, b) and not markers_of(store, keys, a)
    evict_all(b, [first])
    assert (b.mnt / first).read_bytes() == (reference_store / first).read_bytes()
    r = b.cli("fsck", b.mnt)
    assert r.returncode == 0, r.stdout + r.stderr


def test_shared_refs_protocol_on_a_real_store(tmp_path):
    """tierfs.tier.sharedrefs alone, on a posix object store: the last mount's release deletes the object, its
    markers and tombs; a release while another mount marks it keeps it; a tomb whose deleter died is waited out
    and removed, and the upload then puts the object again."""
    from tierfs.objectstore import open_store
    from tierfs.tier.sharedrefs import SharedRefs

    with open_store(f"file://{tmp_path / 'bucket'}") as store:
        a, b = (SharedRefs(store, sid, GROUP, 0.0, sleep=lambda s: None) for sid in ("sid-a", "sid-b"))
        key = a.key("ab" * 32)
        assert a.acquire(key) is False  # missing: the caller puts it
        store.put(key, b"chunk")
        assert b.acquire(key) is True  # stored, no delete under way
        assert a.release([key]) == [] and store.exists(key)  # B still marks it
        assert b.release([key]) == [key]
        assert [i.key for i in store.list(f"groups/{GROUP}/")] == []

        store.put(key, b"chunk")
        store.put(f"{b.tomb_prefix(key)}sid-dead", b"{}")  # a deleter that died between its tomb and its delete
        b.valid_seconds = 0.0
        assert b.acquire(key) is False and not b.tombs(key)  # waited out, removed: the caller puts it again
        assert b.marked() == {"ab" * 32: {"sid-b"}}
