"""``python -m hyper_parallel``: the ``hyper-parallel`` command line (hyper_parallel/cli.py)."""

import sys

from .cli import main

sys.exit(main())
