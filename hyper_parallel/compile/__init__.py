"""Compiling one input signature of a parallelized module into its per-rank program (driver.py)."""
