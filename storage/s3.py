"""A store on S3-compatible object storage (s3://bucket/prefix) through s3fs: exclusive creates by PUT with
`If-None-Match: *`, the standard AWS credential chain, and one-line errors that never carry a secret."""
from __future__ import annotations

import inspect
import logging
import os
import re
import threading
import uuid
from typing import Any

from ..errors import DflashError, StoreError, StoreUnavailable
from .fs import PARTIAL_SUFFIX, FsspecFS, writer_tag

__all__ = ["S3FS", "open_s3", "redact", "INSTALL_HINT"]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'dflash[s3]'"
# Connection failures fail within seconds (botocore's defaults retry an unreachable endpoint for minutes);
# throttling and 5xx answers are still retried in standard mode.
_CLIENT_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}}
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")

# botocore says at INFO where it found credentials and the endpoint, on every client: quiet unless asked for.
for _name in ("botocore", "aiobotocore", "s3fs"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.WARNING)

_opened: dict[str, "S3FS"] = {}
_opened_lock = threading.Lock()


def _secrets() -> list[str]:
    """Return the credential strings this process may send (environment and the resolved AWS chain)."""
    found = [os.environ.get(k, "") for k in _CREDENTIAL_ENV]
    try:
        import botocore.session

        creds = botocore.session.Session().get_credentials()
        if creds is not None:
            frozen = creds.get_frozen_credentials()
            found += [frozen.access_key or "", frozen.secret_key or "", frozen.token or ""]
    except Exception:  # no chain to resolve: the environment's strings are all we can know
        pass
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def redact(text: str) -> str:
    """Return text with every credential string of this process and any user:password@ of a URL masked."""
    for s in _secrets():
        text = text.replace(s, "***")
    return _USERINFO.sub("***@", text)


def open_s3(url: str) -> "S3FS":
    """Return the file access of an s3:// store (one per URL and process, so the server is probed once)."""
    with _opened_lock:
        fs = _opened.get(url)
        if fs is None or fs.pid != os.getpid():
            fs = _opened[url] = S3FS(url)
        return fs


