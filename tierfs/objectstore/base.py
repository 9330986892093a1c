"""The one object-store interface of tierfs, its value types, exceptions and key rules.

Synchronous by design
---------------------
Every method blocks the calling thread until the operation is done (or failed, after the backend's retries). This
keeps one implementation usable from two very different callers:

* the FUSE daemon (trio) never calls a store on its event loop: it goes through
  ``trio.to_thread.run_sync(store.get_range, key, off, n, limiter=objectstore_limiter)`` behind one
  ``trio.CapacityLimiter`` sized to the store's connection pool, so the number of requests in flight is bounded
  and the FUSE loop never blocks on the network;
* Spark executors and command-line tools call the same methods directly.

Implementations are thread-safe: one instance is shared by all worker threads (the S3 backend reuses one botocore
client and its connection pool). Instances can be pickled (Spark ships them to executors); the copy reconnects.

Keys
----
A key is a relative, '/'-separated path: non-empty, at most 1024 UTF-8 bytes, no leading '/', no empty, '.' or
'..' segment, no trailing '/', no control characters. `validate_key` enforces this the same way on every
backend, so a key accepted by the posix store is accepted by S3 and the other way round; a bad key raises
ValueError naming the key. List prefixes follow the same rules except that they may be empty and may end with
'/' or a partial segment.

Metadata
--------
User metadata is a small dict of str -> str (S3 ``x-amz-meta-*``): names lowercase ``[a-z0-9-]``, values
printable ASCII, at most 2 KiB in all. Every put stores the crc32c of the whole content as metadata ``crc32c``
(8 lowercase hex digits, see `format_crc32c`) so a reader can verify what it fetched; `ObjectInfo.crc32c` gives it
back as an int.

Errors
------
All failures raise `ObjectStoreError` or a subclass, and every message names the object key (with the store's
location): `ObjectNotFound` (no such key), `ObjectRangeError` (a ranged read past the end of the object),
`ObjectStoreUnavailable` (network down, timeouts, 5xx or throttling after the backend's retries: try again
later), `Fenced` (the store's `fence` refused a write). Invalid arguments (bad key, bad metadata, negative range)
raise ValueError.

Fencing
-------
`fence`, when set, is called as fence(op, keys) immediately before each request that changes the store (the PUT,
multipart completion, copy or DELETE request itself, and again before each retry of it; posix: before the rename,
link or unlink that publishes or removes), after any wait of the caller or of the backend. It raises to refuse
(the writer lease sets it: tierfs.tier.lease). Reads, the invisible steps of an upload (parts, staging) and
aborts of uploads are not fenced: an abort changes nothing a reader sees, and a fenced writer cleans up after
itself.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import re
from typing import Callable, Iterable, Iterator, Mapping, Sequence, Union

MAX_KEY_BYTES = 1024
MAX_METADATA_BYTES = 2048
CRC32C_META = "crc32c"

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_META_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_META_VALUE = re.compile(r"^[\x20-\x7e]*$")


# ------------------------------------------------------------------------------------------------------ exceptions


class ObjectStoreError(Exception):
    """Any object-store failure. `key` is the store-relative key the operation was about.

    Raise it as ObjectStoreError(key, message); the message gets the key appended when it does not already name
    it. The one-argument form ObjectStoreError(message) is accepted too (key None): its message must name the key.
    Instances pickle (Spark ships them between processes); `cause` travels as text.
    """

    def __init__(self, key: str | None, message: str | None = None):
        if message is None:
            key, message = None, str(key)
        self.key = key
        super().__init__(message if not key or key in message else f"{message} (object key {key!r})")

    def __reduce__(self):
        state = dict(self.__dict__)
        if isinstance(state.get("cause"), BaseException):
            cause = state["cause"]
            state["cause"] = f"{type(cause).__name__}: {cause}"
        return (_restore_error, (type(self), self.args, state))


def _restore_error(cls: type, args: tuple, state: dict) -> "ObjectStoreError":
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class Fenced(ObjectStoreError):
    """A write or delete refused by the store's fence: this process no longer holds the writer lease."""


