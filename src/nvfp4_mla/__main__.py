"""``python -m nvfp4_mla``: the ``nvfp4-mla`` command line of :mod:`nvfp4_mla.cli`."""

import sys

from .cli import main

sys.exit(main())
