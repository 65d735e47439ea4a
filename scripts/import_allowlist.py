"""An import-linter contract that allows instead of denying: ``type = "allowed"``.

Import-linter's own contracts name what may not be imported (``forbidden``); a deny-list
lets through every module nobody thought to name (``_socket``, ``sqlite3``, ``importlib``,
a new third-party library). This one names what the source modules may import and breaks
on anything else, so the control core's "no I/O" is a list of what it uses, not of what
it must avoid. ``lint-imports`` loads it from the repository root (``contract_types`` in
pyproject.toml's ``[tool.importlinter]``).

Options:
- ``source_modules``: the packages held to the list (each with its descendants).
- ``allowed_modules``: what they may import directly, each with its descendants; an
  external module is named by its top-level package (import-linter sees ``numpy``, not
  ``numpy.linalg``), a module of the root packages by its dotted name.
"""

from __future__ import annotations

from typing import Any

from importlinter import Contract, ContractCheck, fields, output


class AllowedImportsContract(Contract):
    """Every direct import of ``source_modules`` is one of ``allowed_modules`` (or inside
    one). Imports under ``if TYPE_CHECKING:`` count too: import-linter reads them."""

    type_name = "allowed"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        allowed: list[str] = list(self.allowed_modules)  # type: ignore[call-overload]
        sources: list[str] = list(self.source_modules)  # type: ignore[call-overload]
        importers = sorted(
            {module for source in sources for module in graph.find_descendants(source)}
            | set(sources)
        )
        outside = [
            {
                "importer": importer,
                "imported": imported,
                "line_numbers": sorted(
                    d["line_number"]
                    for d in graph.get_import_details(importer=importer, imported=imported)
                ),
            }
            for importer in importers
            for imported in sorted(graph.find_modules_directly_imported_by(importer))
            if not any(imported == a or imported.startswith(f"{a}.") for a in allowed)
        ]
        return ContractCheck(kept=not outside, metadata={"outside": outside})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error("Imports outside the allowed modules:")
        output.new_line()
        for found in check.metadata["outside"]:
            lines = ", ".join(f"l.{n}" for n in found["line_numbers"]) or "l.?"
            output.print_error(f"-   {found['importer']} -> {found['imported']} ({lines})")
        output.new_line()
        output.print_error(
            "Import what the core needs from the allowed list, or argue the new module into "
            "allowed_modules in pyproject.toml (docs/architecture.md, 'Layers and import "
            "contracts')."
        )
