"""Stream Parquet/Arrow files into PyTorch with exact, content-addressed mid-epoch resume."""

from .api.dataset import StructuredDataset
from .api.global_stats import GlobalStats
from .api.loader import StructuredDataLoader
from .api.mixture_stats import SourceStats
from .api.stage_stats import ProcessStats, StageStats
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
]

__version__ = "0.1.0"
