"""The ``nvfp4-mla`` command line (also ``python -m nvfp4_mla``).

Subcommands: ``info`` (GPU, versions, kernel cache), ``precompile`` (build kernels for serving
start-up, no GPU needed with ``--arch``), ``bench`` (the benchmark), ``demo`` (one small call,
fused on a GPU or the reference on the CPU) and ``inspect`` (pretty-print one record of a saved
cache; the record printer is :func:`nvfp4_mla.format_record`).
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..help_text import plain
from ..records import format_record
from . import demo, info, precompile

__all__ = ["INTERRUPTED_EXIT", "SIGPIPE_EXIT", "build_parser", "format_record", "main"]

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
INTERRUPTED_EXIT = 130  # 128 + SIGINT: what a shell reports for a command stopped with Ctrl-C


def cmd_bench(argv: list[str]) -> int:
    from ..bench import main as bench_main  # imported only when asked for

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The ``nvfp4-mla`` argument parser (``bench`` is listed here, parsed by the benchmark)."""
    parser = argparse.ArgumentParser(prog="nvfp4-mla", description=plain((__doc__ or "").split("\n\n")[0]))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info.add_parser(sub)
    precompile.add_parser(sub)
    sub.add_parser("bench", help="the benchmark on this GPU (nvfp4-mla bench -h for its options)", add_help=False)

    demo.add_parser(sub)
    return parser


def print_interrupted() -> None:
    """What a Ctrl-C leaves on stderr: one line, not a traceback."""
    print("nvfp4-mla: interrupted", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line on ``argv`` (default ``sys.argv[1:]``) and returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # (a Ctrl-C anywhere in a command, its imports included, ends here)
        if argv[:1] == ["bench"]:  # forwarded untouched, --help included
            status = cmd_bench(argv[1:])
        else:
            args = build_parser().parse_args(argv)
            status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here rather than at interpreter exit
    except BrokenPipeError:
        # The reader went away (``nvfp4-mla demo | head``): stop quietly. Point stdout at devnull
        # so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT
    except KeyboardInterrupt:
        print_interrupted()
        return INTERRUPTED_EXIT
    return status
