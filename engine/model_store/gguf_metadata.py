"""A GGUF file's key/value metadata as plain Python values.

Read through `ReaderField.parts`/`.data`, which every gguf release since 0.10 has (the newer
`contents()` is not in all of them).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader, GGUFValueType


def _value(parts, idx: int, vtype: GGUFValueType) -> Any:
    if vtype == GGUFValueType.STRING:
        return bytes(parts[idx]).decode("utf-8")
    value = parts[idx].tolist()
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every field: scalars and strings as themselves, arrays as lists."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            item = field.types[-1]
            out[key] = [_value(field.parts, i, item) for i in field.data]
        else:
            out[key] = _value(field.parts, field.data[0], field.types[0])
    return out
