"""``python -m aiosnap``: the command line (see ``aiosnap --help``)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
