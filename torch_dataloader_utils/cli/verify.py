"""``verify CHECKPOINT PATH``: whether the checkpoint resumes cleanly against the files now.

A mixture's checkpoint (``verify CHECKPOINT [--source NAME=PATH ...]``): ``mix_verify``.

It runs what ``load_state_dict`` and the first iteration check — the state's schema, files and
fingerprints, settings, the position of every worker stream — for every rank's state (each with
its own rank), or, with ``--elastic``, what ``load_state_dict(states, elastic=True)`` checks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..base.errors import CheckpointMismatchError
from ..checkpoint.checks import ELASTIC_FIELDS
from ..checkpoint.merge import check_coverage, check_same_epoch
from ..planning.epochs import Epochs
from .args import add_settings
from .files import BadInput, Found
from .mix_verify import mixture_paths, verify_mixture
from .output import EXIT_MISMATCH, EXIT_OK, percent
from .resume import epochs_for, is_mixture, load_states, resume, setting

__all__ = ["add_verify", "verify"]


def add_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="JSON or torch.save file")
    parser.add_argument("path", nargs="*", metavar="PATH", help="the files now (one dataset)")
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a mixture's source and its files now, repeatable (default: the paths the state "
        "records)",
    )
    parser.add_argument("--key", help="dotted key of the state(s) in the checkpoint, e.g. a.b")
    add_settings(parser, plan=False)
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="re-deal every old rank's state to --world-size/--num-workers",
    )
    parser.set_defaults(run=verify)


def verify(args: argparse.Namespace) -> int:
    """whether a checkpoint resumes cleanly against the files now (exit 0) or not (exit 1)"""
    found = load_states(args)
    where = args.checkpoint + (f" (key {found.key!r})" if found.key else "")
    against, check = (_mixture if is_mixture(found.states[0]) else _dataset)(args, found)
    try:
        summary = check()
    except CheckpointMismatchError as exc:
        print(f"MISMATCH: {where} does not resume against {against}:\n{exc}")
        if exc.field in ELASTIC_FIELDS and not args.elastic:
            print("(verify --elastic, given every old rank's state, checks an elastic resume)")
        return EXIT_MISMATCH
    print(f"OK: {where} resumes cleanly against {against}: {summary}")
    return EXIT_OK


def _dataset(args: argparse.Namespace, found: Found) -> tuple[str, Callable[[], str]]:
    """The files of one dataset's states, and their check."""
    if args.source or not args.path:
        raise BadInput("this state is one dataset's: give its files as PATH (not --source)")
    epochs = epochs_for(found.states[0], args, args.path)
    workers = setting(args, found.states[0], "_num_workers")
    check = _elastic if args.elastic else _ranks
    return " ".join(args.path), lambda: check(epochs, found, workers)


def _mixture(args: argparse.Namespace, found: Found) -> tuple[str, Callable[[], str]]:
    """The files of each source of a mixture's states, and their check."""
    if args.path:
        raise BadInput("a mixture's files are given per source: --source NAME=PATH (repeat it)")
    paths = mixture_paths(args, found.states[0])
    against = " ".join(f"{name}={path}" for name, path in paths.items())
    return against, lambda: verify_mixture(args, found, paths)


def _ranks(epochs: Epochs, found: Found, workers: int) -> str:
    """Every rank's state on its rank; a list must cover the ranks once, in one epoch."""
    states = found.states
    if len(states) > 1:
        check_coverage(states)
        check_same_epoch(states)
    rows = share = 0
    for state in states:
        progress = resume(epochs, state, workers)
        rows += sum(progress.positions.values())
        share += int(progress.plan.rank_shares(state["_rank"]).sum())
    ranks = f"{len(states)} rank states" if len(states) > 1 else f"rank {states[0]['_rank']}"
    return (
        f"{ranks}, epoch {states[0]['epoch']}, {len(epochs.index.files)} files, "
        f"{len(epochs.index.splits)} splits; {rows} of {share} rows delivered "
        f"({percent(rows, share)})"
    )


def _elastic(epochs: Epochs, found: Found, workers: int) -> str:
    """The old ranks' states re-dealt to ``epochs.world_size`` x ``workers``: what remains."""
    start = epochs.load_elastic(found.states, workers)
    deal = epochs.begin(start, workers).plan.deal
    return (
        f"elastic, {len(found.states)} old rank state(s) of epoch {start.epoch}; "
        f"{int(deal.shares.sum())} rows remain for world_size {epochs.world_size} x "
        f"{max(1, workers)} worker stream(s), {deal.left_out().total} left out"
    )
