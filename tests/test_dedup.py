"""A broker group's replicas under one mount are stored once (issue 29): a slave's sealed CommitLog segments are
byte-identical to its master's, and with two store roots the mount (upload.dedup=auto) stores their chunks
content-addressed, so the bytes go to the object store once. Retention on one replica (unlink) keeps the other's
bytes readable; once both are gone, nothing is left. Real mounts, the example producer's store copied in as two
store roots, the posix object store and Ceph RGW."""

from __future__ import annotations

import json
import mmap
import os
import re
import sqlite3
import zlib
from pathlib import Path

import pytest

from mountutil import wait_for
from test_tiering import TIER_OPTS, by_path, copy_in, s3_opts, status
from test_tiering import reference_store  # noqa: F401 (a fixture)

ROOTS = ("master", "slave")
CAS = "/cas/"
SEGMENT = re.compile(r"^(stores/)?[^/]+/(seg|cas)/")


class Objects:
    """The segment objects the mount's object store holds (seg/ and cas/; not the append objects of active files
    nor catalog snapshots): key -> size, from the posix store's directory or an RGW bucket."""

    def __init__(self, m, rgw=None, bucket: str = ""):
        self.m, self.rgw, self.bucket = m, rgw, bucket

    def listing(self) -> dict[str, int]:
        if self.rgw is None:
            root = self.m.state_dir / "objects"
            return {k: p.stat().st_size for p in root.rglob("*") if p.is_file() and SEGMENT.search(
                k := str(p.relative_to(root)))}
        c, out, token = self.rgw.client(), {}, None
        while True:
            kw = {"ContinuationToken": token} if token else {}
            r = c.list_objects_v2(Bucket=self.bucket, Prefix="stores/", **kw)
            out.update({o["Key"][len("stores/"):]: o["Size"] for o in r.get("Contents", [])
                        if SEGMENT.search(o["Key"])})
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]


def named_keys(m, paths: list[str]) -> set[str]:
    """Every object the catalog rows of `paths` name: chunks and verification tables (read-only catalog read)."""
    db = sqlite3.connect(f"file:{m.state_dir / 'catalog.db'}?mode=ro", uri=True, timeout=30)
    try:
        rows = db.execute(f"SELECT objects, unit_ref FROM files WHERE path IN ({','.join('?' * len(paths))})",
                          paths).fetchall()
    finally:
        db.close()
    return {k for objs, ref in rows for k in json.loads(objs)} | {ref.split(":", 2)[2] for _, ref in rows if ref}


def pending_deletes(m) -> int:
    db = sqlite3.connect(f"file:{m.state_dir / 'catalog.db'}?mode=ro", uri=True, timeout=30)
    try:
        return db.execute("SELECT count(*) FROM pending_deletes").fetchone()[0]
    finally:
        db.close()


def evict_all(m, paths: list[str]) -> None:
    def done() -> bool:  # a segment read in the last second is left alone: then ask again
        r = m.cli("evict", m.mnt)
        assert r.returncode == 0, r.stderr
        return all(by_path(m)[p]["resident_bytes"] == 0 for p in paths)
    wait_for(done, timeout=60, interval=0.5, what="the segments evicted")


