"""``python -m data.cli``: the same command as ``earlyfuse-prep``."""

import sys

from data.cli import main

sys.exit(main())