class ObjectNotFound(ObjectStoreError):
    """The key does not exist."""

    def __init__(self, key: str, where: str | None = None):
        super().__init__(key, f"object not found: {where if where else repr(key)}")


class ObjectRangeError(ObjectStoreError):
    """A ranged read asked for bytes past the end of the object."""

    def __init__(self, key: str, start: int, length: int, size: int | None, where: str | None = None):
        self.start, self.length, self.size = start, length, size
        have = f"object size is {size}" if size is not None else "object is shorter"
        super().__init__(key, f"range [{start}, {start + length}) is past the end of {where if where else repr(key)}: "
                              f"{have}")


class ObjectStoreUnavailable(ObjectStoreError):
    """The store could not be reached or kept failing (network, timeouts, 5xx, throttling) after retries.

    Transient by nature: the caller may retry later. `cause` is the last underlying exception.
    """

    def __init__(self, key: str, cause: BaseException | str, where: str | None = None, op: str | None = None):
        self.cause = cause
        what = f"{op} of " if op else ""
        cause_text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        super().__init__(key, f"object store unavailable for {what}{where if where else repr(key)}: {cause_text}")


# ------------------------------------------------------------------------------------------------------ value types


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about one object.

    `size` is the content length in bytes. `etag` is an opaque version tag without quotes (S3: the ETag, with a
    '-N' suffix for multipart objects; posix: crc32c and size of the content). `mtime` is seconds since the
    epoch (float) or None when the backend did not say. `metadata` is the user metadata, or None when it was not
    fetched (`list` does not fetch it: use `head`).
    """

    key: str
    size: int
    etag: str | None = None
    mtime: float | None = None
    metadata: Mapping[str, str] | None = None

    @property
    def crc32c(self) -> int | None:
        """crc32c of the whole content as stored at put time, or None if absent/unknown."""
        if not self.metadata:
            return None
        value = self.metadata.get(CRC32C_META)
        return parse_crc32c(value) if value else None


@dataclasses.dataclass(frozen=True)
class MultipartUpload:
    """An upload that was started and neither completed nor aborted (`initiated`: epoch seconds or None)."""

    key: str
    upload_id: str
    initiated: float | None = None


# ------------------------------------------------------------------------------------------------------ helpers


def format_crc32c(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def parse_crc32c(text: str) -> int | None:
    try:
        return int(text, 16) if len(text) == 8 else None
    except ValueError:
        return None


def validate_key(key: object) -> str:
    """Return `key` if it is a valid object key, else raise ValueError naming it."""
    if not isinstance(key, str):
        raise ValueError(f"object key {key!r} must be a str, not {type(key).__name__}")
    if not key:
        raise ValueError("object key '' is empty")
    _check_text(key, "object key")
    if key.endswith("/"):
        raise ValueError(f"object key {key!r} must not end with '/'")
    _check_segments(key, key.split("/"), "object key")
    return key


def validate_prefix(prefix: object) -> str:
    """Return `prefix` if it is a valid list prefix ('' lists everything), else raise ValueError naming it.

    Like a key, except that the last segment is a partial name: it may be empty (prefix ends with '/').
    """
    if not isinstance(prefix, str):
        raise ValueError(f"list prefix {prefix!r} must be a str, not {type(prefix).__name__}")
    if prefix:
        _check_text(prefix, "list prefix")
        _check_segments(prefix, prefix.split("/")[:-1], "list prefix")
    return prefix


def _check_text(key: str, what: str) -> None:
    if _CONTROL.search(key):
        raise ValueError(f"{what} {key!r} contains a control character")
    if key.startswith("/"):
        raise ValueError(f"{what} {key!r} must be relative (no leading '/')")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} {key!r} is not valid UTF-8 text") from None
    if len(encoded) > MAX_KEY_BYTES:
        raise ValueError(f"{what} {key[:60]!r}... is {len(encoded)} bytes; the limit is {MAX_KEY_BYTES}")


def _check_segments(key: str, segments: list[str], what: str) -> None:
    for seg in segments:
        if seg == "":
            raise ValueError(f"{what} {key!r} has an empty path segment ('//')")
        if seg in (".", ".."):
            raise ValueError(f"{what} {key!r} has a {seg!r} path segment")


def validate_metadata(key: str, metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A clean copy of user metadata, or ValueError naming the key and the offending entry."""
    out: dict[str, str] = {}
    total = 0
    for name, value in (metadata or {}).items():
        if not isinstance(name, str) or not _META_NAME.match(name):
            raise ValueError(f"object key {key!r}: metadata name {name!r} must match [a-z0-9][a-z0-9-]*")
        if not isinstance(value, str) or not _META_VALUE.match(value):
            raise ValueError(f"object key {key!r}: metadata {name!r} value must be printable ASCII text")
        total += len(name) + len(value)
        out[name] = value
    if total > MAX_METADATA_BYTES:
        raise ValueError(f"object key {key!r}: metadata is {total} bytes; the limit is {MAX_METADATA_BYTES}")
    return out


