"""Reasoning parsers (`--reasoning-parser NAME`)."""
