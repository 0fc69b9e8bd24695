"""Pure planning: options, an epoch's sequence of splits (shuffled or not), its deal to the
streams, the order in which a stream delivers its share, and an epoch as values (where an
iteration starts, each stream's position, the state it makes). No I/O."""
