"""`python -m deepinfer ...`: the `deepinfer` command."""

import sys

from deepinfer.frontend.cli import main

sys.exit(main())
