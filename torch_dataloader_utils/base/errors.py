"""The library's exceptions.

    DataLoaderUtilsError                    base of everything raised on purpose
    ├── CheckpointMismatchError (ValueError) a checkpoint no longer describes the data/settings
    ├── InvalidStateError (ValueError)       a state dict that is unknown, truncated or corrupted
    ├── SchemaMismatchError (ValueError)     files whose schemas differ
    ├── EpochStartError (ValueError)         an epoch the dataset cannot start from where it is
    ├── NotSupportedError (NotImplementedError) settings that this version cannot combine yet
    ├── DataSourceError (OSError)            a file that cannot be listed, read or decoded
    ├── UnsendableBatchError (TypeError)     a batch a DataLoader worker cannot pickle
    └── LostBatchesError (RuntimeError)      batches a worker sent that never arrived

Missing paths raise the builtin ``FileNotFoundError`` and unknown options ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointMismatchError",
    "DataLoaderUtilsError",
    "DataSourceError",
    "EpochStartError",
    "InvalidStateError",
    "LostBatchesError",
    "NotSupportedError",
    "SchemaMismatchError",
    "UnsendableBatchError",
]


class DataLoaderUtilsError(Exception):
    """Base class of the errors this library raises on purpose."""


class CheckpointMismatchError(DataLoaderUtilsError, ValueError):
    """A checkpoint does not match the current files or settings.

    Attributes: ``split`` (the stored split that failed, e.g. ``"a.parquet rows [0, 4096)"``),
    ``field`` (the setting or file that changed), ``expected`` (the checkpoint's value) and
    ``found`` (the current value). Any may be ``None`` when the message is re-raised from a
    DataLoader worker, which keeps only the text.
    """

    def __init__(
        self,
        message: str,
        *,
        split: str | None = None,
        field: str | None = None,
        expected: object = None,
        found: object = None,
    ) -> None:
        super().__init__(message)
        self.split = split
        self.field = field
        self.expected = expected
        self.found = found


class InvalidStateError(DataLoaderUtilsError, ValueError):
    """A state dict that this version cannot read: unknown version, missing or corrupted keys."""


class SchemaMismatchError(DataLoaderUtilsError, ValueError):
    """Two files of one dataset have different schemas (both files and fields are named)."""


class EpochStartError(DataLoaderUtilsError, ValueError):
    """An epoch the dataset cannot start from where it stands: a packed mixture's epoch after
    the first continues each source where the epoch before it ended, which neither this process
    nor the loaded state knows (``docs/mixing.md``). Not exported: catch ``ValueError``
    or ``DataLoaderUtilsError``."""


class NotSupportedError(DataLoaderUtilsError, NotImplementedError):
    """Settings this version cannot combine yet; the message says what works instead. Not
    exported: catch ``NotImplementedError`` or ``DataLoaderUtilsError``."""


class DataSourceError(DataLoaderUtilsError, OSError):
    """A file that cannot be listed, opened, read or decoded (the file is named)."""


class UnsendableBatchError(DataLoaderUtilsError, TypeError):
    """A batch a DataLoader worker cannot pickle to the training process (an unpicklable
    column type under ``output="arrow"``, a transform returning a lambda or a generator)."""


class LostBatchesError(DataLoaderUtilsError, RuntimeError):
    """Batches a DataLoader worker sent that never reached the training process."""
