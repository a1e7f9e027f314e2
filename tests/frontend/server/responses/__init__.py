"""Tests of the OpenAI Responses API (frontend/server/responses/)."""
