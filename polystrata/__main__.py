"""`python -m polystrata` runs the CLI."""

import sys

from polystrata.cli import main

sys.exit(main())
