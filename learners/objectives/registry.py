"""A named registry: what a decorator beside each definition fills (estimators, policy losses,
preference losses). Registration order is kept; an unknown name is a one-line ValueError that
names the registered entries, a second registration of a name is refused."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        # What the entries are, for messages ("advantage estimator").
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        """Removes ``name`` (e.g. one a test registered); KeyError if there is none."""
        del self._entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self):
        return self._entries.items()

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; expected one of {', '.join(self._entries)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries
