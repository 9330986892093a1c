"""A lean ranged GET for S3ObjectStore: the cold-read path's one request, without botocore's request machinery.

botocore builds, signs and parses every GetObject through its event system (~0.5-1 ms of CPU per request, about
as much as receiving 2-4 MiB). This path asks the same client for a presigned URL (the same credentials, refreshed
the same way; the same endpoint, region and addressing style; the Range header is not part of a query-string
signature) and sends it over the client's own HTTP session (the same connection pool, proxies and TLS
verification). Non-2xx answers become botocore ClientErrors built from the S3 XML error body, so the store maps
them exactly as it maps the answers of boto3 calls. Retries are the store's (S3ObjectStore._lean_get).
"""

from __future__ import annotations

import http.client
import xml.etree.ElementTree as ET
from typing import Any, Callable, Sequence

PRESIGN_SECONDS = 900  # a URL is used at once; this only bounds clock skew and slow connection setup
_ERROR_BODY_MAX = 64 * 1024  # an S3 error document is small; a huge non-2xx body is not read whole


class Answer:
    """An open 2xx answer: its status, lower-cased headers and the urllib3 response whose body is still unread."""

    __slots__ = ("status", "headers", "raw")

    def __init__(self, status: int, headers: dict[str, str], raw: Any):
        self.status, self.headers, self.raw = status, headers, raw

    @property
    def content_length(self) -> int | None:
        try:
            return int(self.headers["content-length"])
        except (KeyError, ValueError):
            return None

    def plain_fp(self, length: int) -> Any:
        """The http.client response under a 206 answer of exactly `length` identity-encoded bytes, else None."""
        if self.status != 206 or self.content_length != length:
            return None
        if (self.headers.get("content-encoding") or "identity").lower() != "identity":
            return None
        fp = getattr(self.raw, "_fp", None)
        if not isinstance(fp, http.client.HTTPResponse):
            return None
        return fp

    def read_all(self) -> bytes:
        """The whole body (any status, any length): the fallback path."""
        try:
            return self.raw.read()
        finally:
            self.close(self.raw.isclosed() if hasattr(self.raw, "isclosed") else False)

    def close(self, reusable: bool) -> None:
        """Give the connection back to the pool when its body was read to the end, else close it."""
        if reusable:
            self.raw.release_conn()
        else:
            self.raw.close()


def readinto_plain(answer: Answer, fp: http.client.HTTPResponse, bufs: Sequence[memoryview],
                   filled: Callable[[], None] | None = None) -> int:
    """Read a plain answer's body straight into `bufs` (no bytes object in between), calling `filled()` as each
    buffer is full; the bytes read."""
    got = 0
    whole = False
    try:
        for b in bufs:
            while len(b):
                n = fp.readinto(b)
                if not n:
                    return got
                got += n
                b = b[n:]
            if filled is not None:
                filled()
        whole = fp.isclosed()  # http.client closes its file once Content-Length bytes were read
        return got
    finally:
        answer.close(whole)


def read_plain(answer: Answer, fp: http.client.HTTPResponse) -> bytes:
    """A plain answer's whole body as one bytes object, read in one copy (IncompleteRead if it ends short)."""
    whole = False
    try:
        data = fp.read()
        whole = fp.isclosed()
        return data
    finally:
        answer.close(whole)


def _without_query(e: Exception, url: str) -> Exception:
    """`e` with the presigned URL cut to its path: its query holds the signature and any session token, and
    botocore's network errors name the URL they failed on (these messages reach the log)."""
    import botocore.exceptions

    base, _, query = url.partition("?")
    kwargs = getattr(e, "kwargs", None)
    if isinstance(e, botocore.exceptions.BotoCoreError) and isinstance(kwargs, dict):
        try:
            clean = type(e)(**{k: (base if v == url else None if k == "request" else v) for k, v in kwargs.items()})
        except Exception:  # noqa: BLE001 - an unexpected signature: fall through to the generic form
            clean = None
        if clean is not None and query not in str(clean):
            return clean
    if not query or query not in str(e):
        return e
    return botocore.exceptions.HTTPClientError(error=str(e).replace(query, "<signed query>"))


class LeanGet:
    """Ranged GETs of one bucket through `client`'s presigner and HTTP session (see the module docstring)."""

    def __init__(self, client: Any, session: Any, bucket: str):
        import botocore.awsrequest
        import botocore.exceptions

        self._presign = client.generate_presigned_url
        self._session = session
        self._bucket = bucket
        self._request = botocore.awsrequest.AWSRequest
        self._client_error = botocore.exceptions.ClientError

    @classmethod
    def of(cls, client: Any, bucket: str) -> "LeanGet | None":
        """A LeanGet sharing `client`'s HTTP session, or None when this botocore keeps it elsewhere."""
        session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        if not callable(getattr(session, "send", None)):
            return None
        return cls(client, session, bucket)

    def open(self, full_key: str, start: int, length: int) -> Answer:
        """Send GET `full_key` bytes [start, start+length): the open 2xx answer; a non-2xx answer raises
        botocore's ClientError (as boto3's get_object would), a transport failure botocore's network errors."""
        url = self._presign("get_object", Params={"Bucket": self._bucket, "Key": full_key},
                            ExpiresIn=PRESIGN_SECONDS)
        req = self._request(method="GET", url=url, headers={"Range": f"bytes={start}-{start + length - 1}"})
        req.stream_output = True
        try:
            resp = self._session.send(req.prepare())
        except Exception as e:  # noqa: BLE001 - re-raised, without the URL's signature
            raise _without_query(e, url) from None
        raw = resp.raw
        headers = {k.lower(): v for k, v in resp.headers.items()}
        if 200 <= resp.status_code < 300:
            return Answer(resp.status_code, headers, raw)
        raise self._error(resp.status_code, headers, raw)

    def _error(self, status: int, headers: dict[str, str], raw: Any) -> Exception:
        """The ClientError boto3 would raise for this answer (code and message from the XML error body)."""
        body = b""
        try:
            body = raw.read(_ERROR_BODY_MAX + 1)
        except Exception:  # noqa: BLE001 - the status alone still maps the error
            pass
        finally:
            raw.close()
        code, message = str(status), http.client.responses.get(status, "")
        if body and len(body) <= _ERROR_BODY_MAX:
            try:
                root = ET.fromstring(body)
                code = root.findtext("Code") or code
                message = root.findtext("Message") or message
            except ET.ParseError:
                pass
        response = {"Error": {"Code": code, "Message": message},
                    "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers}}
        return self._client_error(response, "GetObject")
