"""The lean ranged GET of S3ObjectStore (tierfs/objectstore/s3get.py) against the real Ceph RGW, directly and
through the fault proxy: it must be the path get_range / get_range_into take, and answer every failure with the
exception the boto3 path gives (the block cache and fsck branch on those types), retrying what is transient.
"""

from __future__ import annotations

import random
import uuid

import pytest

from ceph_rgw import rgw  # noqa: F401  (session fixture)
from test_datapath import store_4mib  # noqa: F401  (module fixture: a store with 4 MiB CommitLog segments)
from tierfs.objectstore import ObjectStoreError, ObjectStoreUnavailable, open_store, s3get

BUCKET = "tierfs-lean-get"
DATA = random.Random(13).randbytes(3 * (1 << 20) + 123)


@pytest.fixture(scope="module")
def lean_bucket(rgw):  # noqa: F811
    rgw.make_bucket(BUCKET)
    s = open_store(f"s3://{BUCKET}/lean", endpoint_url=rgw.endpoint_url, access_key=rgw.access_key,
                   secret_key=rgw.secret_key)
    s.put("obj", DATA)
    s.close()
    return BUCKET


def make(endpoint: str, rgw, prefix: str = "lean", **kw):  # noqa: F811
    opts = dict(endpoint_url=endpoint, access_key=rgw.access_key, secret_key=rgw.secret_key, max_attempts=3,
                connect_timeout=2, read_timeout=10)
    opts.update(kw)
    return open_store(f"s3://{BUCKET}/{prefix}", **opts)


def no_boto_get(store, monkeypatch) -> None:
    """Reads must not go through botocore's GetObject any more."""
    assert store._lean is not None
    monkeypatch.setattr(store._client, "get_object", lambda **_: pytest.fail("ranged GET went through boto3"))


def outcome(call) -> tuple[str, object]:
    try:
        return "ok", call()
    except ObjectStoreError as e:
        assert "X-Amz-Signature" not in str(e) and "X-Amz-Credential" not in str(e), str(e)
        return type(e).__name__, getattr(e, "size", None)


def test_lean_get_answers_as_boto3_does(rgw, lean_bucket, monkeypatch):  # noqa: F811
    """Content, a missing object, a range past the end, refused credentials and a missing bucket: the lean path
    gives what the boto3 path gives, and the presigned URL's signature never shows in a message. Fails on main
    (5a3c12a): there get_range is a boto3 GetObject."""
    good = make(rgw.endpoint_url, rgw)
    bad_key = make(rgw.endpoint_url, rgw, secret_key="not-the-secret")
    no_bucket = open_store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", endpoint_url=rgw.endpoint_url,
                           access_key=rgw.access_key, secret_key=rgw.secret_key, max_attempts=2)
    bufs = [memoryview(bytearray(n)) for n in (1 << 20, 5, 1 << 20)]

    def into(store, start):
        store.get_range_into("obj", start, bufs)
        return b"".join(bytes(b) for b in bufs)

    cases = {
        "range": lambda s: s.get_range("obj", 1000, 70000),
        "into": lambda s: into(s, 777),
        "missing": lambda s: s.get_range("nothing/here", 0, 10),
        "missing into": lambda s: s.get_range_into("nothing/here", 0, bufs),
        "past end": lambda s: s.get_range("obj", len(DATA) - 10, 11),
        "past end into": lambda s: s.get_range_into("obj", len(DATA) - 10, [memoryview(bytearray(20))]),
        "start past end": lambda s: s.get_range("obj", len(DATA) + 5, 1),
    }
    try:
        boto = {}
        for s in (good, bad_key, no_bucket):
            lean, s._lean = s._lean, None
            boto[id(s)] = {name: outcome(lambda: call(s)) for name, call in cases.items()}
            s._lean = lean
            no_boto_get(s, monkeypatch)
        for s in (good, bad_key, no_bucket):
            lean = {name: outcome(lambda: call(s)) for name, call in cases.items()}
            assert lean == boto[id(s)], s
        assert boto[id(good)]["range"] == ("ok", DATA[1000:71000])
        assert boto[id(good)]["into"] == ("ok", DATA[777:777 + 2 * (1 << 20) + 5])
        assert boto[id(good)]["missing"][0] == "ObjectNotFound"
        assert boto[id(good)]["past end"] == ("ObjectRangeError", len(DATA))
        assert {o[0] for o in boto[id(bad_key)].values()} == {"ObjectStoreError"}
        # a 206 of the asked length is read in one copy, never whole first and cut
        monkeypatch.setattr(s3get.Answer, "read_all", lambda *_: pytest.fail("plain answer read whole"))
        assert cases["range"](good) == DATA[1000:71000] and cases["into"](good) == boto[id(good)]["into"][1]
        with pytest.raises(ObjectStoreError, match="refused"):
            bad_key.get_range("obj", 0, 1)
        with pytest.raises(ObjectStoreError, match="does not exist"):
            no_bucket.get_range("obj", 0, 1)
    finally:
        for s in (good, bad_key, no_bucket):
            s.close()


