"""``python -m daskjobs.cli``: the ``daskjobs`` command."""

import sys

from . import main

sys.exit(main())
