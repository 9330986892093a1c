"""Per-stream sequential detection with an AIMD read-ahead window (DESIGN §7), in the spirit of TCP Tahoe:
grow by a batch on each sequential hit, halve when prefetched blocks expire unread, reset on a random jump.
Pure bookkeeping: the engine decides what to fetch with the window this returns.
"""

from __future__ import annotations


SCAN_START_BYTES = 64 << 10


class ReadAhead:
    __slots__ = ("initial", "batch", "maximum", "window", "next_expected", "tolerance", "prefetched", "streak",
                 "ahead")

    def __init__(self, initial: int = 2, batch: int = 2, maximum: int = 64, tolerance: int = 1 << 20):
        self.initial, self.batch, self.maximum = initial, batch, maximum
        self.window = initial
        self.next_expected: int | None = None
        self.tolerance = tolerance  # kernel read-ahead and mmap faults arrive slightly out of order
        self.prefetched: set[int] = set()
        self.streak = False  # the last read was sequential
        # (generation, block): the engine's read-ahead already asked for every block it wanted below `block`, so
        # the next read need only look past it (None: look from the read on; a jump or a wait forgets it)
        self.ahead: tuple[int, int] | None = None

    def on_read(self, off: int, end: int) -> int:
        """Record a read of [off, end); return how many blocks to keep prefetched beyond `end` (0 = random)."""
        sequential = self.next_expected is not None and abs(off - self.next_expected) <= self.tolerance
        if sequential and end - off < SCAN_START_BYTES and off != self.next_expected and not self.streak:
            # a small read near the last one but not right after it: random reads of a small file land within the
            # tolerance all the time, and each false start would fetch whole blocks ahead. Kernel read-ahead and
            # mmap faults out of order are large reads, or follow a read that was sequential.
            sequential = False
        self.streak = sequential
        if sequential:
            self.window = min(self.window + self.batch, self.maximum)
        elif self.next_expected is not None:
            self.window = self.initial
        if not sequential:
            self.ahead = None
        self.next_expected = max(end, self.next_expected or 0) if sequential else end
        # a large read at offset 0 starts a scan (cat, cp); a small one is a header peek (the broker reads every
        # IndexFile's and segment's first page at start-up) and must not pull a read-ahead window in
        return self.window if sequential or (off == 0 and end - off >= SCAN_START_BYTES) else 0

    def consumed(self, block: int) -> None:
        self.prefetched.discard(block)

    def expired_unread(self, block: int) -> None:
        if block in self.prefetched:
            self.prefetched.discard(block)
            self.window = max(self.initial, self.window // 2)
