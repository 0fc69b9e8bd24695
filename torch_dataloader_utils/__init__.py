"""Stream Parquet/Arrow files into PyTorch with exact, content-addressed mid-epoch resume."""

from ._dataset import StructuredDataset
from ._errors import (
    CheckpointMismatchError,
    DataLoaderUtilsError,
    DataSourceError,
    InvalidStateError,
    LostBatchesError,
    SchemaMismatchError,
    UnsendableBatchError,
)
from ._loader import StructuredDataLoader
from ._mixture import Source
from ._stats import LoaderStats, LoopStats
from ._tokens import TokenPacking

__all__ = [
    "CheckpointMismatchError",
    "DataLoaderUtilsError",
    "DataSourceError",
    "InvalidStateError",
    "LoaderStats",
    "LoopStats",
    "LostBatchesError",
    "SchemaMismatchError",
    "Source",
    "StructuredDataLoader",
    "StructuredDataset",
    "TokenPacking",
    "UnsendableBatchError",
]

__version__ = "0.1.0"
