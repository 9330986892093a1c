"""The per-stream read-ahead window (tierfs/tier/readahead.py): pure AIMD bookkeeping."""

from tierfs.tier.readahead import SCAN_START_BYTES, ReadAhead

MiB = 1 << 20


def test_window_grows_additively_on_sequential_reads_and_caps():
    ra = ReadAhead(initial=2, batch=2, maximum=8, tolerance=MiB)
    assert ra.on_read(0, MiB) == 2  # a scan from the start
    assert [ra.on_read(i * MiB, (i + 1) * MiB) for i in range(1, 6)] == [4, 6, 8, 8, 8]


def test_window_halves_when_prefetched_blocks_expire_unread():
    ra = ReadAhead(initial=2, batch=2, maximum=16, tolerance=MiB)
    for i in range(6):
        ra.on_read(i * MiB, (i + 1) * MiB)
    ra.prefetched.update({10, 11})
    before = ra.window
    ra.expired_unread(10)
    assert ra.window == before // 2
    ra.expired_unread(99)  # never prefetched: no effect
    assert ra.window == before // 2
    ra.consumed(11)
    ra.expired_unread(11)  # consumed before it expired: no effect
    assert ra.window == before // 2


def test_random_jump_resets_and_small_header_peeks_do_not_prefetch():
    ra = ReadAhead(initial=2, batch=2, maximum=16, tolerance=MiB)
    assert ra.on_read(0, 40) == 0  # the broker peeking at a header
    ra = ReadAhead(initial=2, batch=2, maximum=16, tolerance=MiB)
    assert ra.on_read(0, SCAN_START_BYTES) == 2
    ra.on_read(SCAN_START_BYTES, 2 * SCAN_START_BYTES)
    assert ra.on_read(500 * MiB, 500 * MiB + 4096) == 0  # random
    assert ra.window == 2


def test_small_reads_near_but_not_after_the_last_one_stay_random():
    """Random 4 KiB reads of a small file land within the tolerance of each other all the time; each false start
    fetched whole blocks ahead (a 4 MiB segment: 40 random reads fetched all of it). Contiguous small reads, and
    large reads slightly out of order (kernel read-ahead), are still sequential."""
    ra = ReadAhead(initial=2, batch=2, maximum=16, tolerance=MiB)
    assert [ra.on_read(o, o + 4096) for o in (3 * MiB, 3 * MiB - 40960, 3 * MiB + 200704)] == [0, 0, 0]
    assert ra.on_read(3 * MiB + 204800, 3 * MiB + 208896) == 4  # right after the last one
    assert ra.on_read(3 * MiB + 215040, 3 * MiB + 219136) == 6  # near, following a sequential read
    ra = ReadAhead(initial=2, batch=2, maximum=16, tolerance=MiB)
    ra.on_read(0, 128 << 10)
    assert ra.on_read(384 << 10, 512 << 10) == 4  # a large read out of order


def test_the_read_ahead_horizon_is_forgotten_on_a_jump():
    """`ahead` (how far the engine's read-ahead already asked, so a read looks only past it) survives sequential
    reads and is forgotten by a random jump: blocks below it were never asked for on the new course."""
    ra = ReadAhead(initial=2, batch=2, maximum=16, tolerance=MiB)
    ra.on_read(0, MiB)
    ra.ahead = (7, 16)
    ra.on_read(MiB, 2 * MiB)
    assert ra.ahead == (7, 16)
    assert ra.on_read(500 * MiB, 501 * MiB) == 0
    assert ra.ahead is None
