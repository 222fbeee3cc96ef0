"""The embedded engine's prefix cache: the keys and values of finished sessions, kept for their next
turn (a multi-turn agent's next request starts with everything its last one held), least recently
saved dropped first once they exceed a token budget."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CachedPrefix:
    ids: list[int]
    keys: list[torch.Tensor]  # per layer (kv_heads, len(ids), head_dim)
    values: list[torch.Tensor]


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, CachedPrefix] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def save(self, session_id: str, entry: CachedPrefix) -> None:
        self.pop(session_id)
        self._entries[session_id] = entry
        self._tokens += len(entry.ids)
        while self._tokens > self.max_tokens:
            self.pop(next(iter(self._entries)))

    def pop(self, session_id: str) -> CachedPrefix | None:
        if (entry := self._entries.pop(session_id, None)) is not None:
            self._tokens -= len(entry.ids)
        return entry

    def clear(self) -> None:
        """Every entry (new weights make them stale)."""
        self._entries.clear()
        self._tokens = 0


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return n if a[:n] == b[:n] else next(i for i in range(n) if a[i] != b[i])
