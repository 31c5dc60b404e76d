"""genfn's decode benchmark, shipped with the package: ``python -m genfn.bench`` (or ``genfn bench``).

``genfn.bench.decode`` measures genfn against transformers and llama.cpp side by side in one
process; ``genfn.bench.llamacpp`` drives llama.cpp; ``genfn.bench.results`` says where results go.
The peers come with the ``bench`` extra and are imported only when a benchmark runs, so importing
genfn never imports them. The other measurement scripts live in the repository's ``benchmarks/``.
"""
