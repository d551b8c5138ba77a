"""``python -m kvcs.transports.cli``: the same as the ``kvcs`` command."""

import sys

from kvcs.transports.cli import main

sys.exit(main())
