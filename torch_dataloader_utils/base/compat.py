"""Every private API of another library this package uses, in one place.

Each is tested with the versions pinned in ``constraints.txt`` (torch 2.13.0, fsspec
2026.9.0, accelerate 1.15.0, lightning 2.6.6, gcsfs 2026.10.1, azure-storage-blob 12.31.1); an
upgrade that removes one breaks here, under its name, and ``tests/test_compat.py`` says which.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ACCELERATE_PREPARED",
    "LIGHTNING_LOADER_STATES",
    "accelerator_available",
    "new_shared_storage",
    "no_sdk_retries",
    "shutdown_workers",
    "storage_use_count",
    "strip_protocol",
]

# Hugging Face Accelerate's `prepare` returns an object with this attribute set as it is (and
# registers it) instead of rebuilding a DataLoader over its dataset (accelerate 1.15).
ACCELERATE_PREPARED = "_is_accelerate_prepared"

# Where a Lightning checkpoint keeps the training loaders' ``state_dict()`` of the process that
# wrote it (lightning 2.6: ``_FitLoop.on_save_checkpoint``, ``_CheckpointConnector``).
LIGHTNING_LOADER_STATES = ("loops", "fit_loop", "state_dict", "combined_loader")


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many tensors/storages share ``storage`` (torch keeps no public accessor)."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of shared memory, allocated shared (``share_memory_()`` would copy)."""
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    return storage


def shutdown_workers(iterator: Any) -> None:
    """Stop a DataLoader iterator's worker processes now, if it has any."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def accelerator_available() -> bool:
    """Whether an accelerator (CUDA, XPU, MPS, ...) is there to pin memory for."""
    return bool(torch.accelerator.is_available())


def strip_protocol(fs: Any, path: str) -> str:
    """``path`` without its protocol, as the filesystem ``fs`` names it."""
    return str(fs._strip_protocol(path))


def no_sdk_retries(fs: Any) -> None:
    """Switch off the retries a cloud SDK makes inside one call of ``fs``, so that transient
    errors are retried by one layer only (``storage.retry``), within its documented time bound.

    gcsfs retries each request 6 times (~35 s of sleeps) in a decorator fixed when its class is
    defined: the instance gets the undecorated request method. The Azure SDK retries in its
    pipeline (``ExponentialRetry``, 15 s and more per wait): its policy object, shared by every
    client the service client makes, is told to make no retry. s3fs retries some errors 5
    times (its class attribute ``retries``): the instance gets 1. Other filesystems are left
    as they are.
    """
    if type(fs).__module__.startswith("s3fs"):
        fs.retries = 1
    unwrapped = getattr(getattr(type(fs), "_request", None), "__wrapped__", None)
    if type(fs).__module__.startswith("gcsfs") and unwrapped is not None:
        fs._request = unwrapped.__get__(fs)
    client = getattr(fs, "service_client", None)
    policy = getattr(getattr(client, "_config", None), "retry_policy", None)
    if policy is not None and hasattr(policy, "total_retries"):
        policy.total_retries = 0
