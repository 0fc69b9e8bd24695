"""``python -m torch_dataloader_utils``: the command line (``docs/cli.md``)."""

from .cli import main

raise SystemExit(main())
