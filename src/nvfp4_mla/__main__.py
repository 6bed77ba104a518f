"""The ``nvfp4-mla`` command line of :mod:`nvfp4_mla.cli`: :func:`main` is the console script's
entry and what ``python -m nvfp4_mla`` runs."""

from __future__ import annotations

import sys

INTERRUPTED_EXIT = 130  # cli.INTERRUPTED_EXIT: this must not wait for cli's imports


def main(argv: list[str] | None = None) -> int:
    """Runs the command line on ``argv`` (default ``sys.argv[1:]``) and returns the exit status.
    A Ctrl-C while cli's imports load (torch: seconds) ends as one in a command does: one line on
    stderr, exit status 130."""
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:  # cli.main handles one after
        print("nvfp4-mla: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
