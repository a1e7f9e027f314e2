"""Tests of the reasoning and tool-call parsers (frontend/server/parsers/)."""
