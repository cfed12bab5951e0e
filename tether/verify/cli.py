"""The ``tether verify`` sub-commands (registered on ``tether.cli.app`` as ``verify``).

Exit codes, for every sub-command: 0 all criteria hold, 1 some failed (the diagnosis is printed), 2 bad input.
Imports of ``tether.cli`` are inside the commands: ``tether.cli`` imports this module to register it.
"""

from __future__ import annotations

import typer

verify_app = typer.Typer(
    help="Check that a run is actually learning: environment, async pipeline, optimisation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
