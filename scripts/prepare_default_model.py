"""Prepare the default model (SmolLM2-135M-Instruct) once: `deepinfer prepare-model` under its
old name. The work is in engine/model_store, which ships with the package."""

from __future__ import annotations

import sys

from deepinfer.frontend.cli import main

if __name__ == "__main__":
    sys.exit(main(["prepare-model", *sys.argv[1:]]))
