"""PosixObjectStore: objects as files under a root directory (another disk, NFS, any mounted store).

This is the role of RocketMQ's PosixFileSegment and the embedded default store.

File layout: one regular file per object at ROOT/<key>, holding the content followed by a trailer:

    [content bytes][metadata JSON (utf-8)][footer: 32 bytes]
    footer = magic b"TIERFSO\\x01" | content length u64 | content crc32c u32 | JSON length u32 | JSON crc32c u32
             | footer crc32c u32            (little endian)

Why a trailer, not a sidecar `<key>.meta` and not xattrs:
* atomic with the content: data and metadata are one file, published by one rename (or one link), so a crash
  can never leave an object without its metadata, metadata without its object, or a mismatched pair. A sidecar
  needs two renames and a recovery rule for every interleaving; it also reserves a key suffix.
* portable: xattrs are missing or size-limited on NFSv3, some FUSE and SMB mounts, and are lost by naive copies.
* cheap: a ranged read costs one extra pread of 32 bytes (the footer) to learn the content length; the content
  sits at offset 0, so `head -c SIZE file` (or truncate) gives back the exact original bytes.
* self-checking: the footer and the metadata carry their own crc32c, and the content crc32c is in the footer
  (a torn or foreign file is reported as corrupt, naming the key, instead of being served).

Atomic publication: content is written to `.tierfs-tmp.<random>.<name>` in the destination directory, fsynced,
then renamed over the key (put) or hard-linked to it (put_if_absent: link(2) fails with EEXIST if the key exists,
so exactly one concurrent writer wins), and the directory is fsynced. put_if_match compares and renames under an
exclusive lock on the file `.tierfs-cas` of the key's directory (flock, after a lock of the threads of this
process). New directories are fsynced into their parents. Temporary files are hidden from `list` and are what
`list_multipart_uploads` reports (a put_file is a streamed copy: the posix "multipart upload");
`abort_multipart` deletes one. Empty directories left by deletes are removed.

Plain objects: a key ending in one of PLAIN_SUFFIXES (".parquet": the message archive) is stored as the bare
content, no trailer, so other tools (pyarrow, DuckDB, Spark) read the store directory in place. Such an object
is published the same atomic way but carries no metadata and no stored crc32c: `head` gives {} as its metadata,
its size is the file size, and its etag is made of mtime and size. Formats stored plain check themselves
(Parquet: magic bytes, page checksums).

Posix-only key limits (ValueError): no key segment may start with `.tierfs-` (reserved for temporary files) or be
longer than 200 bytes, and a key cannot be both an object and a prefix of other objects ("a" and "a/b").
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
import struct
import threading
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import crc32c as _crc32c

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from . import crc32c_fd
from .base import (MultipartUpload, ObjectInfo, ObjectNotFound, ObjectRangeError, ObjectStore, ObjectStoreError,
                   ObjectStoreUnavailable, check_range, format_crc32c, merge_crc32c, source_length, validate_key,
                   validate_prefix)

log = logging.getLogger("tierfs.objectstore.posix")

MAGIC = b"TIERFSO\x01"
_FOOTER = struct.Struct("<8sQIIII")
FOOTER_SIZE = _FOOTER.size  # 32
_RESERVED = ".tierfs-"
_TMP = ".tierfs-tmp."
_CAS = ".tierfs-cas"  # put_if_match's lock file in the key's directory (hidden from list, like temp files)
_cas_mutex = threading.Lock()
_cas_locks: dict[str, threading.Lock] = {}  # lock file path -> the lock threads of this process take first
_COMPOSE_PIECE = 8 << 20  # compose copies through one buffer of at most this many bytes
_TMP_RE = re.compile(r"^\.tierfs-tmp\.([0-9a-f]{16})\.(.+)$")
MAX_SEGMENT_BYTES = 200
PLAIN_SUFFIXES = (".parquet",)  # objects that other tools open in place: stored without the trailer
# errors that mean "the medium is not there right now" (NFS server gone, unmounted, I/O failure)
_UNAVAILABLE = {errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNREFUSED, errno.ECONNRESET, errno.ENOLINK,
                errno.EREMOTEIO, errno.ENODEV, errno.ENXIO, errno.EAGAIN}


class _Corrupt(Exception):
    pass


class _ProducerFailed(Exception):
    """Carries an exception of put_stream's producer past `_errors`, which must not translate it (the caller gets
    the producer's own exception, as from every store)."""


