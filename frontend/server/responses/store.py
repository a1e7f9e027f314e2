"""Stored responses (`store: true`), for GET/DELETE /v1/responses/{id} and for continuing a
conversation by `previous_response_id`.

In memory and bounded twice (--responses-store-size entries, 0 storing nothing, and
--responses-store-mb of their encoded size): past either bound the least recently used
response goes. Each entry keeps its whole conversation as input items (the earlier responses'
items, this request's input, this response's output), so a continuation needs only its one
predecessor, even after the older ones were evicted; an entry is counted with its whole
conversation, so a long chain is bounded by bytes, not by its number of entries, and one larger
than the byte bound is not kept (a continuation of it gets the 404 of an evicted response).
Instructions are not kept: OpenAI does not carry them over to the next response.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from deepinfer.frontend.server.responses.objects import ResponseObject
from deepinfer.frontend.server.responses.schema import InputItem

log = logging.getLogger("deepinfer.api")


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    items: list[InputItem]  # the conversation, this response's output last

    def nbytes(self) -> int:
        """Its size as the store counts it: the conversation and the response, encoded."""
        return len(msgspec.json.encode(self.items)) + len(msgspec.json.encode(self.response))


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int = 256 << 20) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: StoredResponse) -> None:
        if not self.enabled:
            return
        size = stored.nbytes()
        if size > self.max_bytes:
            log.warning("response %s not stored: its conversation is %d bytes, more than "
                        "--responses-store-mb allows", stored.response.id, size)
            return
        self.delete(stored.response.id)
        self._entries[stored.response.id] = (stored, size)
        self.nbytes += size
        while len(self._entries) > self.capacity or self.nbytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.nbytes -= evicted

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry[1]
        return entry is not None
