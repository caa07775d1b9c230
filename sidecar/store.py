"""The store: a local folder (default ./forge-data) or ``s3://bucket/prefix`` on any S3-API server.

Files appear atomically: locally they are written under a hidden temporary name and renamed; on S3 an object
exists only once its upload completed. Readers glob ``*.parquet`` and so never see a partial file.
"""

import io
import os
import uuid
from dataclasses import dataclass
from urllib.parse import ParseResult, urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq


class StoreError(Exception):
    """The store URI or its settings are wrong (a user's error, not a transient one)."""


@dataclass(frozen=True)
class Store:
    uri: str
    filesystem: pafs.FileSystem
    root: str  # path inside the filesystem, no trailing slash

    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative.lstrip('/')}"

    def write_parquet(self, relative: str, table: pa.Table) -> str:
        """Write ``table`` at ``relative`` atomically; an existing file of that name is replaced whole."""
        self._write(relative, table, replace=True)
        return self.path(relative)

    def write_parquet_new(self, relative: str, table: pa.Table) -> bool:
        """Write ``table`` at ``relative`` atomically unless an object of that name exists (then False, untouched).

        Locally a hard link publishes the file, which fails rather than replace. pyarrow's S3 client has no
        conditional put (If-None-Match), so on S3 the name is looked up first: a writer that owns its names (the
        sidecar's are unique per WAL) can only meet its own earlier upload of the same rows there.
        """
        return self._write(relative, table, replace=False)

    def _write(self, relative: str, table: pa.Table, replace: bool) -> bool:
        target = self.path(relative)
        parent = target.rsplit("/", 1)[0]
        self.filesystem.create_dir(parent, recursive=True)
        if self.is_local:
            # Hidden, and not *.parquet: no reader's glob ever matches a file being written.
            staging = f"{parent}/.{target.rsplit('/', 1)[1]}.{uuid.uuid4().hex}.tmp"
            try:
                pq.write_table(table, staging, filesystem=self.filesystem, compression="zstd")
                if replace:
                    os.replace(staging, target)
                else:
                    try:
                        os.link(staging, target)
                    except FileExistsError:
                        return False
            finally:
                if os.path.exists(staging):
                    os.unlink(staging)
            return True
        if not replace and self.filesystem.get_file_info(target).type != pafs.FileType.NotFound:
            return False
        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression="zstd")
        with self.filesystem.open_output_stream(target) as out:
            out.write(buffer.getvalue())
        return True

    def list_parquet(self, table: str) -> list[str]:
        selector = pafs.FileSelector(self.path(table), recursive=True, allow_not_found=True)
        return sorted(
            info.path
            for info in self.filesystem.get_file_info(selector)
            if info.type == pafs.FileType.File and info.base_name.endswith(".parquet")
        )

    def read_table(self, table: str) -> pa.Table | None:
        paths = self.list_parquet(table)
        if not paths:
            return None
        return pa.concat_tables(pq.read_table(p, filesystem=self.filesystem) for p in paths)


def s3_endpoint_url(explicit: str | None = None) -> ParseResult | None:
    """The S3-compatible endpoint: the one given, else $FORGE_S3_ENDPOINT, else $AWS_ENDPOINT_URL (http:// if bare)."""
    endpoint = explicit or os.environ.get("FORGE_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return None
    return urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")


def open_store(uri: str, s3_endpoint: str | None = None) -> Store:
    """Parse a store URI. S3 credentials come from the usual AWS_* environment variables, never from the URI."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        root = os.path.abspath(parsed.path if parsed.scheme == "file" else uri)
        if os.path.exists(root) and not os.path.isdir(root):
            raise StoreError(f"store {uri!r} is a file, not a folder: pass a folder or s3://bucket/prefix")
        os.makedirs(root, exist_ok=True)
        return Store(uri, pafs.LocalFileSystem(), root.rstrip("/") or "/")
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StoreError(f"store {uri!r} names no bucket: write s3://bucket/prefix")
        if parsed.username or parsed.password:
            raise StoreError("put S3 credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, not in the store URI")
        options: dict = {
            "region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=2),
            "connect_timeout": 2.0,
            "request_timeout": 10.0,
        }
        if endpoint := s3_endpoint_url(s3_endpoint):
            options.update(endpoint_override=endpoint.netloc, scheme=endpoint.scheme or "http")
        return Store(uri, pafs.S3FileSystem(**options), f"{parsed.netloc}{parsed.path}".rstrip("/"))
    raise StoreError(f"unsupported store {uri!r}: use a local folder or s3://bucket/prefix")
