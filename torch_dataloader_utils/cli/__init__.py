"""The command line: ``python -m torch_dataloader_utils plan | inspect | verify | profile``
(docs/cli.md).

The library prints nothing; this package is an application. It prints reports on stdout, errors
on stderr, and configures ``logging`` (``-v``: INFO of ``torch_dataloader_utils``). Each command
builds a report of plain values and prints it as text or, with ``--json``, as JSON.

Exit status: 0 success; 1 the checkpoint does not match the files or settings (its
``CheckpointMismatchError`` message, with the "Likely cause:" line); 2 bad input (a missing or
unreadable file, a corrupted state, bad arguments): one error line, never a traceback.

    __init__  main, the parser, logging
    args      options shared by the commands
    files     dataset states inside JSON / torch.save checkpoint files
    resume    the checks of a resume, without iterating
    plan, inspect, verify, profile   one command each
    mix_plan, mix_inspect, mix_verify   the same for a mixture of sources
    output    exit statuses, text and JSON
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from ..base.errors import CheckpointMismatchError, DataLoaderUtilsError
from ..storage.secrets import Redactor, secret_values, url_secrets
from .args import storage_options
from .inspect import add_inspect, inspect
from .output import EXIT_BAD_INPUT, EXIT_MISMATCH, PROG
from .plan import add_plan, plan
from .profile import add_profile, profile
from .verify import add_verify, verify

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command]] = {
    "plan": (add_plan, plan),
    "inspect": (add_inspect, inspect),
    "verify": (add_verify, verify),
    "profile": (add_profile, profile),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); the exit status."""
    args = _parser().parse_args(argv)
    redact = _redactor(sys.argv[1:] if argv is None else argv)
    _configure_logging(args.verbose, redact)
    try:
        args.storage_options = storage_options(args.storage_option)
        run: Command = args.run
        return run(args)
    except CheckpointMismatchError as exc:
        print(f"MISMATCH: {exc}")
        return EXIT_MISMATCH
    except (DataLoaderUtilsError, OSError, ValueError, TypeError) as exc:
        message = " ".join(redact(str(exc)).split())  # one line
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="log INFO of torch_dataloader_utils on stderr (-vv: DEBUG)",
    )
    common.add_argument(
        "--storage-option",
        action="append",
        default=argparse.SUPPRESS,
        metavar="KEY=VALUE",
        help="fsspec storage option, repeatable; VALUE is JSON if it parses, else a string",
    )
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Plan, inspect, verify, profile torch_dataloader_utils datasets, checkpoints.",
        epilog="exit status: 0 ok, 1 checkpoint mismatch, 2 bad input. See docs/cli.md.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help=argparse.SUPPRESS)
    parser.set_defaults(storage_option=[])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add, run) in _COMMANDS.items():
        add(commands.add_parser(name, parents=[common], help=run.__doc__))
    return parser


def _redactor(words: Sequence[str]) -> Redactor:
    """Scrubs the credentials among the command's words: ``--storage-option`` values of
    credential-like keys (and their parts) and the credentials in URLs."""
    found = [s for w in words for s in url_secrets(w)]
    found += [s for w in words if "=" in w for s in secret_values(dict([w.split("=", 1)]))]
    return Redactor(tuple(found))


class _OursScrubbed(logging.Filter):
    """Lets through the library's records and Python warnings (an SDK's own log lines only at
    ``-vv``), credentials scrubbed."""

    def __init__(self, redact: Redactor, everything: bool) -> None:
        super().__init__()
        self._redact, self._everything = redact, everything

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name.startswith(("torch_dataloader_utils", "py.warnings"))
        record.msg, record.args = self._redact(record.getMessage()), ()
        return ours or self._everything


def _configure_logging(verbose: int, redact: Redactor) -> None:
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig, with the filter on its handler alone
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_OursScrubbed(redact, everything=verbose >= 2))
        root.addHandler(handler)
    logging.captureWarnings(True)
    if verbose:
        level = logging.INFO if verbose == 1 else logging.DEBUG
        logging.getLogger("torch_dataloader_utils").setLevel(level)
