"""Stored responses (`store: true`), for GET/DELETE /v1/responses/{id} and for continuing a
conversation by `previous_response_id`.

In memory and bounded (--responses-store-size entries; 0 stores nothing): past the bound the
least recently used response goes. Each entry keeps its whole conversation as input items (the
earlier responses' items, this request's input, this response's output), so a continuation
needs only its one predecessor, even after the older ones were evicted. Instructions are not
kept: OpenAI does not carry them over to the next response.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.frontend.server.responses.objects import ResponseObject
from deepinfer.frontend.server.responses.schema import InputItem


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    items: list[InputItem]  # the conversation, this response's output last


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: StoredResponse) -> None:
        if not self.enabled:
            return
        self._entries[stored.response.id] = stored
        self._entries.move_to_end(stored.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
