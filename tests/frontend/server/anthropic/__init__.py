"""Tests of the Anthropic Messages API (frontend/server/anthropic/)."""
