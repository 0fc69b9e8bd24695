"""Moving batches from DataLoader workers to the main process: shared-memory slots per worker,
lent to the training loop, and the packets that point into them."""
