"""S3ObjectStore: the ObjectStore interface on any S3-compatible server (AWS S3, Ceph RGW, MinIO, ...) via boto3.

Tuned for ranged-GET latency: one botocore client (thread-safe) reused by every thread, a large keep-alive
connection pool (`max_pool_connections`, size the caller's thread limiter to match), no default request/response
checksums (botocore >= 1.36 would otherwise add CRC32 trailers that older servers such as RGW 16 reject, and
checksum every ranged read), short connect timeout, bounded retries (`max_attempts` total attempts, 'standard' or
'adaptive' mode) and our own bounded re-read when a response body breaks mid-stream.

Ranged reads (`get_range`, `get_range_into`: the cold-read path) skip botocore's request machinery: a presigned
URL from the same client, sent over the client's own HTTP session, read straight into the caller's buffers
(tierfs.objectstore.s3get); this store retries them itself and maps their answers as it maps boto3's. With
retry_mode 'adaptive' they stay boto3 calls (its client-side rate limiting lives in botocore's retry handler).

Uploads: `put` is one PutObject; `put_file` goes through one shared boto3 TransferManager (multipart above
`multipart_threshold`, parts of `multipart_part_size`, `multipart_concurrency` parts in flight; the engine's
uploader paces uploads itself, `upload.bandwidth_bytes_per_second`). Memory is bounded by part size times
concurrency. A failed transfer aborts its multipart upload; one left by a killed process is found with
`list_multipart_uploads` and removed with `abort_multipart`.

Fencing (ObjectStore.fence): botocore event hooks on this store's client call the fence right before every
attempt of PutObject, CompleteMultipartUpload, CopyObject and DeleteObject(s) (not of parts or aborts), including
those s3transfer sends from its own threads, so a wait anywhere before (bandwidth, retries) is covered.
Conditional writes: put_if_absent sends If-None-Match: *, put_if_match If-Match: <etag>. Ceph RGW 16 (Pacific)
checks both atomically, but matches If-Match only against the bare etag (the quoted form AWS documents always
fails there): the other form is tried once when the store answers 412 while still holding that very etag. RGW 16
ignores If-Match on DeleteObject and If-None-Match on CompleteMultipartUpload: nothing here relies on either.

Errors: 404/NoSuchKey -> ObjectNotFound; 416 or a short range -> ObjectRangeError; connection failures,
timeouts, 5xx and throttling (after the retries) -> ObjectStoreUnavailable; everything else -> ObjectStoreError.
Every message names s3://bucket/prefix/key.

Credentials: explicit access_key/secret_key (+ session_token), or a named profile, or the standard AWS chain
(environment, shared files, instance/container roles). They are kept only inside the botocore session and a
redacting wrapper: never in repr(), str(), log lines or exception messages.
"""

from __future__ import annotations

import collections
import concurrent.futures
import email.utils
import http.client
import io
import ipaddress
import logging
import os
import random
import re
import secrets
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from .base import (CRC32C_META, Metadata, MultipartUpload, ObjectInfo, ObjectNotFound, ObjectRangeError,
                   ObjectStore, ObjectStoreError, ObjectStoreUnavailable, check_range, format_crc32c, merge_crc32c,
                   source_length, validate_key, validate_prefix)
from .s3get import Answer, LeanGet, read_plain, readinto_plain

log = logging.getLogger("tierfs.objectstore.s3")

MiB = 1 << 20
_MIN_PART = 5 * MiB
_MAX_PART = 5 * 1024 * MiB
_TOKEN_META = "tierfs-put-token"  # internal: lets a retried conditional PUT recognise its own earlier success
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "ServiceUnavailable", "InternalError", "RequestLimitExceeded", "BandwidthLimitExceeded",
                    "TooManyRequestsException", "ProvisionedThroughputExceededException", "EC2ThrottledException",
                    "PriorRequestNotComplete"}
_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
               "TokenRefreshRequired", "AuthorizationHeaderMalformed"}
_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")
_PROBE = ".tierfs-probe/"  # keys of the conditional-write probe, under the store prefix: never fenced
_FENCED_OPS = ("PutObject", "CompleteMultipartUpload", "CopyObject", "DeleteObject", "DeleteObjects")  # what a
# reader of the store can see: not the parts of an upload, nor its abort (a fenced writer cleans up after itself)
_warned_emulation: set[str] = set()
_warn_lock = threading.Lock()

# One boto3 session per profile, shared by every store of the process: creating a client from a warm session
# costs ~10 ms instead of ~100 ms (service models are parsed once). Session.client() is not thread-safe, hence
# the lock; a forked child starts with a fresh cache (the lock may have been held by another thread at fork).
_sessions: dict[str | None, Any] = {}
_sessions_lock = threading.Lock()


def _reset_sessions_after_fork() -> None:
    global _sessions_lock
    _sessions_lock = threading.Lock()
    _sessions.clear()


os.register_at_fork(after_in_child=_reset_sessions_after_fork)


def _make_client(profile: str | None, region: str | None, **kwargs: Any) -> tuple[Any, str]:
    """(botocore S3 client, effective region) from the shared session of `profile`."""
    import boto3

    with _sessions_lock:
        session = _sessions.get(profile)
        if session is None:
            session = boto3.session.Session(profile_name=profile) if profile else boto3.session.Session()
            _sessions[profile] = session
        region = region or session.region_name or "us-east-1"
        kwargs["config"] = kwargs["config"].merge(type(kwargs["config"])(region_name=region))
        return session.client("s3", **kwargs), region


def _is_loopback(url: str | None) -> bool:
    """Is `url`'s host this machine's loopback (localhost, 127.0.0.0/8, ::1)? Names are not resolved."""
    if not url:
        return False
    try:
        host = urllib.parse.urlsplit(url).hostname or ""
    except ValueError:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Secret:
    """Holds a credential; prints as <redacted>."""

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        self._value = value

    def get(self) -> Any:
        return self._value

    def __repr__(self) -> str:
        return "<redacted>"

    __str__ = __repr__

    def __reduce__(self):
        return (_Secret, (self._value,))


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    v = str(value).strip().lower()
    if v not in allowed:
        raise ValueError(f"S3 object store option {name}={value!r}: allowed values are {', '.join(allowed)}")
    return v


