"""``python -m benchmarks --backend NAME``: see ``benchmarks/cli.py``."""

import sys

from benchmarks.cli import main

sys.exit(main())
