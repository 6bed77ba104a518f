"""``python -m nvfp4_mla``: the ``nvfp4-mla`` command line of :mod:`nvfp4_mla.cli`."""

import sys

INTERRUPTED_EXIT = 130  # cli.INTERRUPTED_EXIT: this must not wait for cli's imports

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while cli's imports load (cli.main handles one after)
    print("nvfp4-mla: interrupted", file=sys.stderr, flush=True)
    sys.exit(INTERRUPTED_EXIT)

sys.exit(main())
