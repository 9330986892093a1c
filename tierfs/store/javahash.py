"""Java ``String.hashCode`` and the two RocketMQ hashes built on it.

The broker stores these hashes on disk (index items, ConsumeQueue tag codes), so
they must match Java bit for bit: the hash runs over UTF-16 code units (a non-BMP
character contributes its two surrogates) in wrapping signed 32-bit arithmetic.
"""

from __future__ import annotations

import sys
from operator import mul

__all__ = ["java_string_hash", "index_key_hash", "index_hash_of", "tags_hash_code", "to_int32"]

_MASK32 = 0xFFFFFFFF
_INT_MIN = -(1 << 31)

# _POW[k] = 31**k mod 2**32. The hash of code units u0..u(n-1) folded onto a start value h0 is
# h0*31**n + sum(u_i * 31**(n-1-i)); evaluating it as one sum of products keeps the per-character
# work inside C (map/sum) instead of a Python loop, which matters on the producer's hot path.
_POW: list[int] = [1]
_REV: dict[int, tuple[int, ...]] = {}  # n -> (31**(n-1), ..., 31**0) mod 2**32, cached for short n
_REV_CACHE_MAX = 512
_UTF16 = "utf-16-le" if sys.byteorder == "little" else "utf-16-be"


def _rev_powers(n: int) -> tuple[int, ...]:
    while len(_POW) <= n:
        _POW.append((_POW[-1] * 31) & _MASK32)
    rev = tuple(reversed(_POW[:n]))
    if n <= _REV_CACHE_MAX:
        _REV[n] = rev
    return rev


def to_int32(value: int) -> int:
    """Wrap an integer to Java ``int`` (two's complement, 32 bits)."""
    value &= _MASK32
    return value - (1 << 32) if value & 0x80000000 else value


def java_string_hash(s: str, start: int = 0) -> int:
    """``String.hashCode()`` of *s* as a signed 32-bit int.

    *start* continues a hash, so ``java_string_hash(b, java_string_hash(a)) ==
    java_string_hash(a + b)``; the producer uses it to hash ``topic#`` once per topic.
    Lone surrogates are hashed as the code units they are, like Java.
    """
    if s.isascii():
        units: bytes | memoryview = s.encode("ascii")
    else:
        units = memoryview(s.encode(_UTF16, "surrogatepass")).cast("H")
    n = len(units)
    rev = _REV.get(n) or _rev_powers(n)
    total = sum(map(mul, units, rev))
    if start:
        total += (start & _MASK32) * _POW[n]
    total &= _MASK32
    return total - 0x100000000 if total & 0x80000000 else total


def index_hash_of(h: int) -> int:
    """Turn a signed ``hashCode`` into the index key hash: ``Math.abs``, then ``Integer.MIN_VALUE`` becomes 0.

    ``Math.abs(Integer.MIN_VALUE)`` stays negative in Java; ``IndexFile.indexKeyHashMethod`` then uses 0.
    """
    if h == _INT_MIN:
        return 0
    return -h if h < 0 else h


def index_key_hash(key: str) -> int:
    """Hash used for index slots and items (``IndexFile.indexKeyHashMethod``) of a ``topic#key`` string."""
    return index_hash_of(java_string_hash(key))


def tags_hash_code(tags: str | None) -> int:
    """ConsumeQueue tags code for a plain topic: ``TAGS.hashCode()`` sign-extended to long, 0 without tags."""
    if not tags:
        return 0
    return java_string_hash(tags)