def _number(name: str, value: Any, minimum: float, maximum: float | None = None, integer: bool = True):
    try:
        v = int(value) if integer else float(value)
        if integer and isinstance(value, float) and not value.is_integer():
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"S3 object store option {name}={value!r} must be a number") from None
    if v < minimum or (maximum is not None and v > maximum):
        rng = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"S3 object store option {name}={value!r} must be {rng}")
    return v


class _FileWindow(io.RawIOBase):
    """A read-only, seekable view of bytes [offset, offset+length) of a file (for s3transfer)."""

    def __init__(self, path: str | os.PathLike, offset: int, length: int):
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._offset, self._length, self._pos = offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = min(len(b), self._length - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [memoryview(b)[:n]], self._offset + self._pos)
        self._pos += got
        return got

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def _network_errors() -> tuple[type[BaseException], ...]:
    import botocore.exceptions as bx
    import urllib3.exceptions as ux

    errs: list[type[BaseException]] = [bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError,
                                       ux.HTTPError, ConnectionError, TimeoutError]
    if hasattr(bx, "ResponseStreamingError"):
        errs.append(bx.ResponseStreamingError)
    return tuple(errs)


class S3ObjectStore(ObjectStore):
    """Objects in `bucket` under `prefix` ('' or 'a/b': keys become 'a/b/<key>').

    Options (all keyword):
      endpoint_url           None for AWS; e.g. 'http://127.0.0.1:7480' for RGW/MinIO
      region                 signing region; default: the credential chain's, else 'us-east-1'
      addressing             'auto' (path style with an endpoint_url, botocore's choice on AWS), 'path', 'virtual'
      access_key, secret_key, session_token   explicit credentials; else `profile`, else the AWS chain
      profile                a named profile from the shared AWS config files
      connect_timeout, read_timeout   seconds per attempt
      max_attempts           total attempts per request, including the first (>= 1)
      retry_mode             'standard' (exponential backoff with jitter) or 'adaptive' (also client-side rate
                             limiting when throttled)
      max_pool_connections   keep-alive HTTP connections shared by all threads
      multipart_threshold    put_file uses multipart above this size (bytes)
      multipart_part_size    bytes per part (5 MiB .. 5 GiB; s3transfer grows it if > 10000 parts)
      multipart_concurrency  parts uploaded in parallel (shared by all put_file calls)
      list_page_size         keys per ListObjectsV2 page (1..1000)
      tls_verify             True, False, or a CA bundle path
      conditional_put        'auto' (probe once, fall back to head+put if the server cannot), 'native', 'emulate'
      payload_signing        whether an upload's SigV4 signature covers a SHA-256 of its body: 'always', 'never',
                             or 'auto' (not over verified TLS nor to a loopback endpoint; see _payload_signing)
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, addressing: str = "auto", access_key: str | None = None,
                 secret_key: str | None = None, session_token: str | None = None, profile: str | None = None,
                 connect_timeout: float = 5.0, read_timeout: float = 30.0, max_attempts: int = 5,
                 retry_mode: str = "standard", max_pool_connections: int = 64,
                 multipart_threshold: int = 64 * MiB, multipart_part_size: int = 16 * MiB,
                 multipart_concurrency: int = 4,
                 list_page_size: int = 1000, tls_verify: bool | str = True, conditional_put: str = "auto",
                 payload_signing: str = "auto"):
        if not bucket or not isinstance(bucket, str):
            raise ValueError("S3 object store: the bucket name is missing")
        self.bucket = bucket
        prefix = (prefix or "").strip("/")
        if prefix:
            validate_key(prefix)
        self.prefix = prefix
        self._kprefix = prefix + "/" if prefix else ""
        self.endpoint_url = endpoint_url or None
        self.region = region or None
        self.addressing = _choice("addressing", addressing, ("auto", "path", "virtual"))
        if (access_key is None) != (secret_key is None):
            raise ValueError("S3 object store: access_key and secret_key must be given together (or neither, to "
                             "use the standard AWS credential chain)")
        self._credentials = _Secret((access_key, secret_key, session_token))
        self.profile = profile or None
        self.connect_timeout = _number("connect_timeout", connect_timeout, 0.01, integer=False)
        self.read_timeout = _number("read_timeout", read_timeout, 0.01, integer=False)
        self.max_attempts = _number("max_attempts", max_attempts, 1, 100)
        self.retry_mode = _choice("retry_mode", retry_mode, ("standard", "adaptive", "legacy"))
        self.max_pool_connections = _number("max_pool_connections", max_pool_connections, 1, 10000)
        self.multipart_part_size = _number("multipart_part_size", multipart_part_size, _MIN_PART, _MAX_PART)
        self.multipart_threshold = _number("multipart_threshold", multipart_threshold, 1)
        self.multipart_concurrency = _number("multipart_concurrency", multipart_concurrency, 1, 1000)
        self.list_page_size = _number("list_page_size", list_page_size, 1, 1000)
        if isinstance(tls_verify, str) and tls_verify.strip().lower() in ("true", "false"):
            tls_verify = tls_verify.strip().lower() == "true"
        self.tls_verify = tls_verify
        self.conditional_put = _choice("conditional_put", conditional_put, ("auto", "native", "emulate"))
        self._cond_mode: str | None = None if self.conditional_put == "auto" else self.conditional_put
        self._match_ignored = False  # the probe saw If-Match ignored: put_if_match emulates (racy, warned)
        self.payload_signing = _choice("payload_signing", payload_signing, ("auto", "always", "never"))
        self._init_runtime()

    # ---------------------------------------------------------------------------------------------- setup

    def _init_runtime(self) -> None:
        import botocore.config
        import botocore.exceptions

        self._bx = botocore.exceptions
        self._net_errors = _network_errors()
        self._lock = threading.Lock()
        self._tm = None
        access_key, secret_key, token = self._credentials.get()
        style = self.addressing
        if style == "auto":
            style = "path" if self.endpoint_url else "auto"
        cfg: dict[str, Any] = dict(
            signature_version="s3v4", connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout, max_pool_connections=self.max_pool_connections, tcp_keepalive=True,
            retries={"total_max_attempts": self.max_attempts, "mode": self.retry_mode},
            s3={"addressing_style": style, **self._payload_signing()},
        )
        try:
            config = botocore.config.Config(request_checksum_calculation="when_required",
                                            response_checksum_validation="when_required", **cfg)
        except TypeError:  # botocore < 1.36: no default checksums to turn off
            config = botocore.config.Config(**cfg)
        kwargs: dict[str, Any] = {}
        if access_key is not None:
            kwargs = dict(aws_access_key_id=access_key, aws_secret_access_key=secret_key)
            if token:
                kwargs["aws_session_token"] = token
        self._client, self._region = _make_client(self.profile, self.region, endpoint_url=self.endpoint_url,
                                                  verify=self.tls_verify, config=config, **kwargs)
        # adaptive mode rate-limits inside botocore's retry handler, which the lean GET does not go through
        self._lean = LeanGet.of(self._client, self.bucket) if self.retry_mode != "adaptive" else None
        self._match_quoted = False  # put_if_match: send the etag quoted (AWS) rather than bare (RGW 16)
        events = self._client.meta.events
        for op in _FENCED_OPS:
            events.register(f"before-parameter-build.s3.{op}", self._fence_keys, unique_id=f"tierfs-fence-keys-{op}")
            events.register(f"before-send.s3.{op}", self._fence_send, unique_id=f"tierfs-fence-send-{op}")

    def _fence_keys(self, params: dict, context: dict, model: Any = None, **kwargs: Any) -> None:
        """botocore hook: note the store-relative keys of a mutating request for `_fence_send`."""
        if self.fence is None:
            return
        fulls = [o.get("Key", "") for o in (params.get("Delete") or {}).get("Objects", [])] \
            if "Delete" in params else [params.get("Key", "")]
        cut = len(self._kprefix)
        keys = [f[cut:] if f.startswith(self._kprefix) else f for f in fulls]
        if keys and not all(k.startswith(_PROBE) for k in keys):
            context["tierfs_fence"] = (getattr(model, "name", "write"), keys)

    def _fence_send(self, request: Any, **kwargs: Any) -> None:
        """botocore hook, before each attempt of a mutating request: the fence decides now, after every wait."""
        noted = (getattr(request, "context", None) or {}).get("tierfs_fence")
        if noted is not None:
            self._fence(*noted)

    def _payload_signing(self) -> dict[str, bool]:
        """Does an upload's SigV4 signature cover a SHA-256 of its body? The hash costs about as much CPU per
        uploaded byte as lz4 compression. Without it (UNSIGNED-PAYLOAD) the signature still covers the method,
        key, headers and metadata, but not the bytes: whoever can alter the traffic in flight can alter what is
        stored (upload.verify=full reads every object back and checks its crc32c, which catches corruption, not
        a forger). 'auto' leaves it out where nobody else is in the path: verified TLS (which protects the body
        itself), or an endpoint on this host's loopback (reaching that traffic needs this host already). botocore
        only leaves it out by itself when a checksum header is sent, which the settings above turn off for older
        servers, hence the explicit setting."""
        if self.payload_signing != "auto":
            return {"payload_signing_enabled": self.payload_signing == "always"}
        https = self.endpoint_url is None or self.endpoint_url.lower().startswith("https://")
        if (https and self.tls_verify is not False) or _is_loopback(self.endpoint_url):
            return {"payload_signing_enabled": False}
        return {}

    def _transfer_manager(self):
        with self._lock:
            if self._tm is None:
                from boto3.s3.transfer import TransferConfig, create_transfer_manager

                tc = TransferConfig(multipart_threshold=self.multipart_threshold,
                                    multipart_chunksize=self.multipart_part_size,
                                    max_concurrency=self.multipart_concurrency, use_threads=True,
                                    preferred_transfer_client="classic")
                self._tm = create_transfer_manager(self._client, tc)
            return self._tm

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_client", "_tm", "_lock", "_bx", "_net_errors", "_region", "_lean", "fence")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        ep = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3ObjectStore({self.url!r}{ep}, region={self._region!r})"

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def atomic_put_if_absent(self) -> bool:  # type: ignore[override]
        return self._cond_mode != "emulate"

    def close(self) -> None:
        with self._lock:
            tm, self._tm = self._tm, None
        if tm is not None:
            tm.shutdown()
        try:
            self._client.close()
        except AttributeError:
            pass

    # ---------------------------------------------------------------------------------------------- helpers

    def _full(self, key: str) -> str:
        return self._kprefix + validate_key(key)

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._kprefix}{key}"

    def _translate(self, e: BaseException, key: str, op: str) -> ObjectStoreError:
        where = self._where(key)
        bx = self._bx
        if isinstance(e, ObjectStoreError):
            return e
        if isinstance(e, bx.ClientError):
            err = e.response.get("Error", {}) or {}
            code = str(err.get("Code", "") or "")
            msg = err.get("Message") or ""
            status = (e.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
            detail = f"{code or 'error'} (HTTP {status}){': ' + msg if msg else ''}"
            if code == "NoSuchBucket":
                return ObjectStoreError(key, f"{op} of {where} failed: bucket {self.bucket!r} does not exist "
                                             f"({detail})")
            if code in _NOT_FOUND_CODES or (status == 404 and code not in ("NoSuchUpload",)):
                return ObjectNotFound(key, where)
            if (isinstance(status, int) and (status >= 500 or status == 429)) or code in _TRANSIENT_CODES:
                return ObjectStoreUnavailable(key, detail, where, op)
            if code in _AUTH_CODES or status == 403:
                return ObjectStoreError(key, f"{op} of {where} was refused: {detail}; check the S3 credentials and "
                                             "their permissions on the bucket")
            return ObjectStoreError(key, f"{op} of {where} failed: {detail}")
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return ObjectStoreError(key, f"{op} of {where}: no usable S3 credentials ({type(e).__name__}); set "
                                         "access_key/secret_key or configure the standard AWS credential chain")
        if isinstance(e, bx.SSLError):
            return ObjectStoreError(key, f"{op} of {where}: TLS failure talking to the S3 endpoint ({e}); check "
                                         "tls_verify / the CA bundle")
        if isinstance(e, self._net_errors):
            return ObjectStoreUnavailable(key, e, where, op)
        return ObjectStoreError(key, f"{op} of {where} failed: {type(e).__name__}: {e}")

    def _call(self, op: str, key: str, fn, **kwargs):
        try:
            return fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - translated, original chained
            raise self._translate(e, key, op) from e

    @staticmethod
    def _strip_etag(etag: str | None) -> str | None:
        return etag.strip('"') if etag else etag

    @staticmethod
    def _response_time(resp: Mapping[str, Any]) -> float | None:
        date = (resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("date")
        if not date:
            return None
        try:
            return email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return None

    def _backoff(self, attempt: int) -> None:
        time.sleep(min(2.0, 0.05 * (2 ** attempt)) * random.random())

    # ---------------------------------------------------------------------------------------------- writing

    @staticmethod
    def _body(data: bytes | bytearray | memoryview) -> bytes | bytearray:
        if isinstance(data, (bytes, bytearray)):
            return data
        return memoryview(data).cast("B").tobytes()

    def put(self, key: str, data: bytes | bytearray | memoryview,
            metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        from . import crc32c_of

        full = self._full(key)
        body = self._body(data)
        meta = merge_crc32c(key, metadata, crc32c_of(body))
        if len(body) > self.multipart_threshold:
            return self._upload(key, io.BytesIO(body), len(body), meta)
        resp = self._call("put", key, self._client.put_object, Bucket=self.bucket, Key=full, Body=body,
                          Metadata=meta)
        return ObjectInfo(key, len(body), self._strip_etag(resp.get("ETag")), self._response_time(resp), meta)

    def put_file(self, key: str, path: str | os.PathLike, offset: int = 0, length: int | None = None, *,
                 metadata: Mapping[str, str] | None = None, crc32c: int | None = None) -> ObjectInfo:
        from . import crc32c_file

        self._full(key)
        merge_crc32c(key, metadata, crc32c)  # validate before any I/O
        n = source_length(key, path, offset, length)
        if crc32c is None:
            crc32c = crc32c_file(path, offset, n)
        meta = merge_crc32c(key, metadata, crc32c)
        whole = offset == 0 and os.stat(path).st_size == n
        source: Any = os.fspath(path) if whole else _FileWindow(path, offset, n)
        try:
            return self._upload(key, source, n, meta)
        finally:
            if not isinstance(source, str):
                source.close()

    compose_min_part = _MIN_PART

    def compose(self, key: str, sources: list[tuple[str, int, int]], *, crc32c: int,
                metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """ObjectStore.compose: a multipart upload whose parts are UploadPartCopy of the ranges (no byte goes
        through this process), created with the full metadata (the crc32c is known); `head` must then report the
        composed size. A failure aborts the upload."""
        full = self._full(key)
        meta = merge_crc32c(key, metadata, crc32c)
        size = self._check_compose(key, sources, _MIN_PART)
        resp = self._call("compose", key, self._client.create_multipart_upload, Bucket=self.bucket, Key=full,
                          Metadata=meta)
        upload_id = resp["UploadId"]
        try:
            parts = []
            for number, (src, off, n) in enumerate(sources, 1):
                part = self._call("compose", key, self._client.upload_part_copy, Bucket=self.bucket, Key=full,
                                  UploadId=upload_id, PartNumber=number,
                                  CopySource={"Bucket": self.bucket, "Key": self._full(src)},
                                  CopySourceRange=f"bytes={off}-{off + n - 1}")
                parts.append({"PartNumber": number, "ETag": part["CopyPartResult"]["ETag"]})
            self._call("compose", key, self._client.complete_multipart_upload, Bucket=self.bucket, Key=full,
                       UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.abort_multipart(key, upload_id)
            except ObjectStoreError as e:
                log.warning("compose: could not abort the upload of %s: %s", self._where(key), e)
            raise
        return self._head_checked(key, "compose", size, crc32c)

    def _head_checked(self, key: str, op: str, size: int, crc: int) -> ObjectInfo:
        """`head` of an object just made, which must report `size` and `crc` (else ObjectStoreError)."""
        info = self.head(key)
        if info is None or info.size != size or info.crc32c != crc:
            raise ObjectStoreError(key, f"{op} of {self._where(key)}: {size} bytes with crc32c "
                                        f"{format_crc32c(crc)} made, the store reports "
                                        f"{None if info is None else (info.size, info.metadata)}")
        return info

    def put_stream(self, key: str, chunks: Iterable[bytes | bytearray | memoryview], *,
                   metadata: Metadata = None, spool_dir: str | None = None) -> ObjectInfo:
        """ObjectStore.put_stream, uploading while `chunks` are produced: content of at most one part is one
        PutObject; more becomes a multipart upload whose parts (`multipart_part_size`) go out as soon as they are
        full, `multipart_concurrency` at a time (memory: part size x (concurrency + 1)).

        S3 takes an object's metadata when the upload is created, before the crc32c of the content is known, so
        the upload is created with the other metadata (none when `metadata` is a callable) and, once complete, the
        object gets its full metadata by a
        copy onto itself (MetadataDirective REPLACE: on RGW an attribute update, on S3 a server-side copy, up to
        5 GiB). `head` must then report the size and crc32c of what was sent; a failure aborts the upload or
        deletes the object. Until that copy, readers of `key` may see the new content without a crc32c.
        """
        from . import crc32c_of

        full = self._full(key)
        meta = {} if callable(metadata) else merge_crc32c(key, metadata, None)
        meta.pop(CRC32C_META, None)
        part = self.multipart_part_size
        buf = bytearray()
        crc = size = 0
        upload_id: str | None = None
        done: list[dict] = []
        inflight: collections.deque = collections.deque()
        pool = None

        def send(number: int, body: bytes) -> dict:
            resp = self._call("put_stream", key, self._client.upload_part, Bucket=self.bucket, Key=full,
                              UploadId=upload_id, PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": resp["ETag"]}

        def submit(body: bytes) -> None:
            nonlocal upload_id, pool
            if upload_id is None:
                resp = self._call("put_stream", key, self._client.create_multipart_upload, Bucket=self.bucket,
                                  Key=full, Metadata=meta)
                upload_id = resp["UploadId"]
                pool = concurrent.futures.ThreadPoolExecutor(self.multipart_concurrency,
                                                             thread_name_prefix="tierfs-s3-part")
            while len(inflight) >= self.multipart_concurrency:
                done.append(inflight.popleft().result())
            inflight.append(pool.submit(send, len(done) + len(inflight) + 1, body))

        completed = False
        try:
            for chunk in chunks:
                crc = crc32c_of(chunk, crc)
                size += len(chunk)
                buf += chunk
                while len(buf) > part:  # a full part, and at least one byte after it
                    if size > _MAX_PART:
                        raise ObjectStoreError(key, f"put_stream of {self._where(key)}: more than {_MAX_PART} bytes "
                                                    f"(the limit of CopyObject, which sets the crc32c metadata)")
                    submit(bytes(buf[:part]))
                    del buf[:part]
            final = merge_crc32c(key, metadata() if callable(metadata) else metadata, crc)
            if upload_id is None:
                return self.put(key, bytes(buf), metadata=final)
            submit(bytes(buf))
            buf = bytearray()
            while inflight:
                done.append(inflight.popleft().result())
            self._call("put_stream", key, self._client.complete_multipart_upload, Bucket=self.bucket, Key=full,
                       UploadId=upload_id, MultipartUpload={"Parts": sorted(done, key=lambda p: p["PartNumber"])})
            completed = True
            self._call("put_stream", key, self._client.copy_object, Bucket=self.bucket, Key=full,
                       CopySource={"Bucket": self.bucket, "Key": full}, Metadata=final,
                       MetadataDirective="REPLACE")
            return self._head_checked(key, "put_stream", size, crc)
        except BaseException:
            for fut in inflight:
                fut.cancel()
            if completed:
                try:
                    self.delete(key)
                except ObjectStoreError as e:
                    log.warning("put_stream: could not remove %s after a failure: %s", self._where(key), e)
            elif upload_id is not None:
                try:
                    self.abort_multipart(key, upload_id)
                except ObjectStoreError as e:
                    log.warning("put_stream: could not abort the upload of %s: %s", self._where(key), e)
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _upload(self, key: str, source: Any, size: int, meta: dict[str, str]) -> ObjectInfo:
        full = self._full(key)
        tm = self._transfer_manager()
        try:
            future = tm.upload(source, self.bucket, full, extra_args={"Metadata": meta})
            future.result()
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, key, "put_file") from e
        info = self.head(key)
        if info is None or info.size != size:
            raise ObjectStoreError(key, f"put_file of {self._where(key)}: uploaded {size} bytes but the store "
                                        f"reports {None if info is None else info.size}")
        return info

    # ---------------------------------------------------------------------------------------------- conditional put

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview,
                      metadata: Mapping[str, str] | None = None) -> bool:
        from . import crc32c_of

        full = self._full(key)
        body = self._body(data)
        meta = merge_crc32c(key, metadata, crc32c_of(body))
        if self._cond_mode is None:
            self._probe_conditional_put(key)
        if self._cond_mode == "emulate":
            return self._emulated_put_if_absent(key, full, body, meta)
        token = secrets.token_hex(8)
        last: BaseException | None = None
        for attempt in range(self.max_attempts + 2):
            try:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*",
                                        Metadata={**meta, _TOKEN_META: token})
                return True
            except self._bx.ParamValidationError as e:  # botocore too old to know IfNoneMatch
                self._use_emulation(f"this botocore cannot send If-None-Match ({e})")
                return self._emulated_put_if_absent(key, full, body, meta)
            except self._bx.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412 or code == "PreconditionFailed":
                    # Someone has the key. If it is us (an earlier attempt succeeded but its answer was lost and
                    # botocore retried), the stored token is ours.
                    raw = self._head_raw(key)
                    return raw is not None and (raw.get("Metadata") or {}).get(_TOKEN_META) == token
                if status == 409 or code in ("ConditionalRequestConflict", "OperationAborted"):
                    last = e
                    self._backoff(attempt)
                    continue
                if status == 501 or code == "NotImplemented":
                    self._use_emulation(f"the server answered {code or status} to If-None-Match")
                    return self._emulated_put_if_absent(key, full, body, meta)
                raise self._translate(e, key, "put_if_absent") from e
            except Exception as e:  # noqa: BLE001
                raise self._translate(e, key, "put_if_absent") from e
        raise ObjectStoreUnavailable(key, last or "conditional write kept conflicting", self._where(key),
                                     "put_if_absent")

    def _probe_conditional_put(self, key: str) -> None:
        """Once per store: does the server honour If-None-Match: * on PUT? (501, or silently ignoring it -> no)."""
        with self._lock:
            if self._cond_mode is not None:
                return
            probe = f"{self._kprefix}{_PROBE}{uuid.uuid4().hex}"
            try:
                for i in range(2):
                    try:
                        self._client.put_object(Bucket=self.bucket, Key=probe, Body=b"probe", IfNoneMatch="*")
                    except self._bx.ParamValidationError as e:
                        self._use_emulation(f"this botocore cannot send If-None-Match ({e})")
                        return
                    except self._bx.ClientError as e:
                        code = str(e.response.get("Error", {}).get("Code", ""))
                        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                        if i == 1 and (status == 412 or code == "PreconditionFailed"):
                            self._cond_mode = "native"
                            self._probe_if_match(probe)
                            return
                        if status == 501 or code == "NotImplemented":
                            self._use_emulation(f"the server answered {code or status} to If-None-Match")
                            return
                        raise self._translate(e, key, "put_if_absent (conditional write probe)") from e
                    except Exception as e:  # noqa: BLE001
                        raise self._translate(e, key, "put_if_absent (conditional write probe)") from e
                self._use_emulation("the server ignored If-None-Match (a second conditional PUT of an existing "
                                    "key succeeded)")
            finally:
                try:
                    self._client.delete_object(Bucket=self.bucket, Key=probe)
                except Exception:  # noqa: BLE001 - best effort
                    pass

    def _probe_if_match(self, probe: str) -> None:
        """Part of the probe: a PUT with If-Match of an etag the probe object does not have must be refused."""
        try:
            self._client.put_object(Bucket=self.bucket, Key=probe, Body=b"probe", IfMatch="tierfs-no-such-etag")
        except self._bx.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                return
            raise self._translate(e, probe, "put_if_match (conditional write probe)") from e
        self._match_ignored = True
        log.warning("S3 object store %s: the server ignores If-Match on PUT; put_if_match falls back to a "
                    "best-effort HEAD, compare, PUT, which concurrent writers can race", self.url)

    def _use_emulation(self, why: str) -> None:
        self._cond_mode = "emulate"
        ident = f"{self.endpoint_url or 'aws'}/{self.bucket}"
        with _warn_lock:
            if ident in _warned_emulation:
                return
            _warned_emulation.add(ident)
        log.warning("S3 object store %s: conditional writes unavailable (%s); put_if_absent falls back to a "
                    "best-effort HEAD then PUT, which concurrent writers can race", self.url, why)

    def put_if_match(self, key: str, data: bytes | bytearray | memoryview, etag: str | None,
                     metadata: Mapping[str, str] | None = None) -> str | None:
        """ObjectStore.put_if_match: one conditional PutObject (If-Match, or If-None-Match: * when `etag` is None).
        A 412 is told apart from our own earlier attempt that succeeded (its answer lost, botocore retried) by a
        token in the metadata, and from RGW's bare-etag quirk (see the module docstring) by the etag it still
        has. A server without conditional writes gets a best-effort HEAD, compare, PUT (warned once)."""
        from . import crc32c_of

        full = self._full(key)
        body = self._body(data)
        meta = merge_crc32c(key, metadata, crc32c_of(body))
        if self._cond_mode is None:
            self._probe_conditional_put(key)
        if self._cond_mode == "emulate" or self._match_ignored:
            cur = self.head(key)
            if (cur.etag if cur is not None else None) != etag:
                return None
            return self.put(key, body, metadata=meta).etag
        token = secrets.token_hex(8)
        flipped = False
        for attempt in range(self.max_attempts + 2):
            cond = {"IfNoneMatch": "*"} if etag is None else {
                "IfMatch": f'"{etag}"' if self._match_quoted else etag}
            try:
                resp = self._client.put_object(Bucket=self.bucket, Key=full, Body=body,
                                               Metadata={**meta, _TOKEN_META: token}, **cond)
                return self._strip_etag(resp.get("ETag"))
            except self._bx.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412 or code == "PreconditionFailed":
                    raw = self._head_raw(key)
                    if raw is not None and (raw.get("Metadata") or {}).get(_TOKEN_META) == token:
                        return self._strip_etag(raw.get("ETag"))  # ours: an earlier attempt's answer was lost
                    if etag is not None and raw is not None and self._strip_etag(raw.get("ETag")) == etag \
                            and not flipped:
                        flipped = True  # the condition holds, yet the server refused this form of the etag
                        self._match_quoted = not self._match_quoted
                        continue
                    return None
                if status == 409 or code in ("ConditionalRequestConflict", "OperationAborted"):
                    self._backoff(attempt)
                    continue
                raise self._translate(e, key, "put_if_match") from e
            except Exception as e:  # noqa: BLE001
                raise self._translate(e, key, "put_if_match") from e
        raise ObjectStoreUnavailable(key, "conditional write kept conflicting", self._where(key), "put_if_match")

    def _emulated_put_if_absent(self, key: str, full: str, body: bytes | bytearray, meta: dict[str, str]) -> bool:
        if self._head_raw(key) is not None:
            return False
        self._call("put_if_absent", key, self._client.put_object, Bucket=self.bucket, Key=full, Body=body,
                   Metadata=meta)
        return True

    # ---------------------------------------------------------------------------------------------- reading

    def _read_body(self, resp: Mapping[str, Any]) -> bytes:
        body = resp["Body"]
        try:
            return body.read()
        finally:
            body.close()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        full = self._full(key)
        check_range(key, start, length)
        if length == 0:
            return b""
        if self._lean is not None:
            return self._lean_get(key, full, start, length, None)
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            resp = self._get_ranged(key, full, start, length)
            try:
                data = self._read_body(resp)
            except self._net_errors as e:  # body broke mid-stream: botocore does not retry that, we do
                last = e
                self._backoff(attempt)
                continue
            got = self._ranged_content(key, resp, data, start, length)
            if got is not None:
                return got
            last = ObjectStoreError(key, f"short read: {len(data)} of {length} bytes")
            self._backoff(attempt)
        raise ObjectStoreUnavailable(key, last or "short reads", self._where(key), "get_range")

    def get_range_into(self, key: str, start: int, bufs: Sequence[memoryview],
                       progress: Callable[[int], None] | None = None) -> None:
        """As the base class says: a 206 answer of the expected length, not content-encoded, is read from the HTTP
        response straight into the buffers (`readinto` on http.client's response under urllib3's), no bytes
        object in between; any other answer takes get_range's path and is copied. Over the lean GET unless
        retry_mode is 'adaptive'; there `progress` is called as each buffer fills, and a retry asks only for the
        bytes after the last buffer reported (the boto3 path never calls it)."""
        length = sum(len(b) for b in bufs)
        full = self._full(key)
        check_range(key, start, length)
        if length == 0:
            return
        if self._lean is not None:
            self._lean_get(key, full, start, length, bufs, progress)
            return
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            resp = self._get_ranged(key, full, start, length)
            fp = self._plain_body(resp, length)
            try:
                if fp is not None:
                    got = readinto_plain(Answer(206, {}, resp["Body"]._raw_stream), fp, bufs)
                    if got == length:
                        return
                    raise ObjectStoreError(key, f"short read: {got} of {length} bytes")
                data = self._read_body(resp)
            except (ObjectStoreError, *self._net_errors) as e:  # body broke mid-stream: retried
                last = e
                self._backoff(attempt)
                continue
            content = self._ranged_content(key, resp, data, start, length)
            if content is not None:
                view, pos = memoryview(content), 0
                for b in bufs:
                    b[:] = view[pos:pos + len(b)]
                    pos += len(b)
                return
            last = ObjectStoreError(key, f"short read: {len(data)} of {length} bytes")
            self._backoff(attempt)
        raise ObjectStoreUnavailable(key, last or "short reads", self._where(key), "get_range")

    def _lean_get(self, key: str, full: str, start: int, length: int, bufs: Sequence[memoryview] | None,
                  progress: Callable[[int], None] | None = None) -> bytes | None:
        """get_range (bufs None: the bytes) or get_range_into over LeanGet. The store does the retrying here:
        transport failures, answers that map to ObjectStoreUnavailable (5xx, 429, throttling) and bodies that break
        or end short are tried again, up to max_attempts in all, with backoff; every other answer raises what the
        boto3 path raises for it. A 206 of the expected length is read in one copy (into `bufs`, or one bytes
        object); any other 2xx is read whole and cut as get_range's boto3 path cuts it. Buffers that filled are
        reported through `progress` and never written again: a retry asks for the bytes after them."""
        last: BaseException | None = None
        done = 0  # bufs[:done] are filled and reported
        whole_start, whole_length = start, length

        def filled() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(done)

        for attempt in range(self.max_attempts):
            if attempt:
                self._backoff(attempt - 1)
            if done:
                skip = sum(len(b) for b in bufs[:done])
                start, length = whole_start + skip, whole_length - skip
            try:
                answer = self._lean.open(full, start, length)
            except Exception as e:  # noqa: BLE001 - translated, original chained
                err = self._range_error(e, key, start, length)
                if not isinstance(err, ObjectStoreUnavailable):
                    raise err from e
                last = err
                continue
            try:
                fp = answer.plain_fp(length)
                if fp is not None:
                    if bufs is None:
                        return read_plain(answer, fp)
                    got = readinto_plain(answer, fp, bufs[done:], filled)
                    if got == length:
                        return None
                    last = ObjectStoreError(key, f"short read: {got} of {length} bytes")
                    continue
                data = answer.read_all()
            except (http.client.HTTPException, *self._net_errors) as e:  # body broke mid-stream or ended short
                last = e
                continue
            meta = {"ResponseMetadata": {"HTTPStatusCode": answer.status},
                    "ContentRange": answer.headers.get("content-range")}
            content = self._ranged_content(key, meta, data, start, length)
            if content is None:
                last = ObjectStoreError(key, f"short read: {len(data)} of {length} bytes")
                continue
            if bufs is None:
                return content
            view, pos = memoryview(content), 0
            for b in bufs[done:]:
                b[:] = view[pos:pos + len(b)]
                pos += len(b)
            return None
        if isinstance(last, ObjectStoreUnavailable):
            raise last
        raise ObjectStoreUnavailable(key, last or "short reads", self._where(key), "get_range")

    def _range_error(self, e: BaseException, key: str, start: int, length: int) -> ObjectStoreError:
        """The store's error for a failed ranged GET: 416 / InvalidRange -> ObjectRangeError, else _translate."""
        if isinstance(e, self._bx.ClientError):
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 416 or e.response.get("Error", {}).get("Code") == "InvalidRange":
                return ObjectRangeError(key, start, length, self._size_from_error(e), self._where(key))
        return self._translate(e, key, "get_range")

    def _get_ranged(self, key: str, full: str, start: int, length: int) -> Mapping[str, Any]:
        """One ranged GetObject; its body is still to be read. 416 / InvalidRange -> ObjectRangeError."""
        try:
            return self._client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}")
        except Exception as e:  # noqa: BLE001
            err = self._range_error(e, key, start, length)
            raise err from (None if isinstance(err, ObjectRangeError) else e)

    def _ranged_content(self, key: str, resp: Mapping[str, Any], data: bytes, start: int,
                        length: int) -> bytes | None:
        """The requested bytes out of a ranged GET's whole body, None for a short read worth retrying; a range
        past the object's end raises ObjectRangeError."""
        if len(data) == length:
            return data
        total = self._total_size(resp)
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 200 and len(data) >= start + length:  # server ignored Range: whole object came back
            return data[start:start + length]
        if total is not None and total < start + length:
            raise ObjectRangeError(key, start, length, total, self._where(key))
        if status == 200 and total is None and len(data) < start + length:
            raise ObjectRangeError(key, start, length, len(data), self._where(key))
        return None

    @staticmethod
    def _plain_body(resp: Mapping[str, Any], length: int) -> Any:
        """The http.client response under a 206 answer of exactly `length` plain bytes, else None (then the body
        is read the usual way). botocore and urllib3 keep it in attributes of theirs: checked, never assumed."""
        if resp.get("ResponseMetadata", {}).get("HTTPStatusCode") != 206 or resp.get("ContentLength") != length:
            return None
        raw = getattr(resp["Body"], "_raw_stream", None)
        fp = getattr(raw, "_fp", None)
        if fp is None or not callable(getattr(fp, "readinto", None)) or not callable(getattr(raw, "release_conn", None)):
            return None
        if (raw.headers.get("content-encoding") or "identity").lower() != "identity":
            return None
        return fp

    def _size_from_error(self, e) -> int | None:
        headers = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}
        m = _CONTENT_RANGE.match(headers.get("content-range", "") or "")
        if m and m.group(3) != "*":
            return int(m.group(3))
        size = e.response.get("Error", {}).get("ActualObjectSize")
        try:
            return int(size) if size is not None else None
        except ValueError:
            return None

    @staticmethod
    def _total_size(resp: Mapping[str, Any]) -> int | None:
        m = _CONTENT_RANGE.match(resp.get("ContentRange") or "")
        if m and m.group(3) != "*":
            return int(m.group(3))
        return None

    def get(self, key: str) -> bytes:
        full = self._full(key)
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            resp = self._call("get", key, self._client.get_object, Bucket=self.bucket, Key=full)
            try:
                data = self._read_body(resp)
            except self._net_errors as e:
                last = e
                self._backoff(attempt)
                continue
            expected = resp.get("ContentLength")
            if expected is None or len(data) == expected:
                return data
            last = ObjectStoreError(key, f"short read: {len(data)} of {expected} bytes")
            self._backoff(attempt)
        raise ObjectStoreUnavailable(key, last or "short reads", self._where(key), "get")

    def _head_raw(self, key: str) -> dict[str, Any] | None:
        full = self._full(key)
        try:
            return self._client.head_object(Bucket=self.bucket, Key=full)
        except Exception as e:  # noqa: BLE001
            err = self._translate(e, key, "head")
            if type(err) is ObjectNotFound:
                return None
            raise err from e

    def head(self, key: str) -> ObjectInfo | None:
        resp = self._head_raw(key)
        if resp is None:
            return None
        meta = {k: v for k, v in (resp.get("Metadata") or {}).items() if k != _TOKEN_META}
        lm = resp.get("LastModified")
        return ObjectInfo(key, int(resp.get("ContentLength", 0)), self._strip_etag(resp.get("ETag")),
                          lm.timestamp() if lm is not None else None, meta)

    # ---------------------------------------------------------------------------------------------- deleting

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=full)
        except Exception as e:  # noqa: BLE001
            err = self._translate(e, key, "delete")
            if type(err) is not ObjectNotFound:
                raise err from e

    def delete_many(self, keys: Iterable[str]) -> None:
        fulls = [(k, self._full(k)) for k in keys]
        for i in range(0, len(fulls), 1000):
            batch = fulls[i:i + 1000]
            resp = self._call("delete_many", batch[0][0], self._client.delete_objects, Bucket=self.bucket,
                              Delete={"Objects": [{"Key": f} for _, f in batch], "Quiet": True})
            errors = [e for e in resp.get("Errors", []) if e.get("Code") not in _NOT_FOUND_CODES]
            if errors:
                first = errors[0]
                fk = first.get("Key", "")
                key = fk[len(self._kprefix):] if fk.startswith(self._kprefix) else fk
                raise ObjectStoreError(key, f"delete_many: {len(errors)} of {len(batch)} deletes failed; first: "
                                            f"{self._where(key)}: {first.get('Code')}: {first.get('Message')}")

    # ---------------------------------------------------------------------------------------------- listing

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        kwargs: dict[str, Any] = dict(Bucket=self.bucket, Prefix=self._kprefix + prefix, MaxKeys=self.list_page_size)
        cut = len(self._kprefix)
        while True:
            resp = self._call("list", prefix, self._client.list_objects_v2, **kwargs)
            for item in resp.get("Contents", []) or []:
                lm = item.get("LastModified")
                yield ObjectInfo(item["Key"][cut:], int(item.get("Size", 0)), self._strip_etag(item.get("ETag")),
                                 lm.timestamp() if lm is not None else None, None)
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return
            kwargs["ContinuationToken"] = token

    def list_multipart_uploads(self, prefix: str = "") -> Iterator[MultipartUpload]:
        validate_prefix(prefix)
        return self._list_uploads(prefix)

    def _list_uploads(self, prefix: str) -> Iterator[MultipartUpload]:
        kwargs: dict[str, Any] = dict(Bucket=self.bucket, Prefix=self._kprefix + prefix,
                                      MaxUploads=self.list_page_size)
        cut = len(self._kprefix)
        while True:
            resp = self._call("list_multipart_uploads", prefix, self._client.list_multipart_uploads, **kwargs)
            for up in resp.get("Uploads", []) or []:
                ini = up.get("Initiated")
                yield MultipartUpload(up["Key"][cut:], up["UploadId"], ini.timestamp() if ini is not None else None)
            if not resp.get("IsTruncated"):
                return
            kwargs["KeyMarker"] = resp.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = resp.get("NextUploadIdMarker", "")
            if not kwargs["KeyMarker"] and not kwargs["UploadIdMarker"]:
                return

    def abort_multipart(self, key: str, upload_id: str) -> None:
        full = self._full(key)
        if not upload_id or not isinstance(upload_id, str):
            raise ValueError(f"object key {key!r}: upload id {upload_id!r} is empty")
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, self._bx.ClientError) and (
                    e.response.get("Error", {}).get("Code") in ("NoSuchUpload", "NoSuchKey")
                    or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404):
                return
            raise self._translate(e, key, "abort_multipart") from e
