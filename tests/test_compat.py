"""The private APIs of other libraries this package uses (``base.compat``) still work as used."""

from __future__ import annotations

import fsspec
import pytest
import torch

from torch_dataloader_utils import StructuredDataLoader
from torch_dataloader_utils.base.compat import (
    ACCELERATE_PREPARED,
    accelerator_available,
    new_shared_storage,
    no_sdk_retries,
    shutdown_workers,
    storage_use_count,
    strip_protocol,
)


def test_shared_storage_and_its_use_count():
    storage = new_shared_storage(4096)
    assert storage.nbytes() == 4096 and storage.is_shared()
    base = storage_use_count(storage)
    view = torch.empty(0, dtype=torch.uint8).set_(storage)
    assert storage_use_count(storage) == base + 1
    del view
    assert storage_use_count(storage) == base


def test_shutdown_workers_passes_over_what_has_no_workers():
    # Stopping real workers: tests/test_loader.py and tests/test_no_silent_loss.py.
    it = iter(torch.utils.data.DataLoader(range(4)))
    assert next(it).tolist() == [0]
    shutdown_workers(it)  # a single-process iterator has nothing to stop: it goes on
    assert [batch.tolist() for batch in it] == [[1], [2], [3]]
    assert shutdown_workers(None) is None


def test_strip_protocol_and_accelerator():
    assert strip_protocol(fsspec.filesystem("memory"), "memory://bucket/x") == "/bucket/x"
    assert accelerator_available() is False  # CPU-only CI


def test_our_loader_carries_accelerate_prepared_flag():
    # that `prepare` then returns it as it is: tests/test_trainers.py, under accelerate launch
    assert getattr(StructuredDataLoader, ACCELERATE_PREPARED) is True


def test_no_sdk_retries_switches_off_the_retries_of_s3fs_gcsfs_and_azure():
    import os

    pytest.importorskip("gcsfs")
    pytest.importorskip("adlfs")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import adlfs
    import gcsfs
    import s3fs

    s3 = s3fs.S3FileSystem(key="k", secret="s", skip_instance_cache=True)
    gcs = gcsfs.GCSFileSystem(
        token="anon", endpoint_url="http://127.0.0.1:9", skip_instance_cache=True
    )
    azure = adlfs.AzureBlobFileSystem(
        connection_string="BlobEndpoint=http://127.0.0.1:9/a;SharedAccessSignature=sv=1&sig=x",
        skip_instance_cache=True,
    )
    for fs in (s3, gcs, azure):
        no_sdk_retries(fs)
    assert s3.retries == 1
    assert gcs._request.__func__ is type(gcs)._request.__wrapped__  # the undecorated request
    assert azure.service_client._config.retry_policy.total_retries == 0
