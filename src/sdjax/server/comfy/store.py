"""The ComfyUI side's files and history, in memory and bounded: uploaded images ("input"), saved and previewed
images ("output", "temp"), and the history of finished prompts. Nothing is written to disk, so no name reaches the
file system; names are still checked as ComfyUI checks paths (a name with '..', a separator or a control character is
refused), so clients see ComfyUI's answers. The oldest entries go first when a bound is reached; all of it is lost
when the server stops (ComfyUI keeps files in its folders)."""

from __future__ import annotations

import collections
import re
from typing import Any

TYPES = ("input", "output", "temp")
_BAD = re.compile(r"[\x00-\x1f\x7f\\]")


def clean_name(name: Any, *, subfolder: bool = False) -> str | None:
    """`name` if it is a plain file name (or, with `subfolder`, a relative path of plain names); None otherwise."""
    if not isinstance(name, str) or len(name) > 255 or _BAD.search(name):
        return None
    if subfolder:
        if name in ("", "."):
            return ""
        parts = name.strip("/").split("/")
        return "/".join(parts) if name[:1] != "/" and all(p and p not in (".", "..") for p in parts) else None
    return name if name and "/" not in name and name not in (".", "..") else None


class Files:
    """(type, subfolder, filename) -> bytes; each type holds at most `max_files` files and `max_bytes` bytes, so
    generated images never push out the uploads a workflow still names."""

    def __init__(self, *, max_files: int = 256, max_bytes: int = 256 * 1024 * 1024):
        self.max_files, self.max_bytes = max_files, max_bytes
        self._files: dict[str, collections.OrderedDict[tuple[str, str], bytes]] = {
            k: collections.OrderedDict() for k in TYPES
        }
        self._bytes = dict.fromkeys(TYPES, 0)
        self._counters: dict[tuple[str, str], int] = {}

    def put(self, kind: str, subfolder: str, filename: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            raise ValueError(f"{len(data)} bytes exceed the store's {self.max_bytes}")
        files = self._files[kind]
        self.delete(kind, subfolder, filename)
        while files and (len(files) >= self.max_files or self._bytes[kind] + len(data) > self.max_bytes):
            _, old = files.popitem(last=False)
            self._bytes[kind] -= len(old)
        files[(subfolder, filename)] = data
        self._bytes[kind] += len(data)

    def delete(self, kind: str, subfolder: str, filename: str) -> None:
        old = self._files[kind].pop((subfolder, filename), None)
        if old is not None:
            self._bytes[kind] -= len(old)

    def get(self, kind: str, subfolder: str, filename: str) -> bytes | None:
        return self._files[kind].get((subfolder, filename)) if kind in self._files else None

    def exists(self, kind: str, subfolder: str, filename: str) -> bool:
        return (subfolder, filename) in self._files.get(kind, {})

    def names(self, kind: str) -> list[str]:
        return sorted(f"{s}/{f}" if s else f for s, f in self._files[kind])

    def read_input(self, name: str) -> bytes | None:
        """An uploaded image by LoadImage's value: "name", "subfolder/name", optionally with " [input]"."""
        text = name.removesuffix(" [input]").strip()
        sub, _, filename = text.rpartition("/")
        sub = clean_name(sub, subfolder=True)
        filename = clean_name(filename)
        if sub is None or filename is None:
            return None
        return self.get("input", sub, filename)

    def next_name(self, kind: str, prefix: str) -> tuple[str, str]:
        """ComfyUI's SaveImage naming: (subfolder, "{prefix}_{counter:05}_.png"); a prefix "a/b" saves under "a"."""
        sub, _, base = prefix.replace("\\", "/").rpartition("/")
        sub = clean_name(sub, subfolder=True) or ""
        base = clean_name(base) or "ComfyUI"
        n = self._counters.get((sub, base), 0) + 1
        self._counters[(sub, base)] = n
        return sub, f"{base}_{n:05}_.png"


class History:
    """prompt_id -> ComfyUI's history entry, the newest `max_items` kept."""

    def __init__(self, max_items: int = 200):
        self.max_items = max_items
        self._items: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def put(self, prompt_id: str, entry: dict) -> None:
        self._items[prompt_id] = entry
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, prompt_id: str) -> dict | None:
        return self._items.get(prompt_id)

    def last(self, n: int | None) -> dict[str, dict]:
        items = list(self._items.items())
        return dict(items[-n:] if n else items) if n != 0 else {}

    def delete(self, prompt_id: str) -> None:
        self._items.pop(prompt_id, None)

    def clear(self) -> None:
        self._items.clear()