def _crc(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def is_plain(key: str) -> bool:
    """Is this key stored as the bare content (see PLAIN_SUFFIXES)?"""
    return key.endswith(PLAIN_SUFFIXES)


class PosixObjectStore(ObjectStore):
    """Objects as files under `root`. Thread-safe (no shared mutable state), picklable.

    root: absolute path of the store directory. create: make it (and parents) if missing; when False a missing
    root is ObjectStoreUnavailable (e.g. an NFS mount that is not there). fsync: make every put durable before
    returning (file, then directory); turn off only for throwaway stores. copy_chunk_size: read/write size of
    put_file's streamed copy.
    """

    atomic_put_if_absent = True

    def __init__(self, root: str | os.PathLike, *, create: bool = True, fsync: bool = True,
                 copy_chunk_size: int = 1 << 20):
        root = os.fspath(root)
        if not os.path.isabs(root):
            raise ValueError(f"posix object store root {root!r} must be an absolute path")
        self.root = os.path.normpath(root)
        self.fsync = bool(fsync)
        if copy_chunk_size < 4096:
            raise ValueError(f"posix object store copy_chunk_size {copy_chunk_size} must be >= 4096")
        self.copy_chunk_size = int(copy_chunk_size)
        if create:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as e:
                raise ObjectStoreError("", f"cannot create posix object store root {self.root!r}: {e}") from e

    def __repr__(self) -> str:
        return f"PosixObjectStore({self.root!r})"

    @property
    def url(self) -> str:
        return "file://" + self.root

    # ---------------------------------------------------------------------------------------------- paths, errors

    def _where(self, key: str) -> str:
        return f"file://{self.root}/{key}"

    def _path(self, key: str) -> str:
        validate_key(key)
        for seg in key.split("/"):
            if seg.startswith(_RESERVED):
                raise ValueError(f"object key {key!r}: segments starting with {_RESERVED!r} are reserved by the "
                                 "posix object store")
            if len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
                raise ValueError(f"object key {key!r}: segment {seg[:40]!r}... is longer than "
                                 f"{MAX_SEGMENT_BYTES} bytes (posix object store limit)")
        return os.path.join(self.root, key)

    @contextlib.contextmanager
    def _errors(self, key: str, op: str):
        try:
            yield
        except (ObjectStoreError, ValueError):
            raise
        except _Corrupt as e:
            raise ObjectStoreError(key, f"{op}: corrupt object {self._where(key)}: {e}") from None
        except OSError as e:
            raise self._translate(key, op, e) from e

    def _translate(self, key: str, op: str, e: OSError) -> ObjectStoreError:
        if e.errno in _UNAVAILABLE or not os.path.isdir(self.root):
            cause = e if os.path.isdir(self.root) else f"store root {self.root!r} is missing ({e.strerror})"
            return ObjectStoreUnavailable(key, cause, self._where(key), op)
        if e.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST) and op.startswith("put"):
            return ObjectStoreError(key, f"{op} of {self._where(key)} failed: a key cannot be both an object and "
                                         f"a prefix of other objects ({e.strerror})")
        return ObjectStoreError(key, f"{op} of {self._where(key)} failed: {e.strerror or e} "
                                     f"[{errno.errorcode.get(e.errno or 0, e.errno)}]")

    def _fsync_dir(self, path: str) -> None:
        if not self.fsync:
            return
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _makedirs(self, directory: str) -> None:
        """Create `directory` and missing parents under root, each made durable in its parent."""
        if os.path.isdir(directory):
            return
        if not os.path.isdir(self.root):
            raise FileNotFoundError(errno.ENOENT, "store root is missing", self.root)
        rel = os.path.relpath(directory, self.root)
        cur = self.root
        for part in rel.split(os.sep):
            parent, cur = cur, os.path.join(cur, part)
            try:
                os.mkdir(cur)
            except FileExistsError:
                continue
            self._fsync_dir(parent)

    # ---------------------------------------------------------------------------------------------- writing

    def _stage(self, path: str, key: str, write_content: Callable[[int], tuple[int, int]],
               metadata: Callable[[int], dict[str, str]]) -> tuple[str, int, int]:
        """Write a complete object file to a temp name beside `path`; return (tmp path, size, crc32c).

        write_content(fd) writes the content and returns (length, crc32c); metadata(crc) gives the metadata.
        """
        directory, name = os.path.split(path)
        for attempt in range(5):
            tmp = os.path.join(directory, f"{_TMP}{secrets.token_hex(8)}.{name}")
            try:
                self._makedirs(directory)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                break
            except FileNotFoundError:  # a concurrent delete pruned an empty directory on the way: make it again
                if attempt == 4 or not os.path.isdir(self.root):
                    raise
        try:
            try:
                size, crc = write_content(fd)
                if not is_plain(key):
                    meta = json.dumps({"metadata": metadata(crc)}, sort_keys=True, separators=(",", ":")).encode()
                    body = _FOOTER.pack(MAGIC, size, crc, len(meta), _crc(meta), 0)[:-4]
                    footer = body + struct.pack("<I", _crc(body))
                    _write_all(fd, meta + footer)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp, size, crc

    def _publish(self, tmp: str, path: str, key: str, size: int, crc: int, meta: Mapping[str, str]) -> ObjectInfo:
        try:
            self._fence("put", [key])
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fsync_dir(os.path.dirname(path))
        st = os.stat(path)
        if is_plain(key):
            return ObjectInfo(key, size, _plain_etag(st), st.st_mtime, {})
        return ObjectInfo(key, size, _etag(crc, size), st.st_mtime, dict(meta))

    def _stage_bytes(self, path: str, key: str, data: bytes | bytearray | memoryview,
                     metadata: Mapping[str, str] | None) -> tuple[str, int, int, dict[str, str]]:
        """Write in-memory content (plus its crc32c metadata) to a temp file next to `path`."""
        view = memoryview(data).cast("B")
        crc = _crc(view)
        meta = merge_crc32c(key, metadata, crc)
        tmp, size, crc = self._stage(path, key, lambda fd: (_write_all(fd, view), crc), lambda c: meta)
        return tmp, size, crc, meta

    def put(self, key: str, data: bytes | bytearray | memoryview,
            metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        path = self._path(key)
        with self._errors(key, "put"):
            tmp, size, crc, meta = self._stage_bytes(path, key, data, metadata)
            return self._publish(tmp, path, key, size, crc, meta)

    def put_file(self, key: str, path: str | os.PathLike, offset: int = 0, length: int | None = None, *,
                 metadata: Mapping[str, str] | None = None, crc32c: int | None = None) -> ObjectInfo:
        dest = self._path(key)
        merge_crc32c(key, metadata, crc32c)  # validate early
        n = source_length(key, path, offset, length)
        chunk = self.copy_chunk_size

        def copy(fd: int) -> tuple[int, int]:
            crc = 0
            buf = bytearray(min(chunk, max(n, 1)))
            view = memoryview(buf)
            with open(path, "rb", buffering=0) as src:
                pos, left = offset, n
                while left:
                    got = os.preadv(src.fileno(), [view[:min(left, len(buf))]], pos)
                    if got == 0:
                        raise ObjectStoreError(key, f"put_file: source {os.fspath(path)!r} ended at {pos}, before "
                                                    f"{offset + n}: it changed during the upload")
                    crc = _crc(view[:got], crc)
                    _write_all(fd, view[:got])
                    pos += got
                    left -= got
            if crc32c is not None and crc != crc32c:
                raise ObjectStoreError(key, f"put_file: content of {os.fspath(path)!r} [{offset}, {offset + n}) has "
                                            f"crc32c {format_crc32c(crc)}, not the given {format_crc32c(crc32c)}")
            return n, crc

        metas: dict[str, str] = {}

        def meta_for(crc: int) -> dict[str, str]:
            metas.update(merge_crc32c(key, metadata, crc))
            return metas

        with self._errors(key, "put_file"):
            tmp, size, crc = self._stage(dest, key, copy, meta_for)
            return self._publish(tmp, dest, key, size, crc, metas)

    def put_stream(self, key: str, chunks: Iterable[bytes | bytearray | memoryview], *,
                   metadata: Mapping[str, str] | Callable[[], Mapping[str, str] | None] | None = None,
                   spool_dir: str | None = None) -> ObjectInfo:
        """As the base class says, but written straight into the object's own temp file as the chunks come: no
        spool and no second copy, whatever the size (compaction streams whole lz4c segments through here).
        `spool_dir` is not used."""
        if not callable(metadata):
            merge_crc32c(key, metadata, None)  # validate before consuming anything
        dest = self._path(key)
        metas: dict[str, str] = {}

        def write(fd: int) -> tuple[int, int]:
            crc = size = 0
            it = iter(chunks)
            while True:
                try:
                    chunk = next(it)
                except StopIteration:
                    break
                except Exception as e:
                    raise _ProducerFailed() from e
                if chunk:
                    crc = _crc(chunk, crc)
                    size += _write_all(fd, chunk)
            try:
                given = metadata() if callable(metadata) else metadata
            except Exception as e:
                raise _ProducerFailed() from e
            metas.update(merge_crc32c(key, given, crc))  # ValueError if a given crc32c does not match
            return size, crc

        try:
            with self._errors(key, "put_stream"):
                tmp, size, crc = self._stage(dest, key, write, lambda _crc32c: metas)
                return self._publish(tmp, dest, key, size, crc, metas)
        except _ProducerFailed as e:
            assert e.__cause__ is not None
            raise e.__cause__ from None

    def compose(self, key: str, sources: list[tuple[str, int, int]], *, crc32c: int,
                metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """ObjectStore.compose: a local copy of the ranges (each source read and checked as by get_range); the
        crc32c of what was copied must be the given one. One range that is all of an object is a hard link
        instead (`_link_whole`): its bytes are checked, never written again."""
        dest = self._path(key)
        meta = merge_crc32c(key, metadata, crc32c)
        self._check_compose(key, sources, 0)
        if len(sources) == 1 and sources[0][1] == 0 and not metadata:
            with self._errors(key, "compose"):
                linked = self._link_whole(key, dest, sources[0][0], sources[0][2], crc32c)
            if linked is not None:
                return linked

        def copy(fd: int) -> tuple[int, int]:
            crc = size = 0
            # one buffer for every piece: a fresh bytes per range cost an allocation, its page faults and a copy
            buf = memoryview(bytearray(min(max(n for _, _, n in sources), _COMPOSE_PIECE)))
            for src, off, n in sources:
                for lo in range(0, n, len(buf)):
                    piece = buf[:min(len(buf), n - lo)]
                    self.get_range_into(src, off + lo, [piece])
                    crc = _crc(piece, crc)
                    size += _write_all(fd, piece)
            if crc != crc32c:
                raise ObjectStoreError(key, f"compose of {self._where(key)}: the ranges have crc32c "
                                            f"{format_crc32c(crc)}, not the given {format_crc32c(crc32c)}")
            return size, crc

        with self._errors(key, "compose"):
            tmp, size, crc = self._stage(dest, key, copy, lambda c: meta)
            return self._publish(tmp, dest, key, size, crc, meta)

    def _link_whole(self, key: str, dest: str, src: str, length: int, crc32c: int) -> ObjectInfo | None:
        """compose of all of `src` as `key`: a hard link to src's file, published as put publishes. Continuous
        tiering's append objects become a sealed segment's chunks this way, so the segment's bytes are not written
        a second time on the same disk. The linked content is read and checked against `crc32c` (an object
        damaged since its put must not become a chunk). The object keeps src's other metadata. None when no link
        can be made (links unsupported, a plain key, src missing or not exactly `length` bytes): the caller
        copies, which reports those cases as ever."""
        if is_plain(key) or is_plain(src):
            return None
        directory, name = os.path.split(dest)
        tmp = os.path.join(directory, f"{_TMP}{secrets.token_hex(8)}.{name}")
        try:
            self._makedirs(directory)
            os.link(self._path(src), tmp)
        except OSError:
            return None
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size, crc, meta = _read_meta(fd, os.fstat(fd).st_size)
                ok = size == length and crc == crc32c and crc32c_fd(fd, 0, size) == crc32c
            finally:
                os.close(fd)
        except (OSError, _Corrupt, ValueError):
            ok = False
        if not ok:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return None
        return self._publish(tmp, dest, key, size, crc, meta)

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview,
                      metadata: Mapping[str, str] | None = None) -> bool:
        path = self._path(key)
        with self._errors(key, "put_if_absent"):
            if os.path.lexists(path):
                if os.path.isdir(path):
                    raise IsADirectoryError(errno.EISDIR, "is a directory", path)
                return False
            tmp, _, _, _ = self._stage_bytes(path, key, data, metadata)
            try:
                self._fence("put_if_absent", [key])
                os.link(tmp, path)
            except FileExistsError:
                if os.path.isdir(path):
                    raise
                return False
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self._fsync_dir(os.path.dirname(path))
            return True

    def put_if_match(self, key: str, data: bytes | bytearray | memoryview, etag: str | None,
                     metadata: Mapping[str, str] | None = None) -> str | None:
        path = self._path(key)
        directory = os.path.dirname(path)
        with self._errors(key, "put_if_match"):
            tmp, size, crc, _ = self._stage_bytes(path, key, data, metadata)
            try:
                with self._cas_lock(os.path.join(directory, _CAS)):
                    cur = self.head(key)
                    if (cur.etag if cur is not None else None) != etag:
                        return None
                    self._fence("put_if_match", [key])
                    if etag is None:
                        os.link(tmp, path)  # EEXIST only if a plain put raced us: not a compare-and-swap caller
                    else:
                        os.replace(tmp, path)
                    self._fsync_dir(directory)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return _etag(crc, size) if not is_plain(key) else self.head(key).etag

    @staticmethod
    @contextlib.contextmanager
    def _cas_lock(lock_path: str):
        """Exclusive lock of the compare-and-swaps in one directory: threads of this process, then processes."""
        with _cas_mutex:
            mutex = _cas_locks.setdefault(lock_path, threading.Lock())
        with mutex:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    # ---------------------------------------------------------------------------------------------- reading

    def _open(self, key: str) -> tuple[int, os.stat_result] | None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            if not os.path.isdir(self.root):
                raise
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, st

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        if length == 0:
            return b""
        with self._errors(key, "get_range"):
            fd, size = self._open_content(key)
            try:
                if start + length > size:
                    raise ObjectRangeError(key, start, length, size, self._where(key))
                return _pread_exact(fd, length, start)
            finally:
                os.close(fd)

    def _open_content(self, key: str) -> tuple[int, int]:
        """(an fd of the object's file, its content size); ObjectNotFound if there is none."""
        opened = self._open(key)
        if opened is None:
            raise ObjectNotFound(key, self._where(key))
        fd, st = opened
        try:
            return fd, _content_size(key, fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise

    def get_range_into(self, key: str, start: int, bufs: Sequence[memoryview],
                       progress: Callable[[int], None] | None = None) -> None:
        """As the base class says; one preadv, so `progress` is not called (the return says it all)."""
        length = sum(len(b) for b in bufs)
        check_range(key, start, length)
        if length == 0:
            return
        with self._errors(key, "get_range"):
            fd, size = self._open_content(key)
            try:
                if start + length > size:
                    raise ObjectRangeError(key, start, length, size, self._where(key))
                _preadv_exact(fd, [b for b in bufs if len(b)], start)
            finally:
                os.close(fd)

    def get(self, key: str) -> bytes:
        with self._errors(key, "get"):
            fd, size = self._open_content(key)
            try:
                return _pread_exact(fd, size, 0)
            finally:
                os.close(fd)

    def head(self, key: str) -> ObjectInfo | None:
        with self._errors(key, "head"):
            opened = self._open(key)
            if opened is None:
                return None
            fd, st = opened
            try:
                if is_plain(key):
                    return ObjectInfo(key, st.st_size, _plain_etag(st), st.st_mtime, {})
                size, crc, meta = _read_meta(fd, st.st_size)
                return ObjectInfo(key, size, _etag(crc, size), st.st_mtime, meta)
            finally:
                os.close(fd)

    # ---------------------------------------------------------------------------------------------- deleting

    def _unlink(self, key: str, path: str, op: str) -> bool:
        """Remove the object file; False if there was none (idempotent delete)."""
        with self._errors(key, op):
            try:
                os.unlink(path)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                if not os.path.isdir(self.root):
                    raise
                return False
            except PermissionError:
                if os.path.isdir(path):  # some systems say EPERM for unlink(dir): not an object, nothing to do
                    return False
                raise
        return True

    def delete(self, key: str) -> None:
        path = self._path(key)
        self._fence("delete", [key])
        if self._unlink(key, path, "delete"):
            directory = os.path.dirname(path)
            with self._errors(key, "delete"):
                self._fsync_dir(directory)
            self._prune(directory)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Unlink every object, then fsync each touched directory once and remove the ones left empty."""
        paths = [(key, self._path(key)) for key in keys]  # validate every key before deleting any
        self._fence("delete_many", [key for key, _ in paths])  # once, as S3 for each batch of 1000
        touched: dict[str, str] = {}
        for key, path in paths:
            if self._unlink(key, path, "delete_many"):
                touched.setdefault(os.path.dirname(path), key)
        for directory, key in sorted(touched.items(), key=lambda kv: -len(kv[0])):
            with self._errors(key, "delete_many"):
                try:
                    self._fsync_dir(directory)
                except FileNotFoundError:
                    continue
            self._prune(directory)

    def _prune(self, directory: str) -> None:
        while directory != self.root and directory.startswith(self.root + os.sep):
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = os.path.dirname(directory)

    # ---------------------------------------------------------------------------------------------- listing

    def _walk(self, prefix: str, temps: bool) -> Iterator[tuple[str, str]]:
        """(key, file path) of objects (or of temp files when `temps`) under prefix, in key byte order."""
        prefix = validate_prefix(prefix)
        dirpart, _, name_prefix = prefix.rpartition("/")
        if any(seg.startswith(_RESERVED) for seg in dirpart.split("/") if seg):
            return
        top = os.path.join(self.root, dirpart) if dirpart else self.root
        rel = dirpart + "/" if dirpart else ""
        with self._errors(prefix, "list"):
            if not os.path.isdir(self.root):
                raise FileNotFoundError(errno.ENOENT, "store root is missing", self.root)
        yield from self._walk_dir(top, rel, name_prefix, prefix, temps)

    def _walk_dir(self, directory: str, rel: str, name_prefix: str, prefix: str,
                  temps: bool) -> Iterator[tuple[str, str]]:
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise self._translate(prefix, "list", e) from e
        items: list[tuple[bytes, str, str, bool]] = []
        for ent in entries:
            name = ent.name
            try:
                is_dir = ent.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                if name.startswith(_RESERVED) or not name.startswith(name_prefix):
                    continue
                items.append(((name + "/").encode("utf-8", "surrogateescape"), name, ent.path, True))
                continue
            m = _TMP_RE.match(name)
            if temps:
                if not m:
                    continue
                logical = m.group(2)
                if not logical.startswith(name_prefix):
                    continue
                items.append(((logical + "/" + name).encode("utf-8", "surrogateescape"), name, ent.path, False))
            else:
                if name.startswith(_RESERVED) or not name.startswith(name_prefix):
                    continue
                items.append((name.encode("utf-8", "surrogateescape"), name, ent.path, False))
        items.sort()
        for _, name, path, is_dir in items:
            if is_dir:
                yield from self._walk_dir(path, rel + name + "/", "", prefix, temps)
            else:
                yield rel + name, path

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)  # eagerly: a bad prefix fails at the call, not at the first next()
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        for key, path in self._walk(prefix, temps=False):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # deleted while listing
                continue
            except OSError as e:
                raise self._translate(key, "list", e) from e
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if is_plain(key):
                    size, etag = st.st_size, _plain_etag(st)
                else:
                    try:
                        size, crc, _, _ = _read_footer(fd, st.st_size)
                    except _Corrupt as e:
                        log.warning("posix object store: skipping corrupt object %s in listing: %s",
                                    self._where(key), e)
                        continue
                    etag = _etag(crc, size)
            except OSError as e:
                raise self._translate(key, "list", e) from e
            finally:
                os.close(fd)
            yield ObjectInfo(key, size, etag, st.st_mtime, None)

    def list_multipart_uploads(self, prefix: str = "") -> Iterator[MultipartUpload]:
        validate_prefix(prefix)
        return self._list_uploads(prefix)

    def _list_uploads(self, prefix: str) -> Iterator[MultipartUpload]:
        for tmpkey, path in self._walk(prefix, temps=True):
            directory, _, tmpname = tmpkey.rpartition("/")
            m = _TMP_RE.match(tmpname)
            if not m:
                continue
            key = (directory + "/" if directory else "") + m.group(2)
            if not key.startswith(prefix):
                continue
            try:
                mtime = os.stat(path).st_mtime
            except FileNotFoundError:
                continue
            yield MultipartUpload(key, tmpname, mtime)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        path = self._path(key)
        m = _TMP_RE.match(upload_id) if isinstance(upload_id, str) else None
        if not m or m.group(2) != os.path.basename(path) or "/" in upload_id:
            raise ValueError(f"object key {key!r}: {upload_id!r} is not an upload id of this key in the posix "
                             "object store")
        with self._errors(key, "abort_multipart"):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(os.path.join(os.path.dirname(path), upload_id))


# ------------------------------------------------------------------------------------------------------ file helpers


def _etag(crc: int, size: int) -> str:
    return f"{format_crc32c(crc)}-{size}"


def _plain_etag(st: os.stat_result) -> str:
    return f"plain-{st.st_mtime_ns:x}-{st.st_size}"


def _content_size(key: str, fd: int, file_size: int) -> int:
    return file_size if is_plain(key) else _read_footer(fd, file_size)[0]


def _write_all(fd: int, data) -> int:
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    return total


def _pread_exact(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset) if length else b""
    if len(data) == length:  # the usual case: one copy, into the bytes returned
        return data
    buf = bytearray(length)  # a short read: resume after it
    buf[:len(data)] = data
    _preadv_exact(fd, [memoryview(buf)[len(data):]], offset + len(data))
    return bytes(buf)


def _preadv_exact(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Fill `bufs` from `offset` (preadv, resumed after short reads); a file that ends first is corrupt."""
    want = sum(len(b) for b in bufs)
    got = 0
    while bufs:
        n = os.preadv(fd, bufs, offset + got)
        if n == 0:
            raise _Corrupt(f"file ends at {offset + got}, expected {want} bytes from {offset}")
        got += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:], *bufs[1:]]


