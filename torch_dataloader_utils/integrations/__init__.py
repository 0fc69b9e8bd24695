"""Integrations with trainers, each in a module of its own that imports its trainer.

- ``torch_dataloader_utils.integrations.hf``: Hugging Face ``transformers.Trainer``
  (``StructuredTrainer``, ``StructuredTrainerMixin``, ``DataStatsCallback``); needs the
  ``[hf]`` extra.
- ``torch_dataloader_utils.integrations.lightning``: Lightning ``Trainer``
  (``LoaderStatesPerRank``, for more than one process; ``DataStats``); needs the
  ``[lightning]`` extra.

``import torch_dataloader_utils`` imports neither (docs/trainers.md).
"""
