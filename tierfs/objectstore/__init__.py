"""Object stores behind one interface (`ObjectStore`): posix (a directory: another disk, NFS, ...) and S3.

    open_store("file:///srv/tier")                                   -> PosixObjectStore
    open_store("s3://bucket/prefix", endpoint_url="http://rgw:7480",
               access_key=..., secret_key=..., multipart_part_size=16 << 20)  -> S3ObjectStore

The interface is synchronous and thread-safe (see `base`); the daemon calls it from worker threads.
Backends are imported lazily, so using the posix store never imports boto3.
"""

from __future__ import annotations

import inspect
import os
import re
import urllib.parse
from typing import Any

import crc32c as _crc32c

from .base import (CRC32C_META, Fenced, MultipartUpload, ObjectInfo, ObjectNotFound, ObjectRangeError, ObjectStore,
                   ObjectStoreError, ObjectStoreUnavailable, format_crc32c, parse_crc32c, validate_key,
                   validate_prefix)

__all__ = [
    "ObjectStore", "ObjectInfo", "MultipartUpload", "ObjectStoreError", "Fenced", "ObjectNotFound", "ObjectRangeError",
    "ObjectStoreUnavailable", "open_store", "crc32c_of", "crc32c_file", "crc32c_fd", "format_crc32c", "parse_crc32c",
    "validate_key", "validate_prefix", "CRC32C_META",
]

URL_KEY = "objectstore.url"
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
_READ_CHUNK = 1 << 20


def crc32c_of(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """crc32c (Castagnoli) of `data`, continuing from `value` (so crc32c_of(b, crc32c_of(a)) == crc of a+b)."""
    return _crc32c.crc32c(data, value)


def crc32c_file(path: str | os.PathLike, offset: int = 0, length: int | None = None,
                chunk_size: int = _READ_CHUNK) -> int:
    """crc32c of bytes [offset, offset+length) of a file (to EOF if length is None), streamed in chunks.

    Raises ValueError if the file ends before offset+length.
    """
    with open(path, "rb", buffering=0) as f:
        return crc32c_fd(f.fileno(), offset, length, chunk_size, name=os.fspath(path))


def crc32c_fd(fd: int, offset: int = 0, length: int | None = None, chunk_size: int = _READ_CHUNK,
              name: str = "") -> int:
    """crc32c_file of an open file: pread through one reused buffer (no allocation, no page faults per chunk).

    Raises ValueError if the file ends before offset+length.
    """
    what = f"crc32c of {name or f'fd {fd}'}"
    if offset < 0 or (length is not None and length < 0):
        raise ValueError(f"{what}: invalid offset={offset} length={length}")
    if length is None:
        length = max(0, os.fstat(fd).st_size - offset)
    crc = 0
    view = memoryview(bytearray(min(chunk_size, length) or 1))
    pos, left = offset, length
    while left > 0:
        n = os.preadv(fd, [view[:min(left, chunk_size)]], pos)
        if n == 0:
            raise ValueError(f"{what}: the file ends at {pos}, before {offset + length} (offset {offset} + "
                             f"length {length})")
        crc = _crc32c.crc32c(view[:n], crc)
        pos += n
        left -= n
    return crc


def _bad_url(url: str, why: str) -> ValueError:
    return ValueError(f"config key '{URL_KEY}': invalid value {url!r}: {why}. Use file:///ABSOLUTE/PATH for a "
                      f"directory or s3://BUCKET[/PREFIX] for S3 (with objectstore endpoint_url for a non-AWS server)")


def _check_options(cls: type, url: str, options: dict[str, Any]) -> None:
    params = inspect.signature(cls.__init__).parameters
    known = [n for n, p in params.items() if n != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"object store {url!r}: unknown option(s) {', '.join(unknown)} for {cls.__name__}; "
                         f"known options: {', '.join(known)}")


def open_store(url: str, endpoint_url: str | None = None, **options: Any) -> ObjectStore:
    """An ObjectStore for `url` (the value of config key objectstore.url).

    * ``file:///ABS/PATH`` -> PosixObjectStore(root=PATH, **options) (options: create, fsync, ...)
    * ``s3://BUCKET/PREFIX`` -> S3ObjectStore(BUCKET, PREFIX, endpoint_url=endpoint_url, **options)

    Raises ValueError naming objectstore.url for a malformed URL (relative path, unknown scheme, missing bucket)
    and naming the option for an unknown option.
    """
    if not isinstance(url, str) or not url.strip():
        raise _bad_url(str(url), "it is empty")
    url = url.strip()
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme.lower()
    if parsed.query or parsed.fragment:
        raise _bad_url(url, "query strings and fragments are not allowed")
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise _bad_url(url, f"file URLs need an absolute path (file:///path); {parsed.netloc!r} looks like a "
                                "relative path or a host name")
        path = urllib.parse.unquote(parsed.path)
        if not path.startswith("/"):
            raise _bad_url(url, "the path must be absolute")
        if endpoint_url:
            raise ValueError(f"config key 'objectstore.endpoint_url' is set ({endpoint_url!r}) but "
                             f"'{URL_KEY}' is a file:// URL; endpoint_url only applies to s3://")
        from .posix import PosixObjectStore

        _check_options(PosixObjectStore, url, options)
        return PosixObjectStore(path, **options)
    if scheme == "s3":
        bucket = parsed.netloc
        if not bucket:
            raise _bad_url(url, "the bucket name is missing (s3://BUCKET/PREFIX)")
        if "@" in bucket or ":" in bucket:
            raise _bad_url(url, "credentials and ports do not belong in the URL; set the endpoint and the "
                                "credentials as separate options")
        if not _BUCKET_RE.match(bucket):
            raise _bad_url(url, f"{bucket!r} is not a valid bucket name")
        prefix = urllib.parse.unquote(parsed.path).strip("/")
        if prefix:
            try:
                validate_key(prefix)
            except ValueError as e:
                raise _bad_url(url, f"bad prefix: {e}") from None
        from .s3 import S3ObjectStore

        _check_options(S3ObjectStore, url, options)
        return S3ObjectStore(bucket, prefix, endpoint_url=endpoint_url, **options)
    if not scheme:
        raise _bad_url(url, "it has no scheme (a bare path is not accepted)")
    raise _bad_url(url, f"unknown scheme {scheme!r} (supported: file, s3)")
