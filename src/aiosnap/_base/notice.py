"""Telling the user what they must see, logging configured or not.

aiosnap logs to ``logging.getLogger("aiosnap...")`` with one NullHandler on the package
logger, as a library should; but that NullHandler also silences Python's last-resort
handler, so a user who configured no logging sees no WARNING at all. A few things must
reach them anyway: a call they wait on that is held up by retries (an object store
that does not answer), work that will be lost or left undone (uploads given up).
``notice`` logs those at WARNING, and where no handler would show them, issues an
``AiosnapWarning`` too (Python prints a warning once per place unless filtered).
"""

from __future__ import annotations

import logging
import warnings


class AiosnapWarning(UserWarning):
    """Something a user of aiosnap should see although it raises nothing: a call held up
    by a remote store that does not answer, uploads left undone. Filter it as any
    warning (``warnings.filterwarnings("ignore", category=aiosnap.errors.AiosnapWarning)``)."""


def notice(logger: logging.Logger, message: str) -> None:
    """Log ``message`` at WARNING; if no handler would show it, warn as well."""
    logger.warning("%s", message)
    if not _shown(logger):
        warnings.warn(f"aiosnap: {message}", AiosnapWarning, stacklevel=2)


def _shown(logger: logging.Logger) -> bool:
    """Whether a handler other than a NullHandler would emit a WARNING of ``logger``."""
    if not logger.isEnabledFor(logging.WARNING):
        return True  # the user turned aiosnap's warnings off: respect it
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False
