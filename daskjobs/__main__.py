"""``python -m daskjobs``: the ``daskjobs`` command."""

import sys

from .cli import main

sys.exit(main())