def mmap_crc(path: Path) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        return zlib.crc32(mm)


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_replicas_under_one_mount_are_stored_once(request, mount_store, reference_store, backend):
    opts = TIER_OPTS.replace("cache.max_bytes=2MiB", "cache.max_bytes=1GiB")  # evicted on request, below
    rgw = None
    if backend == "s3":
        rgw = request.getfixturevalue("rgw")
        opts = s3_opts(rgw, "dedup-replicas").replace("cache.max_bytes=2MiB", "cache.max_bytes=1GiB")
    m = mount_store(options=[opts])
    store = Objects(m, rgw, "dedup-replicas")
    for root in ROOTS:
        (m.mnt / root).mkdir()
        copy_in(reference_store, m.mnt / root)
    commitlogs = sorted(p.name for p in (reference_store / "commitlog").iterdir())[:-1]  # the last is active
    assert len(commitlogs) >= 3, commitlogs
    cl = {root: [f"{root}/commitlog/{n}" for n in commitlogs] for root in ROOTS}

    def tiered() -> dict[str, list[str]]:
        files = by_path(m)
        return {root: sorted(p for p, f in files.items() if p.startswith(f"{root}/") and f["state"] == "tiered")
                for root in ROOTS}

    def settled() -> bool:  # every sealed CommitLog segment tiered, and the same segments of both replicas
        t = tiered()
        return set(cl["master"] + cl["slave"]) <= set(t["master"] + t["slave"]) and \
            [p.split("/", 1)[1] for p in t["master"]] == [p.split("/", 1)[1] for p in t["slave"]] and \
            status(m)["totals"]["upload_backlog_files"] == 0
    wait_for(settled, timeout=120, what="both replicas' sealed segments tiered")
    tiered = tiered()

    # stored once: every object of the bucket against the objects the master's rows alone name
    objects = store.listing()
    master = named_keys(m, tiered["master"])
    alone = sum(objects[k] for k in master)
    ratio = sum(objects.values()) / alone
    print(f"stored bytes master+slave / master alone = {ratio:.3f} ({sum(objects.values())} / {alone} bytes; "
          f"{backend})")
    assert ratio <= 1.05, (ratio, sorted(objects)[:8])
    cl_keys = named_keys(m, cl["master"])
    assert cl_keys == named_keys(m, cl["slave"]) and all(CAS in k for k in cl_keys), sorted(cl_keys)[:4]
    assert status(m)["totals"]["engine"]["upload_dedup_bytes"] >= sum(objects[k] for k in cl_keys if "/units" not in k)

    # both read back exactly once evicted (cat after dropping the page cache; mmap)
    evict_all(m, cl["master"] + cl["slave"])
    for root in ROOTS:
        for p in cl[root]:
            rel = p.split("/", 1)[1]
            assert (m.mnt / p).read_bytes() == (reference_store / rel).read_bytes(), p
        assert mmap_crc(m.mnt / cl[root][1]) == zlib.crc32((reference_store / "commitlog" / commitlogs[1])
                                                            .read_bytes())

    # retention on the master: its CommitLog segments and a ConsumeQueue file go (their bytes are the slave's too)
    own = next(p for p in tiered["master"] if "/consumequeue/" in p)
    gone = cl["master"] + [own]
    shared = named_keys(m, gone)
    assert shared == named_keys(m, [p.replace("master/", "slave/", 1) for p in gone])
    for p in gone:
        os.unlink(m.mnt / p)
    wait_for(lambda: pending_deletes(m) == 0, timeout=60, what="the janitor's pass over the master's deletes")
    assert shared <= set(store.listing()), "an object the slave's rows name was deleted"
    evict_all(m, cl["slave"])
    for p in cl["slave"]:
        assert (m.mnt / p).read_bytes() == (reference_store / p.split("/", 1)[1]).read_bytes(), p
    assert mmap_crc(m.mnt / cl["slave"][0]) == zlib.crc32((reference_store / "commitlog" / commitlogs[0])
                                                           .read_bytes())

    # the slave's retention too: the last rows naming them are gone, and so are they; nothing else is left over
    for p in gone:
        os.unlink(m.mnt / p.replace("master/", "slave/", 1))
    wait_for(lambda: pending_deletes(m) == 0 and not shared & set(store.listing()), timeout=60,
             what="the shared objects deleted once no row names them")
    left = [p for root in ROOTS for p in tiered[root] if (m.mnt / p).exists()]
    assert set(store.listing()) == named_keys(m, left), "objects no row names were left over"
    r = m.cli("fsck", m.mnt)
    assert r.returncode == 0, r.stdout + r.stderr
    assert m.alive()


def test_a_shared_object_goes_only_with_the_last_row_naming_it(tmp_path):
    """The authority's side, on a real catalog: two rows naming one content-addressed chunk (and table); the
    queued delete of one row's retention is dropped while the other names them; a compaction swap releases them
    only through the authority; an upload's hold says they are stored; an older catalog gets the key -> rows
    relation on open."""
    import hashlib
    import time

    from tierfs.tier import layout
    from tierfs.tier.catalog import Catalog, Entry, State
    from tierfs.tier.references import References

    chunk = layout.cas_key("sid", hashlib.sha256(b"chunk").hexdigest())
    table = layout.cas_key("sid", hashlib.sha256(b"table").hexdigest())

    def row(root: str, fid: int) -> Entry:
        return Entry(path=f"{root}/commitlog/00000000000000000000", kind="commitlog", size=4096, mtime_ns=1,
                     state=State.TIERED, generation=fid, chunk_bytes=4096, block_bytes=4096, objects=[chunk],
                     unit_bytes=512, unit_ref=f"00000000:32:{table}", file_id=fid)

    cat = Catalog(tmp_path / "catalog.db")
    refs = References(cat, snapshots=False)
    master, slave = row("master", 1), row("slave", 2)
    cat.put_many([master, slave], [], 0.0)
    assert refs.hold_content("upload:3", chunk) and cat.release_refs("upload:3", 0.0) == 1  # stored: no PUT
    cat.remove(master, master.all_objects(), 0.0)  # the master's retention
    assert refs.claim(time.time()) == [] and cat.pending_delete_count() == 0  # the slave's row names both

    cat.close()  # a catalog of the version before the relation: rebuilt from the rows on open
    db = sqlite3.connect(tmp_path / "catalog.db")
    db.execute("DELETE FROM cas_refs")
    db.execute("DELETE FROM meta WHERE k='cas_refs'")
    db.commit()
    db.close()
    cat = Catalog(tmp_path / "catalog.db")
    refs = References(cat, snapshots=False)
    cat.queue_deletes([chunk, table], 0.0)
    assert refs.claim(time.time()) == []

    lz4c = slave.copy(format="lz4c", objects=["sid/seg/slave/commitlog/00000000000000000000/2.lz4c"],
                      unit_bytes=0, unit_ref="")
    assert cat.swap(lz4c, slave.all_objects(), 0.0)  # compacted: the raw objects are the authority's to free
    assert sorted(refs.claim(time.time())) == sorted([chunk, table])
    cat.close()


