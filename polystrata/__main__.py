"""`python -m polystrata` runs the CLI."""

import sys

try:  # a Ctrl-C during the first imports, before main() can handle it, still ends with one line
    from polystrata.cli import main
except KeyboardInterrupt:
    print("error: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
