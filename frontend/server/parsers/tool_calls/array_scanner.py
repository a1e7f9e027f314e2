"""Reading a JSON array of calls, `[{"name": "f", "arguments": {...}}, ...]`, item by item as its
characters arrive: what a grammar forces for tool_choice "required"."""

from __future__ import annotations


class ArrayScanner:
    """Character-level reader of a JSON array: hands out each top-level item's text once the
    item is complete. Tracks bracket depth and string/escape state only; whether an item is a
    call is the caller's question."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.item: list[str] | None = None  # the item being read, from its opening bracket
        self.closed = False  # the array's closing bracket came
        self.since: list[str] = []  # the text after the last complete item

    def feed(self, text: str) -> list[str]:
        """The items `text` completes, in order."""
        items: list[str] = []
        for c in text:
            self.since.append(c)
            if self.item is not None:
                self.item.append(c)
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
                if self.depth == 2:
                    self.item = [c]
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1 and self.item is not None:
                    items.append("".join(self.item))
                    self.item, self.since = None, []
                elif self.depth == 0:
                    self.closed = True
        return items