def test_a_lost_shared_object_is_put_again_by_the_next_upload_of_its_bytes(mount_store, reference_store):
    """upload.dedup=on: a chunk object a row names is lost (deleted behind the mount's back); the next upload of
    the same bytes finds it named, checks it as it checks its own PUTs, finds it missing and puts it again, so
    the first row's segment reads back again too."""
    m = mount_store(options=[TIER_OPTS.replace("cache.max_bytes=2MiB", "cache.max_bytes=1GiB")
                             + ",upload.dedup=on"])
    copy_in(reference_store, m.mnt)
    first = "commitlog/" + sorted(p.name for p in (reference_store / "commitlog").iterdir())[0]
    wait_for(lambda: by_path(m).get(first, {}).get("state") == "tiered", timeout=60, what="tiered")
    keys = by_path(m)[first]["objects"]
    assert all(CAS in k for k in keys), keys
    (m.state_dir / "objects" / keys[1]).unlink()  # lost
    (m.mnt / "again").mkdir()
    copy_in(reference_store, m.mnt / "again")
    wait_for(lambda: by_path(m).get(f"again/{first}", {}).get("state") == "tiered", timeout=60,
             what="the second copy tiered")
    assert by_path(m)[f"again/{first}"]["objects"] == keys
    assert f"content-addressed object {keys[1]}, which a row names, is missing" in m.log_text(), m.log_tail()
    evict_all(m, [first])
    assert (m.mnt / first).read_bytes() == (reference_store / first).read_bytes()


def test_compacting_both_replicas_releases_their_shared_raw_objects(mount_store, reference_store):
    """A compaction job (a real Spark session) rewrites both replicas' tiered CommitLog segments as lz4c objects
    of their own; each swap queues the shared raw chunks, which the authority deletes only once no row names them:
    after both swaps, none is left, and both replicas read back from their lz4c objects."""
    import subprocess
    import sys

    m = mount_store(options=[TIER_OPTS.replace("cache.max_bytes=2MiB", "cache.max_bytes=1GiB")
                             + ",compaction.enabled=false,spark.master=local[1]"])
    for root in ROOTS:
        (m.mnt / root).mkdir()
        copy_in(reference_store, m.mnt / root)
    name = sorted(p.name for p in (reference_store / "commitlog").iterdir())[0]
    cl = [f"{root}/commitlog/{name}" for root in ROOTS]
    wait_for(lambda: all(by_path(m).get(p, {}).get("state") == "tiered" for p in cl), timeout=120, what="tiered")
    raw = named_keys(m, cl)
    assert raw == named_keys(m, cl[:1]) and all(CAS in k for k in raw), sorted(raw)[:4]
    r = subprocess.run([sys.executable, "-m", "tierfs", "compact", str(m.mnt), "--json", "--only", "segments"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wait_for(lambda: all(by_path(m)[p]["format"] == "lz4c" for p in cl), timeout=60, what="both rows compacted")
    lz4c = named_keys(m, cl)
    assert len(lz4c) == 2 and not lz4c & raw, lz4c
    wait_for(lambda: pending_deletes(m) == 0 and not raw & set(Objects(m).listing()), timeout=60,
             what="the raw objects no row names any more deleted")
    evict_all(m, cl)
    for p in cl:
        assert (m.mnt / p).read_bytes() == (reference_store / "commitlog" / name).read_bytes(), p
