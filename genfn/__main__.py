"""``python -m genfn``: the ``genfn`` command (see ``genfn.cli``)."""

from genfn.cli import main

raise SystemExit(main())
