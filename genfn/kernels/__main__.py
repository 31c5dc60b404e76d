"""``python -m genfn.kernels [status|build]``: ``genfn kernels`` (genfn/cli/kernels.py) without the entry point."""

import sys

from genfn.cli import main

sys.exit(main(["kernels", *sys.argv[1:]]))
