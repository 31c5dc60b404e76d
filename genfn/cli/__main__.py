"""``python -m genfn.cli``: the ``genfn`` command."""

from genfn.cli import main

raise SystemExit(main())
