"""The architecture's figures, read from the source alone (nothing of aiosnap is imported).

    python benchmarks/architecture.py [--src src/aiosnap] [--json]

Issue 41 set its targets in these figures: the size of the classes and functions of the
manager and save wings, the manager's constructor, the places where the manager probes its
writer, reach-through chains (``self.a.b.c``), private names read across modules, the
open/close state machines, and the public surface (the top-level ``__all__``, and names
exported there and by a public submodule as well). Rerun it before and after a change of
structure and compare; circles and imports that run back up are the import graph's
business, not this script's.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: The wings whose classes and functions the targets bound.
WINGS = ("_manager", "_save")
#: A class or a function longer than this (lines) counts against the targets.
CLASS_LIMIT, FUNCTION_LIMIT = 300, 50
#: What the manager calls to find out what its writer is or has.
PROBES = {"getattr", "hasattr", "isinstance", "signature", "callable"}


@dataclass
class Figures:
    classes_over: list[tuple[str, int]] = field(default_factory=list)
    manager_lines: int = 0
    manager_code_lines: int = 0
    manager_branches: int = 0
    manager_trys: int = 0
    manager_tier_none: int = 0
    functions_over: list[tuple[str, int]] = field(default_factory=list)
    longest: tuple[str, int] = ("", 0)
    init_parameters: int = 0
    probes: list[str] = field(default_factory=list)
    chains: list[str] = field(default_factory=list)
    private_reads: list[str] = field(default_factory=list)
    state_machines: list[str] = field(default_factory=list)
    all_size: int = 0
    exported_twice: list[str] = field(default_factory=list)
    writer_options: list[str] = field(default_factory=list)


def _modules(src: Path) -> Iterator[tuple[str, ast.Module, str]]:
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        yield str(path.relative_to(src)), ast.parse(text), text


def _lines(node: ast.AST) -> int:
    return int(getattr(node, "end_lineno", 0)) - int(getattr(node, "lineno", 0)) + 1


def _in_wing(rel: str) -> bool:
    return rel.split("/")[0] in WINGS


def _code_lines(node: ast.ClassDef, text: str) -> int:
    """Lines of ``node`` that hold code: not blank, not only a comment, not a docstring."""
    doc: set[int] = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                doc.update(range(body[0].lineno, int(body[0].end_lineno or body[0].lineno) + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if node.lineno <= tok.start[0] <= int(node.end_lineno or 0):
            code.add(tok.start[0])
    return len(code - doc)


def _chain(node: ast.Attribute) -> list[str] | None:
    """``self.a.b.c`` as ["a", "b", "c"]; None where it does not start at ``self``."""
    names: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name) and current.id == "self":
        return names[::-1]
    return None


def _chains(rel: str, tree: ast.Module) -> list[str]:
    """Maximal chains of three attributes or more read through ``self``."""
    inner: set[int] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            names = _chain(node)
            current: ast.expr = node.value
            while isinstance(current, ast.Attribute):
                inner.add(id(current))
                current = current.value
            if names is not None and len(names) >= 3:
                found.append(f"{rel}:{node.lineno} self.{'.'.join(names)}")
    return found


def _mentions_writer(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and "writer" in n.id.lower())
        or (isinstance(n, ast.Attribute) and "writer" in n.attr.lower())
        for n in ast.walk(node)
    )


def _at_construction(tree: ast.Module) -> set[int]:
    """The nodes of ``WriterPort.__init__``: the one place that looks at the writer, once,
    when the manager is made (issue 41 asks for that, and for no probe at call time)."""
    inside: set[int] = set()
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == "WriterPort":
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    inside.update(id(n) for n in ast.walk(fn))
    return inside


def _probes(rel: str, tree: ast.Module) -> list[str]:
    """Calls in the manager's wing that ask what its writer is or has at call time
    (those of ``WriterPort.__init__``, once at construction, are not counted)."""
    found = []
    once = _at_construction(tree)
    for node in ast.walk(tree):
        if id(node) in once:
            continue
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if (name in PROBES and _mentions_writer(node.args[0])) or name == "signature":
            found.append(f"{rel}:{node.lineno} {ast.unparse(node)[:70]}")
    return found


def _private_reads(rel: str, tree: ast.Module) -> list[str]:
    """Private names (``_x``, not dunders) taken from another of aiosnap's modules."""
    found = []
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("aiosnap")):
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and alias.name not in _PACKAGES:
                    found.append(f"{rel}:{node.lineno} from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in _PACKAGES
        ):
            found.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}")
    return found


#: aiosnap's private folders and modules: importing one is no private read.
_PACKAGES: set[str] = set()