class S3FS(FsspecFS):
    """A store under s3://bucket/prefix. A PUT is atomic, so the commit record written last is what makes a shard
    real, as on disk; claims are PUTs with `If-None-Match: *`, and a server that ignores that condition is refused
    (two writers could both win a claim), never served by a check-then-write fallback."""

    def __init__(self, url: str) -> None:
        self.pid = os.getpid()
        self.url = _USERINFO.sub("", url).rstrip("/")
        m = re.fullmatch(r"s3://([^/]+)/(.+)", self.url)
        if not m:
            raise StoreError(f"{self.url}: expected s3://BUCKET/PREFIX (a store takes a prefix of its own, never a "
                             "whole bucket); rerun with e.g. s3://my-bucket/stores/qwen3-8b")
        self.bucket, self.root = m.group(1), f"{m.group(1)}/{m.group(2).strip('/')}"
        try:
            import s3fs
        except ImportError:
            raise StoreError(f"{self.url}: an s3:// store needs the S3 client s3fs, which is not installed; "
                             f"install it with `{INSTALL_HINT}`") from None
        if "mode" not in inspect.signature(s3fs.S3FileSystem._pipe_file).parameters:
            raise StoreError(f"{self.url}: s3fs {s3fs.__version__} cannot create an object only where none exists "
                             "(PUT with If-None-Match: *), which claims need; upgrade it with "
                             f"`pip install -U 'dflash[s3]'` (s3fs >= 2024.12)")
        # No listings cache: a follower lists commits/ again and again and must see new records.
        self.fs = s3fs.S3FileSystem(use_listings_cache=False, skip_instance_cache=True, config_kwargs=_CLIENT_CONFIG)
        self._conditional: bool | None = None
        self._lock = threading.Lock()
        self._guard(lambda: self.fs.call_s3("head_bucket", Bucket=self.bucket), "", ())

    # -- errors --------------------------------------------------------------------------------------------------
    def endpoint(self) -> str:
        """Return the endpoint the client talks to (AWS_ENDPOINT_URL, a profile's endpoint_url, or AWS's own)."""
        client = getattr(self.fs, "_s3", None)
        url = getattr(getattr(client, "meta", None), "endpoint_url", None)
        return _USERINFO.sub("", url) if url else "the default AWS endpoint"

    def _error(self, e: BaseException, rel: str) -> DflashError:
        """Return the one-line StoreError of a failed S3 request (no secret in it): StoreUnavailable where the
        endpoint, the credentials or the bucket is the cause."""
        where, name = self.display(rel), type(e).__name__
        text = redact(" ".join(str(e).split()))
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) if hasattr(e, "response") else ""
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return StoreUnavailable(f"{where}: no usable AWS credentials (expected AWS_ACCESS_KEY_ID and "
                                    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials); set them and rerun")
        if isinstance(e, PermissionError) or code in ("403", "AccessDenied", "InvalidAccessKeyId",
                                                      "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
            return StoreUnavailable(f"{where}: the S3 server at {self.endpoint()} refused the request (expected "
                                    f"credentials allowed to read and write bucket {self.bucket}, found: "
                                    f"{text[:160]}); check AWS_ACCESS_KEY_ID / AWS_PROFILE and the bucket's policy, "
                                    "then rerun")
        if isinstance(e, FileNotFoundError) and not rel:
            return StoreUnavailable(f"{where}: bucket {self.bucket!r} does not exist at {self.endpoint()} (dflash "
                                    f"never creates buckets); create it with `aws s3 mb s3://{self.bucket}` or fix "
                                    "the URL")
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                    "ClientConnectorError", "ReadTimeoutError") or "Could not connect" in text:
            return StoreUnavailable(f"{where}: cannot reach the S3 endpoint {self.endpoint()} ({name}); check "
                                    "AWS_ENDPOINT_URL (or the profile's endpoint_url) and the network, then rerun")
        return StoreError(f"{where}: S3 request failed ({name}: {text[:200]}); rerun the same command to resume")

    def _guard(self, call: Any, rel: str, passthrough: tuple = (FileNotFoundError,)) -> Any:
        try:
            return call()
        except passthrough:
            raise
        except DflashError:
            raise
        except Exception as e:
            raise self._error(e, rel) from None

    # -- the conditional create ----------------------------------------------------------------------------------
    def check_writable(self) -> None:
        self._check_conditional()

    def _check_conditional(self) -> None:
        """Refuse a server that does not honour `If-None-Match: *` (probed once: the same PUT twice must fail)."""
        with self._lock:
            if self._conditional:
                return
            probe = f"claims/probe.{writer_tag()}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"
            path = self.path(probe)
            why = ""
            try:
                self._guard(lambda: self.fs.pipe_file(path, b"1", mode="create"), probe, ())
                try:
                    self.fs.pipe_file(path, b"2", mode="create")
                    why = "a second PUT with If-None-Match: * replaced the object"
                except FileExistsError:
                    pass
            except StoreError as e:
                why = f"a PUT with If-None-Match: * failed: {e}"
            finally:
                try:
                    self.fs.rm_file(path)
                except Exception:  # a leftover probe is a *.partial temp file: gc removes it
                    pass
            if why:
                raise StoreError(
                    f"{self.display()}: the S3 server at {self.endpoint()} does not honour conditional creates "
                    f"({why}), so two writers could both claim a shard; use a server that does (AWS S3, MinIO, "
                    "moto >= 5) or a store on a shared file system")
            self._conditional = True

    # -- StoreFS -------------------------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self._guard(lambda: self.fs.exists(self.path(rel)), rel)

    def read_bytes(self, rel: str) -> bytes:
        return self._guard(lambda: FsspecFS.read_bytes(self, rel), rel)

    def read_into(self, rel: str, buf: memoryview, direct: bool = False, hasher: Any = None) -> int:
        return self._guard(lambda: FsspecFS.read_into(self, rel, buf, direct, hasher), rel)

    def download(self, rels: list[str], dests: list[str]) -> None:
        self._guard(lambda: FsspecFS.download(self, rels, dests), rels[0] if rels else "")

    def size(self, rel: str) -> int:
        return self._guard(lambda: FsspecFS.size(self, rel), rel)

    def mtime(self, rel: str) -> float | None:
        return self._guard(lambda: FsspecFS.mtime(self, rel), rel)

    def write_file(self, rel: str, data: Any) -> None:
        self._guard(lambda: FsspecFS.write_file(self, rel, data), rel, ())

    def write_atomic(self, rel: str, data: bytes) -> None:
        self._guard(lambda: FsspecFS.write_atomic(self, rel, data), rel, ())

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Return True if this call created the object (PUT with If-None-Match: *), False if it existed."""
        self._check_conditional()
        try:
            self._guard(lambda: self.fs.pipe_file(self.path(rel), data, mode="create"), rel, (FileExistsError,))
        except FileExistsError:
            # A retried PUT whose first attempt landed meets its own object: ours if the bytes are ours (every
            # claim carries a unique token, so another writer's bytes never equal ours).
            try:
                return self.read_bytes(rel) == data
            except FileNotFoundError:
                return False
        return True

    def listdir(self, rel: str) -> list[str]:
        return self._guard(lambda: FsspecFS.listdir(self, rel), rel)

    def rm(self, rel: str) -> bool:
        # S3 answers a DELETE of a missing key with success: look first, so the count means something.
        if not self.exists(rel):
            return False
        self._guard(lambda: self.fs.rm_file(self.path(rel)), rel)
        return True

    def rmtree(self, rel: str) -> bool:
        names = self._guard(lambda: self.fs.find(self.path(rel)), rel)
        if not names:
            return False
        self._guard(lambda: self.fs.rm(names), rel)
        return True

    def makedirs(self, rel: str) -> None:
        return None  # S3 has no folders (and s3fs would create a bucket for a bare bucket name)
