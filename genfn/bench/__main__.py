"""``python -m genfn.bench``: the decode benchmark (``genfn.bench.decode``)."""

from genfn.bench.decode import main

raise SystemExit(main())
