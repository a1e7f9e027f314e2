"""OpenAI's chat completions (chat.py) and legacy completions (completions.py): their response
objects and SSE chunks (objects.py) and logprobs formats (logprobs.py).

Their request structs are common/openai_schema.py's: the shape every other endpoint translates
onto too. Imports no other API folder.
"""
