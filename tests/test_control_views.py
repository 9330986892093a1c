"""The control dir's segment views (status, status.json, segments) are made off the trio loop from a copy taken on
it (tierfs.fs.views, bench/control_render.py for what that saves): they still list every segment once, sorted,
with the state, size, generation and objects the engine has, and agree with each other."""

from __future__ import annotations

import json

from mountutil import wait_for
from test_status_statfs import KIND_COUNTS, table
from test_tiering import TIER_OPTS, copy_in, reference_store, segments, wait_tiered_and_evicted  # noqa: F401


def test_views_list_every_segment_once_and_agree(mount_store, reference_store):
    m = mount_store(options=[TIER_OPTS])
    copy_in(reference_store, m.mnt)
    sealable = sum(KIND_COUNTS.values()) - 2  # all but the active CommitLog and IndexFile
    wait_for(lambda: len(m.status()["files"]) >= sealable, timeout=60, what="segments sealed")
    wait_tiered_and_evicted(m, [f["path"] for f in m.status()["files"]])

    doc = json.loads((m.ctl / "status.json").read_text())
    seg_lines = (m.ctl / "segments").read_text().splitlines()
    text = (m.ctl / "status").read_text()

    files, hot = doc["files"], doc["hot_segments"]
    assert [f["path"] for f in files] == sorted(f["path"] for f in files)
    assert [f["path"] for f in hot] == sorted(f["path"] for f in hot)
    rowless = [f for f in hot if "file_id" not in f]  # the active segments: never sealed, no catalog row
    listed = [f["path"] for f in files] + [f["path"] for f in rowless]
    assert sorted(listed) == sorted(segments(reference_store)), "every segment exactly once"
    assert len(rowless) == 2 and all(f["not_sealed"] for f in rowless), rowless
    for f in files:
        assert f["state"] == "tiered" and f["objects"] and f["generation"] >= 1, f
        assert 0 <= f["resident_bytes"] <= f["size"], f
    assert any(f["resident_bytes"] < f["size"] for f in files)
    assert len({f["file_id"] for f in files}) == len(files)

    # segments: the same records, one line each, in path order
    by_path = {f["path"]: f for f in files + rowless}
    assert seg_lines[0].split()[:3] == ["path", "kind", "state"]
    assert [ln.split()[0] for ln in seg_lines[1:]] == sorted(by_path)
    for ln in seg_lines[1:]:
        path, kind, state, gen = ln.split()[:4]
        f = by_path[path]
        assert (kind, state) == (f["kind"], f["state"]), ln
        assert gen == str(f.get("generation", "-")), ln
        assert (f"{len(f['objects'])}: {f['objects'][0]} .." in ln) if f.get("objects") else "not sealed:" in ln

    # totals (json) and the status table agree with the records
    per_kind = doc["totals"]["per_kind"]
    for kind, n in KIND_COUNTS.items():
        mine = [f for f in files + rowless if f["kind"] == kind]
        assert per_kind[kind]["files"] == len(mine) == n
        assert per_kind[kind]["tiered"] == sum(f["state"] == "tiered" for f in mine)
        assert per_kind[kind]["bytes"] == sum(f["size"] for f in mine)
        assert per_kind[kind]["bytes_remote"] == sum(f["size"] for f in mine if f["state"] == "tiered")
        assert per_kind[kind]["bytes_local"] == sum(f["resident_bytes"] for f in mine)
    assert {k: int(v["files"]) for k, v in table(text).items()} == KIND_COUNTS, text
    assert doc["totals"]["cache_bytes"] == sum(f["resident_bytes"] for f in files)