def merge_crc32c(key: str, metadata: Mapping[str, str] | None, crc: int | None) -> dict[str, str]:
    """Validated metadata with `crc32c` set to `crc`; a caller-given crc32c that disagrees is a ValueError."""
    meta = validate_metadata(key, metadata)
    given = meta.get(CRC32C_META)
    if given is not None:
        if parse_crc32c(given) is None:
            raise ValueError(f"object key {key!r}: metadata crc32c {given!r} must be 8 hex digits")
        if crc is not None and parse_crc32c(given) != crc:
            raise ValueError(f"object key {key!r}: metadata crc32c {given} does not match the content "
                             f"({format_crc32c(crc)})")
        meta[CRC32C_META] = given.lower()
    elif crc is not None:
        meta[CRC32C_META] = format_crc32c(crc)
    return meta


SPOOL_MEMORY_BYTES = 128 << 20
Metadata = Union[Mapping[str, str], Callable[[], Mapping[str, str]], None]  # put_stream: values, or a callable


def spool_put(store: "ObjectStore", key: str, chunks: Iterable[bytes | bytearray | memoryview],
              metadata: Metadata = None, spool_dir: str | None = None) -> ObjectInfo:
    """ObjectStore.put_stream by collecting the content first (memory, then a temporary file); see there."""
    import tempfile

    import crc32c as _crc32c

    if not callable(metadata):
        merge_crc32c(key, metadata, None)  # validate before consuming anything
    parts: list[bytes] = []
    crc = size = 0
    path: str | None = None
    f = None
    try:
        for chunk in chunks:
            if not chunk:
                continue
            crc = _crc32c.crc32c(chunk, crc)
            size += len(chunk)
            if f is None and size > SPOOL_MEMORY_BYTES:
                fd, path = tempfile.mkstemp(prefix="tierfs-spool-", suffix=".tmp", dir=spool_dir)
                f = os.fdopen(fd, "wb")
                f.writelines(parts)
                parts = []
            if f is not None:
                f.write(chunk)
            else:
                parts.append(bytes(chunk))
        meta = merge_crc32c(key, metadata() if callable(metadata) else metadata, crc)
        if f is None:
            return store.put(key, parts[0] if len(parts) == 1 else b"".join(parts), metadata=meta)
        f.close()
        return store.put_file(key, path, metadata=meta, crc32c=crc)
    finally:
        if f is not None:
            f.close()
            os.unlink(path)


def check_range(key: str, start: int, length: int) -> None:
    if not isinstance(start, int) or not isinstance(length, int) or start < 0 or length < 0:
        raise ValueError(f"object key {key!r}: invalid range start={start!r} length={length!r} "
                         "(both must be integers >= 0)")