def test_lean_get_retries_transient_faults_only(rgw, lean_bucket, fault_proxy, monkeypatch):  # noqa: F811
    """Through the fault proxy, max_attempts=3: a burst of 5xx, a truncated body or a reset shorter than the
    attempts is hidden by a retry; a lasting one ends as ObjectStoreUnavailable after exactly 3 requests, with
    no signature in its message."""
    s = make(fault_proxy.endpoint_url, rgw)
    no_boto_get(s, monkeypatch)
    want = DATA[4096:4096 + 2 * (1 << 20)]
    bufs = [memoryview(bytearray(1 << 20)) for _ in range(2)]

    def into():
        for b in bufs:
            b[:] = b"\0" * len(b)
        s.get_range_into("obj", 4096, bufs)
        return b"".join(bytes(b) for b in bufs)

    faults = [("error", dict(status=503, code="SlowDown")), ("error", dict(status=500, code="InternalError")),
              ("truncate", dict(fraction=0.5)), ("reset", dict(phase="response")), ("reset", dict(phase="request"))]
    try:
        for mode, kw in faults:
            for count, call in ((2, into), (2, lambda: s.get_range("obj", 4096, len(want)))):
                fault_proxy.set(mode, methods=["GET"], count=count, **kw)
                assert call() == want, (mode, kw)
            before = fault_proxy.stats()["requests"]
            fault_proxy.set(mode, methods=["GET"], **kw)
            kind, _ = outcome(into)
            fault_proxy.passthrough()
            assert kind == "ObjectStoreUnavailable", (mode, kw, kind)
            assert fault_proxy.stats()["requests"] - before == 3, (mode, kw)
        assert into() == want  # the pool's connections still work after the resets
        with pytest.raises(ObjectStoreUnavailable, match="lean/obj"):
            fault_proxy.set("error", methods=["GET"], status=503, code="SlowDown")
            s.get_range("obj", 0, 10)
    finally:
        fault_proxy.passthrough()
        s.close()


def test_lean_get_network_errors_name_no_signature(rgw, lean_bucket):  # noqa: F811
    """A refused connection: ObjectStoreUnavailable naming the object, not the presigned URL's query. (And
    retry_mode=adaptive keeps boto3's GetObject: its rate limiting lives in botocore's retry handler.)"""
    from ceph_rgw import free_port

    adaptive = make(rgw.endpoint_url, rgw, retry_mode="adaptive")
    try:
        assert adaptive._lean is None and adaptive.get_range("obj", 5, 10) == DATA[5:15]
    finally:
        adaptive.close()
    s = make(f"http://127.0.0.1:{free_port()}", rgw, max_attempts=2, connect_timeout=1)
    try:
        assert s._lean is not None
        with pytest.raises(ObjectStoreUnavailable, match="lean/obj") as ei:
            s.get_range("obj", 0, 10)
        text = f"{ei.value} {ei.value.cause!r}"
        assert "X-Amz-" not in text and "127.0.0.1" in text, text
    finally:
        s.close()


