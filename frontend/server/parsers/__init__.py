"""Output parsers: fed a request's generated text as it arrives, they split it into reasoning,
content and tool calls; streamed and whole answers share them, and so does every endpoint.
Parsers import no API folder.
"""
