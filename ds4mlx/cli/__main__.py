"""`python -m ds4mlx.cli`: the `ds4mlx` command."""

import sys

from .commands import main

sys.exit(main())
