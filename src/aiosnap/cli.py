"""The ``aiosnap`` command line, from Python: ``aiosnap.cli.main(["verify", path])``.

``main`` runs one command as the console script does (the script is this function) and
returns its exit code instead of exiting: 0 done, 1 a check failed (``verify``) or the two
differ (``diff``), 2 an error, said in one line on stderr. Results go to stdout. Not
imported by ``import aiosnap``: the command line's own dependencies (typer, rich) load only
when it is used.
"""

from __future__ import annotations

from ._cli.main import main as main

__all__ = ["main"]
