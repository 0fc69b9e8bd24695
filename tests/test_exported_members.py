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
        "EpochStartError",
        "GlobalStats",
        "InvalidStateError",
        "LoaderStats",
        "LoopStats",
        "LostBatchesError",
        "ProcessStats",
        "SchemaMismatchError",
        "Source",
        "SourceStats",
        "StageStats",
        "StructuredDataLoader",
        "StructuredDataset",
        "TokenPacking",
        "Tokenize",
        "UnsendableBatchError",
        "UnsendableSettingError",
    }


def test_errors_inherit_from_builtins():
    t = torch_dataloader_utils
    assert issubclass(t.CheckpointMismatchError, ValueError)
    assert issubclass(t.InvalidStateError, ValueError)
    assert issubclass(t.SchemaMismatchError, ValueError)
    assert issubclass(t.DataSourceError, OSError)
    assert issubclass(t.UnsendableBatchError, TypeError)
    assert issubclass(t.LostBatchesError, RuntimeError)
    assert issubclass(t.EpochStartError, ValueError)
    assert issubclass(t.UnsendableSettingError, TypeError)
    for name in ("CheckpointMismatchError", "InvalidStateError", "SchemaMismatchError",
                 "DataSourceError", "UnsendableBatchError", "LostBatchesError",
                 "EpochStartError", "UnsendableSettingError"):  # fmt: skip
        assert issubclass(getattr(t, name), t.DataLoaderUtilsError)


def test_integrations_export_their_names_and_the_core_imports_no_trainer():
    """``integrations.hf`` / ``integrations.lightning`` (the ``[hf]`` / ``[lightning]``
    extras) are public modules; ``import torch_dataloader_utils`` imports neither trainer."""
    import subprocess
    import sys

    from torch_dataloader_utils.integrations import hf, lightning

    assert hf.__all__ == [
        "LOADER_STATE_FILE",
        "DataStatsCallback",
        "StructuredTrainer",
        "StructuredTrainerMixin",
    ]
    assert lightning.__all__ == ["DataStats", "LoaderStatesPerRank"]
    check = (
        "import sys, torch_dataloader_utils; "
        "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
