"""A run's bookkeeping: output layout, input checks, checkpoints, resume plan, stop signals."""
