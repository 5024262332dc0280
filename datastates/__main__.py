"""`python -m datastates` works like the `datastates` script."""

import sys

from .cli import main

sys.exit(main())
