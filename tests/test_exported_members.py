"""The public surface is exactly ``__all__``, sorted, and every name in it is importable."""

from __future__ import annotations

import torch_dataloader_utils


def test_all_is_sorted_and_matches_public_names():
    public = {
        name
        for name in dir(torch_dataloader_utils)
        if not name.startswith("_")
        and getattr(getattr(torch_dataloader_utils, name), "__module__", "").startswith(
            "torch_dataloader_utils"
        )
    }
    assert torch_dataloader_utils.__all__ == sorted(torch_dataloader_utils.__all__)
    assert set(torch_dataloader_utils.__all__) == public


def test_exports():
    assert set(torch_dataloader_utils.__all__) == {
        "CheckpointMismatchError",
        "DataLoaderUtilsError",
        "DataSourceError",
        "InvalidStateError",
        "LostBatchesError",
        "SchemaMismatchError",
        "StructuredDataLoader",
        "StructuredDataset",
        "TokenPacking",
        "UnsendableBatchError",
    }


def test_errors_inherit_from_builtins():
    t = torch_dataloader_utils
    assert issubclass(t.CheckpointMismatchError, ValueError)
    assert issubclass(t.InvalidStateError, ValueError)
    assert issubclass(t.SchemaMismatchError, ValueError)
    assert issubclass(t.DataSourceError, OSError)
    assert issubclass(t.UnsendableBatchError, TypeError)
    assert issubclass(t.LostBatchesError, RuntimeError)
    for name in ("CheckpointMismatchError", "InvalidStateError", "SchemaMismatchError",
                 "DataSourceError", "UnsendableBatchError", "LostBatchesError"):  # fmt: skip
        assert issubclass(getattr(t, name), t.DataLoaderUtilsError)
