"""``python -m mok_cute.bench``: see :mod:`mok_cute.bench.cli`."""
import sys

from mok_cute.bench.cli import main

sys.exit(main())
