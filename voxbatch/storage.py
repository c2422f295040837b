"""Storage backends behind one small interface: a local folder (the embedded default) and S3.

Writes are atomic: a reader never sees a partial object under a final key. The local backend writes a
temporary file in the same folder and renames it; S3 PUTs are atomic by the protocol (an object is
visible only once the whole body is stored), and we only use single-part PUTs for segment-sized
objects and the managed transfer (which completes a multipart upload atomically) for large ones.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from voxbatch.settings import Settings


class StorageError(RuntimeError):
    pass


class Storage(ABC):
    """Byte objects under string keys ("jobs/<id>/segments/0000/0000-00000.wav")."""

    url: str

    @abstractmethod
    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under a prefix, sorted."""

    def existing(self, keys: list[str]) -> set[str]:
        """Which of `keys` are stored: one lookup per key here; a store whose every request costs the
        host milliseconds (S3) lists the keys' range instead."""
        return {key for key in keys if self.exists(key)}

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def put_file(self, key: str, path: str | Path, content_type: str = "application/octet-stream") -> None:
        self.put(key, Path(path).read_bytes(), content_type)

    def copy(self, src: str, dst: str) -> None:
        """Copy an object to another key (atomic at `dst`); KeyError when `src` is missing."""
        self.put(dst, self.get(src))

    def get_file(self, key: str, path: str | Path) -> None:
        """Download an object to a file that appears whole or not at all (large objects: the book)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        os.close(fd)
        try:
            self._download(key, part)
            os.replace(part, target)
        except BaseException:
            Path(part).unlink(missing_ok=True)
            raise

    def _download(self, key: str, path: str) -> None:
        Path(path).write_bytes(self.get(key))

    def describe(self, key: str) -> str:
        """Where a key lives, for messages (never includes credentials)."""
        return f"{self.url.rstrip('/')}/{key}"

    def check(self) -> None:
        """Raise if the storage cannot be used at all (before a producer writes anything to it)."""


class LocalStorage(Storage):
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()
        self._inside = os.path.join(str(self.root), "")  # what every key's path starts with: the root and a separator

    def _file(self, key: str) -> str:
        # Lexical normalization, not resolve(): resolve stats every component of every key (10 s of a
        # 1,000-item batch on a slow disk); links inside the root are the owner's own doing. On strings:
        # a worker looks up every segment of a task as it comes in (exists, get), and Path's parents took
        # ~50 us a key (bench/intake_host.py).
        path = os.path.normpath(os.path.join(self._inside, key))
        if not path.startswith(self._inside) or path == self._inside:  # the latter: the root "/" itself
            raise StorageError(f"key {key!r} escapes the storage root")
        return path

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise KeyError(key) from None

    def _download(self, key: str, path: str) -> None:
        try:
            shutil.copyfile(self._path(key), path)
        except FileNotFoundError:
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._file(key))

    def copy(self, src: str, dst: str) -> None:
        """A hard link (no bytes copied; objects are never changed in place, only replaced), made
        beside `dst` and renamed over it; a plain copy where links are not supported."""
        source, target = self._path(src), self._path(dst)
        if not source.is_file():
            raise KeyError(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.{os.getpid()}.{threading.get_ident()}.part"
        try:
            try:
                os.link(source, tmp)
            except OSError:
                shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        except FileNotFoundError:
            raise KeyError(src) from None
        finally:
            tmp.unlink(missing_ok=True)

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        keys = [
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not p.name.endswith(".part")
        ]
        return sorted(k for k in keys if k.startswith(prefix))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class S3Storage(Storage):
    """S3 or an S3-compatible store (SeaweedFS, MinIO, R2) through boto3.

    One client per process (boto3 clients are thread-safe), with a connection pool at least as
    large as the upload threads, standard retries, and checksums only when required (boto3 >= 1.36
    otherwise sends CRC trailers that several S3-compatible stores reject).
    """

    def __init__(self, url: str, settings: Settings, max_pool: int | None = None):
        import boto3
        from botocore.config import Config

        parsed = urlparse(url)
        self.url = url
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        if not self.bucket:
            raise StorageError(f"storage URL {url!r} names no bucket (expected s3://bucket/prefix)")
        config = Config(
            retries={"mode": "standard", "max_attempts": 5},
            max_pool_connections=max(max_pool or settings.upload_threads + 4, 10),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"},
        )
        key_id = settings.aws_access_key_id.get_secret_value() if settings.aws_access_key_id else None
        secret = settings.aws_secret_access_key.get_secret_value() if settings.aws_secret_access_key else None
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=settings.s3_endpoint,
            region_name=settings.aws_region,
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            config=config,
        )
        from botocore.exceptions import ClientError

        self._client_error = ClientError

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def check(self) -> None:
        """The bucket exists and the credentials may use it (some stores create a bucket on the first
        PUT, so a mistyped bucket would otherwise fill a new one)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self._client_error as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket", "NotFound"):
                raise StorageError(f"S3 bucket {self.bucket!r} does not exist (VOXBATCH_STORAGE_URL "
                                   f"{self.url})") from None
            raise

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ContentType=content_type)

    def put_file(self, key: str, path: str | Path, content_type: str = "application/octet-stream") -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key), ExtraArgs={"ContentType": content_type})

    @contextlib.contextmanager
    def _missing_as_key_error(self, key: str) -> Iterator[None]:
        """S3's "no such key" (NoSuchKey / 404) as the KeyError every Storage raises for a missing key."""
        try:
            yield
        except self._client_error as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise KeyError(key) from None
            raise

    def _download(self, key: str, path: str) -> None:
        with self._missing_as_key_error(key):
            self.client.download_file(self.bucket, self._key(key), path)

    def get(self, key: str) -> bytes:
        with self._missing_as_key_error(key):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy: the bytes never pass through this process."""
        with self._missing_as_key_error(src):
            self.client.copy_object(Bucket=self.bucket, Key=self._key(dst),
                                    CopySource={"Bucket": self.bucket, "Key": self._key(src)})

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except self._client_error as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def existing(self, keys: list[str]) -> set[str]:
        """One listing of the keys' common prefix, from just before the first key to the last, instead
        of a HEAD per key: each boto3 request costs this process ~2 ms of CPU (bench/intake_host.py on
        SeaweedFS), and a worker asks this for every task it takes in. A task's keys are one job's
        consecutive segments, so the range holds about as many objects as keys were asked."""
        if len(keys) < 2:
            return super().existing(keys)
        ordered = sorted(keys)
        first, last = self._key(ordered[0]), self._key(ordered[-1])
        strip = len(self.prefix) + 1 if self.prefix else 0
        wanted, found = set(keys), set()
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=os.path.commonprefix([first, last]), StartAfter=first[:-1])
        for page in pages:
            for obj in page.get("Contents", []):
                if obj["Key"] > last:
                    return found
                if obj["Key"][strip:] in wanted:
                    found.add(obj["Key"][strip:])
        return found

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        return sorted(keys)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))


_cache: dict[tuple, Storage] = {}
_cache_lock = threading.Lock()


def open_storage(settings: Settings, url: str | None = None) -> Storage:
    """The storage for a URL (default: settings.storage_url); one instance per process and URL."""
    url = url or settings.storage_url
    cache_key = (url, settings.s3_endpoint, settings.upload_threads)
    with _cache_lock:
        if cache_key not in _cache:
            if url.startswith("file://"):
                parsed = urlparse(url)
                path = unquote(parsed.netloc + parsed.path)
                _cache[cache_key] = LocalStorage(path)
            elif url.startswith("s3://"):
                _cache[cache_key] = S3Storage(url, settings)
            else:
                raise StorageError(f"unsupported storage URL {url!r}: use s3://bucket/prefix or file:///path")
        return _cache[cache_key]
