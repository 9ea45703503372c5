"""Fully sharded data parallelism: the program-changing runtime flags (flags.py)."""
