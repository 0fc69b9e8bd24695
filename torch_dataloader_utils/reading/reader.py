"""One worker stream of an iteration, read into the user's batches or into loader packets."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..base.errors import DataSourceError
from ..base.stages import PACKING, TRANSFORM, Stage, timed
from ..planning.config import DatasetConfig
from ..planning.plan import Position
from ..transport.packet import Derived, Packet
from ..transport.slots import SharedSlots
from .convert import convert
from .packets import batch_parts, chunk_parts, run_sizes, send
from .packing import positions_from_bounds
from .runs import Run
from .stream import ChunkSource, read_stream

__all__ = ["StreamReader"]


@dataclass(frozen=True, kw_only=True)
class StreamReader:
    """Reads ``source`` from position ``start``: converted, transformed batches with positions.

    ``skips`` (packed streams): tokens of rows of the share delivered by an earlier iteration.
    """

    source: ChunkSource
    config: DatasetConfig
    start: Position
    skips: Mapping[int, int] = field(default_factory=dict)

    def batches(self, *, copy: bool = True, read_ahead: int = 0) -> Iterator[tuple[Any, Position]]:
        """Batches and the position after each; ``copy=False`` when they are copied again."""
        transform = self.config.transform
        if self.config.packing is not None:
            for out, position in self._packed(read_ahead):
                yield _transformed(out, transform), position
            return
        copy = copy and not self.source.decodes_into_new_memory
        for run in self._runs(itertools.repeat(1), read_ahead=read_ahead):
            run.chunks = [run.batch()]
            (out,) = self._converted(run, copy)
            yield _transformed(out, transform), run.positions[0]

    def packets(self, slots: SharedSlots, worker: int) -> Iterator[Packet]:
        """The stream as packets for ``StructuredDataLoader``; the last (maybe empty) ends it."""
        if self.config.transform is None and self.config.packing is None:
            batch_bytes = self.config.batch_bytes(self.source.schema)
            runs = self._runs(run_sizes(batch_bytes, slots.slot_bytes), rows=True)
            # Tensors may view Arrow's buffers or gathered records: packing copies them into
            # the slot (so shuffled rows are cut into columns right there); list columns
            # become nested tensors in the main process, batch by batch.
            parts = chunk_parts(runs, lambda run: self._converted(run, False, nested=False))
        elif self.config.transform is None:  # packed: position_ids made in the main process
            packed = self._packed(0, position_ids=Derived(_position_ids))
            parts = batch_parts(packed, slots.slot_bytes)
        else:
            parts = batch_parts(self.batches(copy=False), slots.slot_bytes)
        return send(parts, slots, worker)

    def _packed(
        self, read_ahead: int, position_ids: object = None
    ) -> Iterator[tuple[Any, Position]]:
        """Packed batches of token sequences (``planning.tokens``), in the output type; a worker
        sends ``position_ids`` as ``Derived``: they are twice the bytes of the tokens, and cheap
        to make again from ``cu_seqlens``."""
        packing = self.config.packing
        assert packing is not None
        packed = self.source.packed(
            packing,
            start=self.start,
            batch_size=self.config.batch_size,
            drop_last=self.config.drop_last,
            skips=self.skips,
            read_ahead=read_ahead,
            position_ids=position_ids,
        )
        for arrays, position in timed(packed, PACKING):
            if self.config.output == "torch":
                yield {k: _tensor(v) for k, v in arrays.items()}, position
            else:
                yield arrays, position

    def _runs(self, sizes: Iterable[int], read_ahead: int = 0, rows: bool = False) -> Iterator[Run]:
        return read_stream(
            self.source,
            start=self.start,
            batch_size=self.config.batch_size,
            drop_last=self.config.drop_last,
            run_sizes=sizes,
            read_ahead=read_ahead,
            rows=rows,
        )

    def _converted(self, run: Run, copy: bool, *, nested: bool = True) -> list[Any]:
        """``run``'s chunks in the output type; a value error names the splits they came from."""
        output = self.config.output
        try:
            return [convert(chunk, output, copy=copy, nested=nested) for chunk in run.chunks]
        except UnicodeDecodeError as exc:  # bytes no writer produces: the file is damaged
            where = self.source.describe_at(run.positions[-1])
            raise DataSourceError(
                f"split {where}: a string column holds invalid UTF-8 ({exc}); the file is "
                f"corrupted (Parquet pages without checksums cannot tell)"
            ) from exc
        except ValueError as exc:
            where = self.source.describe_at(run.positions[-1])
            raise ValueError(f"split {where}: {exc}") from exc


def _transformed(batch: Any, transform: Callable[[Any], Any] | None) -> Any:
    if transform is None:
        return batch
    with Stage(TRANSFORM):
        return transform(batch)


def _position_ids(batch: dict[str, Any]) -> Any:
    """A packed batch's ``position_ids``, from its ``cu_seqlens``, as its ``input_ids``."""
    tokens, bounds = batch["input_ids"], batch["cu_seqlens"]
    positions = positions_from_bounds(np.asarray(bounds), tokens.shape[1])
    return torch.from_numpy(positions) if isinstance(tokens, torch.Tensor) else positions


def _tensor(value: Any) -> Any:
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value
