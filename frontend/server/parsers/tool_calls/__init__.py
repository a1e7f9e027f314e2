"""Tool calls: the request's tools checked (tools.py), and the model's output read for calls.

Each family's call format is a file (hermes.py, qwen3_xml.py, deepseek.py, mistral.py; the
helpers they share in call_format.py), named in one registry (registry.py,
`--tool-call-parser NAME`). The streaming machinery is shared by all: parser.py (content and
calls as text arrives), array_scanner.py (JSON arrays of calls), call_log.py (the calls found).
"""
