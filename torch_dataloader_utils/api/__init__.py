"""The public face: ``StructuredDataset`` and ``StructuredDataLoader``, the batches a trainer
holds unread, and ``loader.stats()``."""
