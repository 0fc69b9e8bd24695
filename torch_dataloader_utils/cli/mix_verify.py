"""``verify CHECKPOINT [--source NAME=PATH ...]`` of a mixture's state: does it resume?

For every rank's state it builds the mixture over each source's files with the checkpoint's
settings (weights, ``epoch_size``, schedule, per-source format, ``split_bytes`` and
``shuffle_memory_bytes``, shuffle and seed, world, workers, packing; any option given
overrides them), loads the state as the training script would (``load_state_dict``: schema,
every source's files and fingerprints, settings, every worker stream's place in every source)
and reads the first rows of the next iteration, one per worker stream. A source's files are
``--source NAME=PATH``, else where the state says they were (``_recorded_path``).
"""

from __future__ import annotations

import argparse
import itertools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ..api.dataset import StructuredDataset
from ..api.loader import StructuredDataLoader
from ..checkpoint.merge import check_coverage, check_same_epoch
from ..mixing.source import Source
from .args import pairs
from .files import BadInput, Found
from .resume import packing_of

__all__ = ["mixture_paths", "verify_mixture"]


def mixture_paths(args: argparse.Namespace, state: Mapping[str, Any]) -> dict[str, str]:
    """Each source's files: ``--source NAME=PATH``, else the state's own."""
    given = dict(pairs(args.source, "--source", "PATH"))
    names = list(state["sources"])
    unknown = [name for name in given if name not in names]
    if unknown:
        raise BadInput(
            f"--source names {unknown}, which the checkpoint's mixture does not have: its "
            f"sources are {names}"
        )
    return {
        name: given.get(name) or _recorded_path(name, sub) for name, sub in state["sources"].items()
    }


def _recorded_path(name: str, sub: Mapping[str, Any]) -> str:
    """Where source ``name``'s state says its files were: its one file, else the directory
    (or prefix) that holds them all."""
    files = sub["files"]
    root, groups = files.get("root"), files.get("groups")
    if not root:
        raise BadInput(
            f"the state of source {name!r} records no directory for its files: pass "
            f"--source {name}=PATH"
        )
    if files.get("count") == 1 and isinstance(groups, list) and groups:
        file = groups[0][0] if isinstance(groups[0], list) and groups[0] else None
        return f"{root}/{file}" if isinstance(file, str) else str(root)
    return str(root)


def verify_mixture(args: argparse.Namespace, found: Found, paths: Mapping[str, str]) -> str:
    """What the states resume to (raises ``CheckpointMismatchError`` when one does not)."""
    states = found.states
    if args.elastic:
        return _elastic(args, states, paths)
    if len(states) > 1:
        check_coverage(states)
        check_same_epoch(states)
    read = [_first_rows(_loader(args, states[0], paths, s["_rank"]), s) for s in states]
    ranks = f"{len(states)} rank states" if len(states) > 1 else f"rank {states[0]['_rank']}"
    handed = sum(p for state in states for p in state["streams"] if p is not None)
    return (
        f"{ranks}, epoch {states[0]['epoch']}, mixture of {len(paths)} sources; {handed} of "
        f"the epoch's {states[0]['_mixture']['epoch_size']} positions handed out; "
        f"{_what_was_read(sum(read))}"
    )


def _elastic(
    args: argparse.Namespace, states: Sequence[Mapping[str, Any]], paths: Mapping[str, str]
) -> str:
    """The old ranks' states re-dealt to ``--world-size`` x ``--num-workers`` (rank 0)."""
    loader = _loader(args, states[0], paths, 0)
    loader.load_state_dict(list(states), elastic=True)
    read = _read(loader)
    world_size = _given(args.world_size, states[0]["_world_size"])
    return (
        f"elastic, {len(states)} old rank state(s) of epoch {states[0]['epoch']} onto "
        f"world_size {world_size} x {max(1, loader.num_workers)} worker "
        f"stream(s); rank 0 {_what_was_read(read)}"
    )


def _what_was_read(streams: int) -> str:
    if not streams:
        return "no batch left in the epoch (the next is epoch + 1: set_epoch)"
    return f"read a batch from each of {streams} worker stream(s)"


def _first_rows(loader: StructuredDataLoader, state: Mapping[str, Any]) -> int:
    """Load ``state`` and read the next rows: how many worker streams had one."""
    loader.load_state_dict(state)
    return _read(loader)


def _read(loader: StructuredDataLoader) -> int:
    """Batches of one row read from the next iteration, one per worker stream at most."""
    with warnings.catch_warnings():  # the job's workers, on a machine with fewer cores
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        batches = iter(loader)
        try:
            return sum(1 for _ in itertools.islice(batches, max(1, loader.num_workers)))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()


def _loader(
    args: argparse.Namespace, state: Mapping[str, Any], paths: Mapping[str, str], rank: int
) -> StructuredDataLoader:
    """The mixture over ``paths`` as rank ``rank`` with the settings of ``state`` (the
    first state: the job's) or the options given, reading batches of one row (one sequence
    of one token, packed)."""
    mixture, subs = state["_mixture"], state["sources"]
    policies = mixture.get("policies", {})
    sources = {
        name: Source(
            path=paths[name],
            format=_given(args.format, sub["_format"]),
            split_bytes=_given(args.split_bytes, sub["_split_bytes"]),
            shuffle_memory_bytes=_given(args.shuffle_memory_bytes, sub["_shuffle_memory_bytes"]),
            max_epochs=policies[name][0] if name in policies else None,
            when_exhausted=policies[name][1] if name in policies else "renormalize",
        )
        for name, sub in subs.items()
    }
    first = next(iter(subs.values()))
    loader, _ = StructuredDataset.create_dataloader(
        sources,
        weights=mixture["weights"],
        epoch_size=mixture["epoch_size"],
        schedule_block=mixture.get("schedule_block") or None,
        shuffle=_given(args.shuffle, first["_shuffle"]),
        shuffle_seed=_given(args.seed, mixture.get("schedule_seed", 0)),
        rank=rank,
        world_size=_given(args.world_size, state["_world_size"]),
        even_batches=_given(args.even_batches, state["_even_batches"]),
        num_workers=_given(args.num_workers, state["_num_workers"]),
        packing=packing_of(first),
        storage_options=args.storage_options,
        batch_size=1,
        source_column=None,
    )
    return loader


def _given(option: Any, recorded: Any) -> Any:
    return recorded if option is None else option
