"""``python -m transports.cli``: the same as the ``kvcs`` command."""

import sys

from transports.cli import main

sys.exit(main())