def test_lean_get_into_resumes_after_the_buffers_it_reported(rgw, lean_bucket, fault_proxy):  # noqa: F811
    """get_range_into reports each buffer as it fills (the block cache answers waiting reads from it at once),
    so a retry after a truncated or reset body must not write those buffers again: it asks for the rest only.
    Fails on 083a9cb (no progress reports; a retry fetched everything again)."""
    s = make(fault_proxy.endpoint_url, rgw)
    MiB = 1 << 20
    big = random.Random(8).randbytes(8 * MiB)
    try:
        s.put("big", big)
        for mode, kw in (("truncate", dict(fraction=0.6)), ("reset", dict(phase="response"))):
            bufs = [memoryview(bytearray(MiB)) for _ in range(8)]
            calls: list[int] = []
            before = fault_proxy.stats()["bytes_down"]
            fault_proxy.set(mode, methods=["GET"], count=1, **kw)
            s.get_range_into("big", 0, bufs, calls.append)
            down = fault_proxy.stats()["bytes_down"] - before
            assert b"".join(bytes(b) for b in bufs) == big, mode
            assert calls == list(range(1, 9)), (mode, calls)
            if mode == "truncate":  # the first 4.8 MiB all arrive: the retry asks for 4 MiB, not 8 again
                assert down < 10.5 * MiB, (mode, down)  # fetched again from the start: 12.8 MiB
            # (after a RST the client gets a share of the 4 MiB sent that depends on timing, so only the bytes
            # and the reports are checked there)
    finally:
        fault_proxy.passthrough()
        s.close()


def test_a_waiting_read_is_answered_before_its_get_ends(mount_store, store_4mib, rgw, fault_proxy):  # noqa: F811
    """A sequential reader that catches up with a read-ahead GET gets each block as it arrives, not when the
    whole GET has: with every GET body over 3 blocks held after 3 (fault proxy `pause`), the reads of the blocks
    that came in are answered while the GET is still held. Fails on 1bbdc34: they wait for the whole GET and
    end in EIO after objectstore.read_timeout_seconds."""
    import json
    import os

    from mountutil import evict, wait_for

    rgw.make_bucket("tierfs-early-land")
    block, seg = 64 << 10, "commitlog/00000000000000000000"
    m = mount_store(options=[
        "tiering.enabled=true,cache.max_bytes=64KiB,cache.block_bytes=64KiB,objectstore.chunk_bytes=1MiB,"
        "seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5,broker.max_hash_slot_num=500,"
        "broker.max_index_num=2000,delete.grace_seconds=0,compaction.enabled=false,"
        f"objectstore.url=s3://tierfs-early-land/stores,objectstore.endpoint_url={fault_proxy.endpoint_url},"
        f"objectstore.access_key_id={rgw.access_key},objectstore.secret_access_key={rgw.secret_key},"
        "objectstore.addressing=path,objectstore.read_timeout_seconds=3,objectstore.max_attempts=2"])
    ref = (store_4mib / seg).read_bytes()
    (m.mnt / "commitlog").mkdir(exist_ok=True)
    (m.mnt / seg).write_bytes(ref)

    def evicted() -> bool:
        files = {f["path"]: f for f in json.loads((m.ctl / "status.json").read_text())["files"]}
        f = files.get(seg, {})
        return f.get("state") == "tiered" and f.get("resident_bytes", 1 << 30) <= 8192
    wait_for(evicted, timeout=60, what=f"{seg} tiered and evicted")
    evict(m.mnt / seg)

    fault_proxy.set("pause", methods=["GET"], pause_after=3 * block)
    try:
        fd = os.open(m.mnt / seg, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # the kernel asks for what is read, no more
            for b in range(4):  # block 0 comes alone; the read-ahead GET behind it is held after its 3rd block
                assert os.pread(fd, block, b * block) == ref[b * block:(b + 1) * block], b
            st = fault_proxy.stats()
            assert st["faults"]["pause"] >= 1 and st["active"] >= 1, st  # that GET is still held
        finally:
            os.close(fd)
    finally:
        fault_proxy.passthrough()
    evict(m.mnt / seg)
    assert (m.mnt / seg).read_bytes() == ref
    assert m.alive()
