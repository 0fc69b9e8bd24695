"""Stream Parquet/Arrow files into PyTorch with exact, content-addressed mid-epoch resume."""

from .api.dataset import StructuredDataset
from .api.loader import StructuredDataLoader
from .api.stats import LoaderStats, LoopStats
from .base.errors import (
    CheckpointMismatchError,
    DataLoaderUtilsError,
    DataSourceError,
    EpochStartError,
    InvalidStateError,
    LostBatchesError,
    SchemaMismatchError,
    UnsendableBatchError,
    UnsendableSettingError,
)
from .mixing.source import Source
from .planning.text import Tokenize
from .planning.tokens import TokenPacking

__all__ = [
    "CheckpointMismatchError",
    "DataLoaderUtilsError",
    "DataSourceError",
    "EpochStartError",
    "InvalidStateError",
    "LoaderStats",
    "LoopStats",
    "LostBatchesError",
    "SchemaMismatchError",
    "Source",
    "StructuredDataLoader",
    "StructuredDataset",
    "TokenPacking",
    "Tokenize",
    "UnsendableBatchError",
    "UnsendableSettingError",
]

__version__ = "0.1.0"
