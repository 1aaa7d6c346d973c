"""`sdjax pnginfo`: print the generation parameters stored in PNG files (sdjax, AUTOMATIC1111 and compatible
tools), as text or parsed to JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from sdjax import infotext


def pnginfo(
    files: Annotated[list[Path], typer.Argument(exists=True, dir_okay=False, help="PNG files.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the parsed fields as JSON.")] = False,
) -> None:
    """Print the generation parameters stored in PNG files (sdjax, AUTOMATIC1111 and compatible tools)."""
    status = 0
    for path in files:
        try:
            text = infotext.read_parameters(path)
        except Exception as e:  # a file that is not an image, or a truncated or corrupt one: one line, go on
            typer.echo(f"{path}: {_unreadable(e)}", err=True)
            status = 1
            continue
        if text is None:
            typer.echo(f"{path}: no parameters chunk", err=True)
            status = 1
            continue
        if as_json:
            typer.echo(json.dumps({"file": str(path), **infotext.parse_parameters(text)}, ensure_ascii=False))
        else:
            typer.echo(f"{path}:\n{text}\n" if len(files) > 1 else text)
    raise typer.Exit(status)


def _unreadable(error: Exception) -> str:
    """Why `infotext.read_parameters` could not read a file, in words (for `pnginfo`)."""
    from PIL import UnidentifiedImageError

    if isinstance(error, UnidentifiedImageError):
        return "not an image (pnginfo reads PNG files)"
    if isinstance(error, OSError) and error.errno is not None:
        return f"cannot read it: {error.strerror or error}"
    if isinstance(error, (OSError, SyntaxError, ValueError, EOFError)):
        return f"truncated or corrupt image ({error})"
    raise error
