"""The API server: HTTP in, engine requests out over the engine client (never a model).

One folder per API, each a thin translation of its vendor's shapes onto one shared request path:
openai/ (chat completions, completions), anthropic/ (messages), responses/ (OpenAI's Responses
API). The API folders never import one another (an import-linter contract): what two of them
need lives in common/ (the request path: request structs, prompts, sampling, grammar, thinking,
engine calls, usage) or parsers/ (reasoning and tool-call parsers, one file per family). At this
level: the app and its route table (app.py), the process (server.py), the state every handler
shares (state.py), metrics, the OpenAPI document, errors and HTTP I/O, the LoRA routes.
"""