def source_length(key: str, path: str | os.PathLike, offset: int, length: int | None) -> int:
    """The number of bytes put_file will read from `path`, checked against the file size."""
    if not isinstance(offset, int) or offset < 0 or (length is not None and (not isinstance(length, int)
                                                                               or length < 0)):
        raise ValueError(f"object key {key!r}: invalid source range offset={offset!r} length={length!r}")
    size = os.stat(path).st_size
    if length is None:
        if offset > size:
            raise ValueError(f"object key {key!r}: offset {offset} is past the end of {os.fspath(path)!r} "
                             f"({size} bytes)")
        return size - offset
    if offset + length > size:
        raise ValueError(f"object key {key!r}: source range [{offset}, {offset + length}) is past the end of "
                         f"{os.fspath(path)!r} ({size} bytes)")
    return length


# ------------------------------------------------------------------------------------------------------ interface


class ObjectStore(abc.ABC):
    """A flat key -> bytes store with user metadata. Blocking, thread-safe; see the module docstring."""

    #: True when put_if_absent is atomic on this backend (False: best-effort head + put, see put_if_absent).
    atomic_put_if_absent: bool = True
    #: Called as fence(op, keys) right before every mutating request; raises (Fenced) to refuse it. See the
    #: module docstring. Never pickled: a copy in another process must not call back into this one.
    fence: Callable[[str, Sequence[str]], None] | None = None

    def _fence(self, op: str, keys: Sequence[str]) -> None:
        if self.fence is not None and keys:
            self.fence(op, keys)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("fence", None)
        return state

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the store lives, e.g. 'file:///srv/tier' or 's3://bucket/prefix' (never contains secrets)."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview,
            metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Create or replace `key` with `data`, atomically: readers see the old or the new object, never a part.

        `metadata` is stored with the object, plus `crc32c` of `data` (computed here; a given value must match).
        """

    @abc.abstractmethod
    def put_file(self, key: str, path: str | os.PathLike, offset: int = 0, length: int | None = None, *,
                 metadata: Mapping[str, str] | None = None, crc32c: int | None = None) -> ObjectInfo:
        """Create or replace `key` with bytes [offset, offset+length) of the file at `path` (to EOF if None).

        Streams: memory use is bounded by the part size times the upload concurrency, whatever the file size.
        On S3 content above the multipart threshold is uploaded in parts of the configured size. `crc32c` of
        that content may be passed when the caller already knows it (saves a read pass; the posix store checks
        it); else it is computed. The source must not change during the call. A failed upload leaves no partial
        object (S3 aborts the multipart upload; a killed process leaves one that `list_multipart_uploads` shows).
        """

    def put_stream(self, key: str, chunks: Iterable[bytes | bytearray | memoryview], *,
                   metadata: Metadata = None, spool_dir: str | None = None) -> ObjectInfo:
        """Create or replace `key` with the concatenation of `chunks`, taken as the caller produces them; an
        exception raised by `chunks` stores nothing (and propagates). `metadata` may be a callable, called once
        `chunks` is exhausted, for values known only then. The `crc32c` of the whole content is stored as by
        `put` (a given one must match).

        This default holds the content in memory up to SPOOL_MEMORY_BYTES, beyond that in a temporary file in
        `spool_dir` (default $TMPDIR), and stores it with `put` or `put_file` once `chunks` is exhausted. S3
        uploads parts while they are produced instead.
        """
        return spool_put(self, key, chunks, metadata, spool_dir)

    compose_min_part = 0  # compose: every range but the last holds at least this many bytes

    def compose(self, key: str, sources: list[tuple[str, int, int]], *, crc32c: int,
                metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Create or replace `key` inside the store with byte ranges of objects it holds, in order: (source key,
        offset, length) each, none of them sent by the caller (S3: UploadPartCopy; posix: a local copy). Every
        range but the last must hold at least `compose_min_part` bytes. `crc32c`, of the result as the caller
        knows it from its own copy, is stored as by `put`; a store that reads the bytes checks it. A failure stores
        nothing. NotImplementedError: this store cannot."""
        raise NotImplementedError(f"{type(self).__name__} cannot compose objects")

    @staticmethod
    def _check_compose(key: str, sources: list[tuple[str, int, int]], min_part: int) -> int:
        """The composed size; ValueError for an empty list, a bad range, or a short range before the last."""
        if not sources:
            raise ValueError(f"compose {key!r}: no source ranges")
        for i, (src, off, n) in enumerate(sources):
            validate_key(src)
            check_range(src, off, n)
            if n <= 0 or (i < len(sources) - 1 and n < min_part):
                raise ValueError(f"compose {key!r}: range {i} ({src!r} +{off}, {n} bytes) is empty or shorter "
                                 f"than {min_part} bytes before the last")
        return sum(n for _, _, n in sources)

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Exactly `length` bytes of `key` from offset `start` (one ranged GET).

        Raises ObjectRangeError if the object ends before start+length (no short reads), ObjectNotFound if the
        key does not exist. length == 0 returns b'' without any I/O.
        """

    def get_range_into(self, key: str, start: int, bufs: Sequence[memoryview],
                       progress: Callable[[int], None] | None = None) -> None:
        """Fill `bufs`, in order, with the bytes of `key` from offset `start` (one ranged GET of their total
        length), with the errors of `get_range`. A caller that keeps its buffers and reuses them touches no fresh
        memory per read (page faults cost as much as the copy on a VM). On an error the buffers hold garbage,
        except those already reported through `progress`.

        `progress(k)`, in the calling thread, says bufs[:k] hold their final bytes: this call never writes them
        again (a retry resumes after them), so the caller may use them while the rest arrives. A store may report
        late, or never (the caller then knows at the return).

        This default reads with `get_range` and copies; S3 and posix read into the buffers directly."""
        data = memoryview(self.get_range(key, start, sum(len(b) for b in bufs)))
        pos = 0
        for b in bufs:
            b[:] = data[pos:pos + len(b)]
            pos += len(b)

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole content of `key` (ObjectNotFound if absent). For large objects prefer get_range."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size, etag, mtime and metadata of `key`, or None if it does not exist."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete `key`. Idempotent: deleting a missing key is not an error."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete every key (idempotent, batched where the backend can). Raises on the first failure."""
        for key in keys:
            self.delete(key)

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix` (a plain string prefix, not a directory), in ascending
        UTF-8 byte order of the key, fetched lazily page by page. `metadata` of the yielded infos is None."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview,
                      metadata: Mapping[str, str] | None = None) -> bool:
        """Create `key` only if it does not exist: True if this call created it, False if it already existed.

        Atomic (exactly one of several concurrent callers wins) where `atomic_put_if_absent` is True: posix via
        a hard link, S3 via a conditional PUT (If-None-Match: *). An S3 server that does not implement
        conditional writes is detected (NotImplemented answer, or a probe showing the header is ignored) and the
        store falls back, with one warning, to a best-effort head-then-put that a concurrent writer can race.
        """

    def put_if_match(self, key: str, data: bytes | bytearray | memoryview, etag: str | None,
                     metadata: Mapping[str, str] | None = None) -> str | None:
        """Compare and swap: replace `key` only if its etag is still `etag` (None: only if `key` does not exist).
        Returns the etag of the new object, or None when the condition did not hold (nothing was written).

        Atomic against other put_if_match calls of the key: posix under a lock file beside the key, S3 through a
        conditional PUT (If-Match / If-None-Match), which the server checks atomically with the write. Identical
        content gives an identical etag, so a caller that must see every change writes content that differs.
        NotImplementedError: this store cannot."""
        raise NotImplementedError(f"{type(self).__name__} cannot compare and swap objects")

    @abc.abstractmethod
    def list_multipart_uploads(self, prefix: str = "") -> Iterator[MultipartUpload]:
        """Uploads started under `prefix` and neither completed nor aborted: in flight, or left by a crash."""

    @abc.abstractmethod
    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort one upload listed by list_multipart_uploads and free its parts. Idempotent."""

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def close(self) -> None:
        """Release connections and threads. The store must not be used afterwards."""

    def __enter__(self) -> "ObjectStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
