"""The storage protocol's conformance tests (``storage_conformance.FilesTests``) for each backend:
a local disk (with and without fsync), ``memory://`` and S3 on a moto server on 127.0.0.1."""

from __future__ import annotations

import uuid

import fsspec
import pytest
from storage_conformance import FilesTests

from daskjobs.checkpoint._storage.files import LocalFiles
from daskjobs.checkpoint._storage.remote import RemoteFiles


class TestLocalFiles(FilesTests):
    capabilities = {"supports_overwrite": True, "queues_writes": False, "defers_flush": True}
    too_long = "has 5 bytes, expected 4"

    @pytest.fixture
    def root(self, tmp_path):
        return str(tmp_path)

    @pytest.fixture
    def fs(self):
        return fsspec.filesystem("file")

    @pytest.fixture
    def files(self):
        return LocalFiles(fsync=True)


class TestLocalFilesWithoutFsync(TestLocalFiles):
    capabilities = {"supports_overwrite": True, "queues_writes": False, "defers_flush": False}

    @pytest.fixture
    def files(self):
        return LocalFiles(fsync=False)


class TestMemoryFiles(FilesTests):
    capabilities = {"supports_overwrite": False, "queues_writes": True, "defers_flush": False}
    too_long = "has more than 4 bytes, expected 4"

    @pytest.fixture
    def fs(self):
        return fsspec.filesystem("memory")

    @pytest.fixture
    def root(self, fs):
        root = f"/conformance-{uuid.uuid4().hex}"
        yield root
        if fs.exists(root):
            fs.rm(root, recursive=True)

    @pytest.fixture
    def files(self, fs):
        return RemoteFiles(fs)


class TestS3Files(TestMemoryFiles):
    @pytest.fixture
    def fs(self, s3_prefix):
        import s3fs

        return s3fs.S3FileSystem(**s3_prefix[1])

    @pytest.fixture
    def root(self, s3_prefix):
        return s3_prefix[0].removeprefix("s3://")
