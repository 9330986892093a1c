"""Per-operation counters and latency histograms for the FUSE front.

Recording sits on the hot path of every request, so it is an increment and one bucket index computed from
`int.bit_length` (log2 buckets with 4 linear sub-buckets: ~19% worst-case error, enough for p50/p99 at a glance).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

_SUB = 4  # linear sub-buckets per power of two
_NBUCKETS = 64 * _SUB


def _bucket(ns: int) -> int:
    if ns < _SUB:
        return max(ns, 0)
    exp = ns.bit_length() - 1
    sub = (ns >> (exp - 2)) & (_SUB - 1) if exp >= 2 else 0
    return exp * _SUB + sub


def _bucket_upper_ns(b: int) -> int:
    exp, sub = divmod(b, _SUB)
    if exp < 2:
        return b
    return (1 << exp) + ((sub + 1) << (exp - 2))


@dataclass
class OpStats:
    count: int = 0
    errors: int = 0
    total_ns: int = 0
    max_ns: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * _NBUCKETS)

    def record(self, ns: int, failed: bool) -> None:
        self.count += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns
        self.buckets[_bucket(ns)] += 1
        if failed:
            self.errors += 1

    def percentile_ns(self, q: float) -> int:
        if not self.count:
            return 0
        target = q * self.count
        seen = 0
        for b, n in enumerate(self.buckets):
            seen += n
            if seen >= target and n:
                return min(_bucket_upper_ns(b), self.max_ns)
        return self.max_ns


class FsStats:
    """Operation counts, bytes moved and latency percentiles since mount."""

    def __init__(self) -> None:
        self.ops: dict[str, OpStats] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.started = time.time()

    def record(self, op: str, ns: int, failed: bool = False) -> None:
        st = self.ops.get(op)
        if st is None:
            st = self.ops[op] = OpStats()
        st.record(ns, failed)

    def as_dict(self) -> dict:
        return {
            "uptime_s": round(time.time() - self.started, 1),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "ops": {
                name: {
                    "count": st.count, "errors": st.errors,
                    "mean_us": round(st.total_ns / st.count / 1000, 1) if st.count else 0,
                    "p50_us": round(st.percentile_ns(0.50) / 1000, 1),
                    "p99_us": round(st.percentile_ns(0.99) / 1000, 1),
                    "max_us": round(st.max_ns / 1000, 1),
                }
                for name, st in sorted(self.ops.items())
            },
        }

    def render(self) -> str:
        d = self.as_dict()
        lines = [f"uptime_s {d['uptime_s']}", f"bytes_read {d['bytes_read']}", f"bytes_written {d['bytes_written']}",
                 "", f"{'op':<12}{'count':>12}{'errors':>8}{'mean_us':>10}{'p50_us':>10}{'p99_us':>10}{'max_us':>12}"]
        for name, s in d["ops"].items():
            lines.append(f"{name:<12}{s['count']:>12}{s['errors']:>8}{s['mean_us']:>10}{s['p50_us']:>10}"
                         f"{s['p99_us']:>10}{s['max_us']:>12}")
        return "\n".join(lines) + "\n"