def _state_machines(rel: str, tree: ast.Module) -> list[str]:
    """Classes that keep an open/close state of their own: an attribute of theirs set to "closed"."""
    found = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                targets = [t for t in node.targets if isinstance(t, ast.Attribute)]
                if targets and node.value.value == "closed":
                    found.append(f"{rel} {cls.name}")
                    break
    return found


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id == "__all__" and isinstance(node.value, ast.List):
            return [
                e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
    return []


def _origins(rel: str, tree: ast.Module) -> dict[str, str]:
    """Each name the module holds at its top: where it is defined (module path, name)."""
    here = ("aiosnap/" + rel).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    package = here if rel.endswith("__init__.py") else here.rpartition(".")[0]
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = f"{base}.{node.module}" if node.level and node.module else node.module or base
            for alias in node.names:
                found[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = f"{here}.{node.name}"
    return found


def measure(src: Path) -> Figures:
    figures = Figures()
    modules = list(_modules(src))
    _PACKAGES.update(p.stem if p.suffix else p.name for p in src.rglob("_*") if not p.name.startswith("__"))
    for rel, tree, text in modules:
        wing = _in_wing(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                if wing and _lines(node) > CLASS_LIMIT:
                    figures.classes_over.append((f"{rel} {node.name}", _lines(node)))
                if node.name == "CheckpointManager":
                    figures.manager_lines = _lines(node)
                    figures.manager_code_lines = _code_lines(node, text)
                    figures.manager_branches = sum(isinstance(n, ast.If | ast.IfExp) for n in ast.walk(node))
                    figures.manager_trys = sum(isinstance(n, ast.Try) for n in ast.walk(node))
                    figures.manager_tier_none = sum(
                        isinstance(n, ast.Compare)
                        and "_tier" in ast.unparse(n.left)
                        and isinstance(n.ops[0], ast.Is | ast.IsNot)
                        for n in ast.walk(node)
                    )
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                            a = item.args
                            figures.init_parameters = len(a.args) - 1 + len(a.kwonlyargs)
                if node.name == "WriterOptions":
                    figures.writer_options.append(rel)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = _lines(node)
                if wing and lines > FUNCTION_LIMIT:
                    figures.functions_over.append((f"{rel} {node.name}", lines))
                if lines > figures.longest[1]:
                    figures.longest = (f"{rel} {node.name}", lines)
        if rel.startswith("_manager/"):
            figures.probes += _probes(rel, tree)
            figures.chains += _chains(rel, tree)
        figures.private_reads += _private_reads(rel, tree)
        figures.state_machines += _state_machines(rel, tree)
    init = next(tree for rel, tree, _ in modules if rel == "__init__.py")
    top = _all(init)
    figures.all_size = len(top)
    seen = {name for name in top if top.count(name) > 1}
    where = _origins("__init__.py", init)
    for rel, tree, _ in modules:
        parts = rel.split("/")
        public = rel != "__init__.py" and not any(p.startswith("_") and p != "__init__.py" for p in parts)
        if public:
            theirs = _origins(rel, tree)
            seen |= {n for n in set(top) & set(_all(tree)) if where.get(n) == theirs.get(n)}
    figures.exported_twice = sorted(seen)
    return figures


def report(figures: Figures) -> str:
    over = ", ".join(f"{name} {n}" for name, n in sorted(figures.classes_over, key=lambda x: -x[1]))
    functions = ", ".join(f"{name} {n}" for name, n in sorted(figures.functions_over, key=lambda x: -x[1]))
    rows = [
        f"classes over {CLASS_LIMIT} lines in {'/'.join(WINGS)}: {len(figures.classes_over)} ({over})",
        f"CheckpointManager: {figures.manager_lines} lines, {figures.manager_code_lines} of code, "
        f"{figures.manager_branches} branches, {figures.manager_trys} try, "
        f"{figures.manager_tier_none} `_tier is (not) None`",
        f"functions over {FUNCTION_LIMIT} lines in {'/'.join(WINGS)}: "
        f"{len(figures.functions_over)} ({functions})",
        f"longest function: {figures.longest[0]} {figures.longest[1]}",
        f"CheckpointManager.__init__ parameters: {figures.init_parameters}",
        f"probes of the writer in _manager at call time: {len(figures.probes)}",
        *(f"    {p}" for p in figures.probes),
        f"reach-through chains in _manager: {len(figures.chains)}",
        *(f"    {c}" for c in figures.chains),
        f"private names read across modules: {len(figures.private_reads)}",
        *(f"    {p}" for p in figures.private_reads),
        f"open/close state machines: {len(figures.state_machines)} ({', '.join(figures.state_machines)})",
        f"top-level __all__: {figures.all_size} names; exported twice: {len(figures.exported_twice)}",
        f"    {', '.join(figures.exported_twice)}",
        f"classes named WriterOptions: {len(figures.writer_options)} ({', '.join(figures.writer_options)})",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", default=str(Path(__file__).resolve().parent.parent / "src" / "aiosnap"))
    parser.add_argument("--json", action="store_true", help="the figures as JSON")
    args = parser.parse_args()
    figures = measure(Path(args.src))
    print(json.dumps(figures.__dict__, indent=1) if args.json else report(figures))


if __name__ == "__main__":
    main()
