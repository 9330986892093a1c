"""A thread-safe token bucket for the upload bandwidth cap (`upload.bandwidth_bytes_per_second`).

One bucket is shared by every uploader thread of a daemon, whatever the backend, so the cap holds for the sum of
concurrent uploads (tiering must never starve the broker's replication link). Callers reserve before they send:
`acquire(n)` takes n tokens at once (n may exceed the burst, e.g. a whole chunk object) and sleeps until the
balance is back to zero, so reservations made concurrently are served one after another at `rate`. At most
`burst` tokens of idle credit are kept, so over any window of T seconds at most `rate * T + burst` bytes start.

`close()` wakes every waiter with `BandwidthLimiterClosed`: an unmount must not wait out a long reservation.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Callable


class BandwidthLimiterClosed(OSError):
    """The limiter was closed (daemon shutting down) while a caller waited for its turn."""

    def __init__(self) -> None:
        super().__init__(errno.ECANCELED, "upload bandwidth limiter closed (shutting down)")


class TokenBucket:
    """Tokens are bytes; `rate` bytes per second (> 0), at most `burst` bytes of credit (default: 0.1 s worth)."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"token bucket rate must be > 0 bytes per second, not {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else self.rate * 0.1
        if self.burst < 0:
            raise ValueError(f"token bucket burst must be >= 0 bytes, not {burst!r}")
        self._clock = clock
        self._cond = threading.Condition()
        self._tokens = self.burst
        self._stamp = clock()
        self._closed = False
        self.waited_seconds = 0.0  # total time callers spent throttled (for status)

    def acquire(self, n: int) -> float:
        """Reserve `n` bytes and block until the rate allows them to start. Returns the seconds waited."""
        if n <= 0:
            return 0.0
        with self._cond:
            if self._closed:
                raise BandwidthLimiterClosed()
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            deadline = now + max(0.0, -self._tokens / self.rate)
            while True:
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(left)
                if self._closed:
                    raise BandwidthLimiterClosed()
            waited = max(0.0, self._clock() - now)
            self.waited_seconds += waited
            return waited

    def close(self) -> None:
        """Wake every waiter with BandwidthLimiterClosed; later acquire() calls raise it too."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
