"""A size-bounded mapping that forgets the least recently used entry first.

For per-process caches keyed by something unbounded (conversations, monologues): a forgotten
entry costs one store query to rebuild, whereas a plain dict grows for as long as the process
lives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_MAXSIZE = 10_000


class LRUCache(MutableMapping[K, V], Generic[K, V]):
    """At most ``maxsize`` entries; any use of an entry makes it the most recent."""

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE) -> None:
        if maxsize < 1:
            raise ValueError(f"an LRU cache holds at least one entry, not {maxsize}")
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __getitem__(self, key: K) -> V:
        value = self._entries[key]
        self._entries.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._entries[key]

    def __contains__(self, key: object) -> bool:
        # A membership test is a use too (egress asks "settled?" of its busiest monologues).
        if key in self._entries:
            self._entries.move_to_end(key)  # type: ignore[arg-type]
            return True
        return False

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
