"""OpenAI's Responses API (`/v1/responses`, handlers.py): its bodies (schema.py, objects.py),
input items translated into the shared chat request (input.py), the chat path's turn as output
items (output.py) or as SSE events (stream.py), and the finished responses kept for GET and
`previous_response_id` (store.py).

Shapes only: every check of values and every generation is the shared path's (common/). Imports
no other API folder (state.py holds the store; that one edge is the exception the contract names).
"""
