"""``python -m hyper_parallel``: the ``hyper-parallel`` command line (hyper_parallel/tools/cli.py)."""

import sys

from .tools.cli import main

sys.exit(main())
