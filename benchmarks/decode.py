"""The decode benchmark (``genfn.bench.decode``), run from a checkout: ``python benchmarks/decode.py [--quick] ...``.

It keeps OpenMP's default wait policy (``GENFN_WAIT_POLICY=default`` unless set), as the published
tables were measured; ``python -m genfn.bench --help`` lists the options.
"""

import os
import sys

os.environ.setdefault("GENFN_WAIT_POLICY", "default")

from genfn.bench.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
