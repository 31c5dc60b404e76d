"""``genfn serve``: the OpenAI-compatible server of ``genfn.serve``, imported only when asked for,
so every other command works without the ``serve`` extra (fastapi, uvicorn)."""

from __future__ import annotations

import argparse
import importlib.util

from genfn.cli.common import UserError

__all__ = ["server_command", "add_arguments", "main", "SERVE_EXTRA_HINT"]

SERVE_EXTRA_HINT = "pip install 'genfn[serve]'"
_SERVE_DEPENDENCIES = ("fastapi", "starlette", "uvicorn")


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def server_command():
    """``genfn.serve.command`` (``add_arguments(parser)``, ``main(args) -> int``), or a UserError
    saying what to install. The extra is checked first: genfn.serve may import it only when the
    server starts, after minutes of loading."""
    for name in _SERVE_DEPENDENCIES:
        if _missing(name):
            raise UserError(f"genfn serve needs the 'serve' extra ({name} is not installed): {SERVE_EXTRA_HINT}")
    try:
        from genfn.serve import command
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        if missing in _SERVE_DEPENDENCIES:
            raise UserError(f"genfn serve needs the 'serve' extra ({missing} is not installed): "
                            f"{SERVE_EXTRA_HINT}") from None
        if (err.name or "").startswith("genfn.serve"):
            raise UserError("this genfn has no server (genfn.serve.command is missing)") from None
        raise
    return command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server_command().add_arguments(parser)


def main(args, status) -> int:
    return server_command().main(args)
