"""GGUF variants of the shipped model for llama.cpp (``genfn.bench.llamacpp``):
``python benchmarks/llamacpp.py make-variants``."""

import sys

from genfn.bench.llamacpp import main

if __name__ == "__main__":
    sys.exit(main())
