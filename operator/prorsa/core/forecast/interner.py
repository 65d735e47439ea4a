"""Small ints for label strings, so the table's columns hold codes and never strings."""

from __future__ import annotations

from dataclasses import dataclass, field


class Interner:
    """Small ints for label strings (tasks, tools, images, instances), capped in number.

    Past the cap every new label maps to one shared "other" code, which keeps memory
    bounded when a trainer puts unbounded values in a label field.
    """

    OTHER = 0

    def __init__(self, *, cap: int = 8192) -> None:
        self._codes: dict[str, int] = {"": 0}
        self.names: list[str] = [""]
        self._cap = cap

    def code(self, name: str | None) -> int:
        if name is None:
            return -1
        code = self._codes.get(name)
        if code is None:
            if len(self.names) >= self._cap:
                return self.OTHER
            code = self._codes[name] = len(self.names)
            self.names.append(name)
        return code

    def get(self, name: str) -> int | None:
        return self._codes.get(name)

    def name(self, code: int) -> str | None:
        return None if code < 0 else self.names[code]


@dataclass(frozen=True, slots=True)
class Labels:
    """The labels the statistics are conditioned on (Eq. 6, 9) and the prefill instances."""

    tasks: Interner = field(default_factory=Interner)
    tools: Interner = field(default_factory=Interner)
    images: Interner = field(default_factory=Interner)
    nodes: Interner = field(default_factory=Interner)
    instances: Interner = field(default_factory=lambda: Interner(cap=4096))
