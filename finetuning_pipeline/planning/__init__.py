"""Planning TPU time before renting it: the chips' figures and the cost model (HBM, step time, TPU-hours)."""