def _read_meta(fd: int, file_size: int) -> tuple[int, int, dict]:
    """(content length, content crc32c, metadata) of an object file, its footer and metadata checked."""
    size, crc, meta_len, meta_crc = _read_footer(fd, file_size)
    raw = _pread_exact(fd, meta_len, size)
    if _crc(raw) != meta_crc:
        raise _Corrupt("metadata checksum mismatch")
    try:
        return size, crc, json.loads(raw)["metadata"]
    except (ValueError, KeyError, TypeError) as e:
        raise _Corrupt(f"unreadable metadata ({e})") from None


def _read_footer(fd: int, file_size: int) -> tuple[int, int, int, int]:
    """(content length, content crc32c, metadata length, metadata crc32c) from a file's footer."""
    if file_size < FOOTER_SIZE:
        raise _Corrupt(f"file is {file_size} bytes, too short for the {FOOTER_SIZE}-byte footer")
    raw = _pread_exact(fd, FOOTER_SIZE, file_size - FOOTER_SIZE)
    magic, size, crc, meta_len, meta_crc, footer_crc = _FOOTER.unpack(raw)
    if magic != MAGIC:
        raise _Corrupt("no tierfs object footer (not written by the posix object store, or truncated)")
    if _crc(raw[:-4]) != footer_crc:
        raise _Corrupt("footer checksum mismatch")
    if size + meta_len + FOOTER_SIZE != file_size:
        raise _Corrupt(f"footer says {size} content + {meta_len} metadata bytes, file has {file_size}")
    return size, crc, meta_len, meta_crc
