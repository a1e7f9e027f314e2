"""The one request path every endpoint translates onto: OpenAI's chat (or completions) request
in, engine requests and the assistant's turns out.

Request structs (openai_schema.py) are the shape the Anthropic and Responses endpoints translate
into; prompts, sampling params, grammar, thinking switches and KV transfer are resolved once
here (chat_turns.py, for every chat-shaped endpoint), engine work runs in generation.py, and
usage is counted once (usage.py). Nothing here imports an API folder, so a fix lands on every
endpoint at once.
"""
