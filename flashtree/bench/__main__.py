"""`python -m flashtree.bench ...`, the same as `flashtree bench ...`."""

import sys

from .cli import main

sys.exit(main())
