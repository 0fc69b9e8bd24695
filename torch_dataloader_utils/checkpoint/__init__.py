"""The checkpoint state of one dataset: its schema, how it is written and validated (every
mismatch a ``CheckpointMismatchError`` with its likely cause), and the collectives that gather and
scatter a job's states. Knows files and splits (``index``), not how an epoch is planned."""
