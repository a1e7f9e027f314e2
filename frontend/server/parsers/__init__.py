"""Output parsers: fed a request's generated text as it arrives, they split it into reasoning,
content and tool calls; streamed and whole answers share them, and so does every endpoint.

reasoning/ (`--reasoning-parser`) and tool_calls/ (`--tool-call-parser`) each keep one file per
model family behind one registry (registry.py): a new family is its file and a line there.
Parsers import no API folder.
"""
