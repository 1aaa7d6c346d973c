"""Generated images kept for a while behind unguessable ids, for OpenAI's `response_format: "url"`.

`FileStore` is bounded in count and bytes (the oldest go first) and forgets an image `ttl_s` after storing it; the
server answers `GET /v1/files/{id}` from it. The ids (`img-` + 128 random bits) are the only credential, like the
signed URLs OpenAI returns, so the route needs no API key and a link can be handed to a browser.
"""

from __future__ import annotations

import collections
import secrets
import time


class FileStore:
    """Bounded, expiring in-memory store of PNG bytes. Used from the event loop only."""

    def __init__(self, *, ttl_s: float = 3600.0, max_files: int = 256, max_bytes: int = 256 * 1024 * 1024):
        if ttl_s <= 0 or max_files < 1 or max_bytes < 1:
            raise ValueError(f"FileStore: ttl_s={ttl_s}, max_files={max_files}, max_bytes={max_bytes} must be > 0")
        self.ttl_s = ttl_s
        self.max_files = max_files
        self.max_bytes = max_bytes
        self._files: collections.OrderedDict[str, tuple[float, bytes]] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._files)

    @property
    def nbytes(self) -> int:
        self._expire()
        return self._bytes

    def put(self, data: bytes) -> str:
        """Store `data`; returns its id. Evicts the oldest files to stay within the bounds."""
        if len(data) > self.max_bytes:
            raise ValueError(f"a file of {len(data)} bytes exceeds the store's {self.max_bytes} bytes")
        self._expire()
        while self._files and (len(self._files) >= self.max_files or self._bytes + len(data) > self.max_bytes):
            self._pop_oldest()
        file_id = "img-" + secrets.token_urlsafe(16)
        self._files[file_id] = (time.monotonic() + self.ttl_s, data)
        self._bytes += len(data)
        return file_id

    def get(self, file_id: str) -> bytes | None:
        self._expire()
        item = self._files.get(file_id)
        return None if item is None else item[1]

    def _pop_oldest(self) -> None:
        _, (_, data) = self._files.popitem(last=False)
        self._bytes -= len(data)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._files:
            expires, _ = next(iter(self._files.values()))
            if expires > now:
                break
            self._pop_oldest()
