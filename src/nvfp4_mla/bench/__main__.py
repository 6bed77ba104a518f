"""``python -m nvfp4_mla.bench``: the same as ``nvfp4-mla bench``."""

import sys

from .run import main

sys.exit(main())
