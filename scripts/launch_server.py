"""Launch the OpenAI-compatible server: same as `deepinfer serve ...` (see frontend/cli.py)."""

from __future__ import annotations

import sys

from deepinfer.frontend.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
