"""Training programs run on the emulated network: ordinary DDP scripts plus one Checkmate line."""
