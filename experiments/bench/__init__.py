"""``make bench``: Checkmate next to the checkpointing users pick today (see :mod:`experiments.bench.cli`)."""
