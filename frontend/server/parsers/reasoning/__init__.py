"""Reasoning parsers (`--reasoning-parser NAME`): the `<think>` reading shared by every family
(base.py), one file per family saying where its reasoning starts, and the registry of names
(registry.py)."""
