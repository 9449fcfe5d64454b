"""Commands of this area (filled in by its issue)."""

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this area's commands to the app."""
