"""`python -m sdjax.cli`: the `sdjax` command."""

import sys

from sdjax.cli import main

sys.exit(main())
