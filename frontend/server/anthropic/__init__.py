"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`, messages.py): its
bodies (schema.py), translated into the shared chat request (request.py) and the chat path's
turns translated back into a message or its stream events (response.py).

Shapes only: every check of values and every generation is the shared path's (common/). Imports
no other API folder.
"""
