"""``python -m tensorplay``: the same command line as the ``tensorplay`` console script."""

import sys

from tensorplay.cli import main

sys.exit(main())
