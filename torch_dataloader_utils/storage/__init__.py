"""Where files live: listing and opening through fsspec, ranged reads of remote objects with
read-ahead, retries of transient failures, what differs between object stores, and keeping
credentials out of every message. Imports only ``base``."""
