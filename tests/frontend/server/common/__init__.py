"""Tests of the shared request path (frontend/server/common/)."""
