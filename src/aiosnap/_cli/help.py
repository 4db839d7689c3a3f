"""How the command line's help reads: typer's command and group classes, adjusted.

Typer shows every option's type, so a flag read ``--json <bool>`` (and ``--json true``
is refused); an argument in the usage line read ``{checkpoint}``; and a docstring's
line breaks were kept, so the list of commands broke lines mid-sentence where the
source did. Here a flag shows as itself, the usage line names arguments as
``CHECKPOINT`` (``[NAME]`` when optional), and each paragraph of help text is one line
that the terminal wraps.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer.core

__all__ = ["Command", "Group", "reflow"]


def reflow(text: str | None) -> str | None:
    """``text`` with each paragraph on one line (paragraphs stay apart)."""
    if text is None:
        return None
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def _plain_flags(params: list[Any]) -> list[Any]:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # typer shows the metavar instead of the type: nothing
    return params


class Command(typer.core.TyperCommand):
    """A subcommand: flags without a type, arguments in capitals, help reflowed."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=reflow(help), **kwargs)

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, typer.core.TyperArgument):
                name = (param.metavar or param.name or "").upper()
                name = name if param.required else f"[{name}]"
                pieces.append(name + ("..." if param.nargs != 1 else ""))
        return pieces


class Group(typer.core.TyperGroup):
    """The top level: its own flags (``--version``, ``--help``) without a type."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=reflow(help), **kwargs)

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))
