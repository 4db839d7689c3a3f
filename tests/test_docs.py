"""The documentation cannot rot silently: every public name has a docstring (the API
reference is generated from them), every Python block in docs/*.md and README.md compiles,
and each one either runs here (marked ``<!-- run -->`` on the line before its fence) or says
why it cannot (``<!-- fragment: <reason> -->``); every page of the site's navigation
exists, and every link between pages resolves. mkdocs is not needed here; ``nox -s docs``
builds the site itself with ``--strict``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import logging
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from types import CodeType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
RUN_MARK = "<!-- run -->"
#: A block that cannot run as it is (it needs a process group, a bucket, your model ...).
FRAGMENT_MARK = re.compile(r"<!-- fragment: (\S.*\S) -->")
SNIPPET = re.compile(r'^\s*--8<--\s+"([^"]+)"\s*$')

# -- (a) docstrings of the public API ----------------------------------------------------------


def _source_doc(module: str, name: str) -> str | None:
    """The docstring of ``name`` as the source of ``module`` gives it (what the API reference
    shows), following re-exports: a class's or function's docstring, a module's, or the
    string literal right after an assignment."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    package = spec.parent
    body = ast.parse(Path(spec.origin).read_text()).body
    for i, node in enumerate(body):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ast.get_docstring(node)
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                after = body[i + 1] if i + 1 < len(body) else None
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    return after.value.value if isinstance(after.value.value, str) else None
                return None
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) != name:
                    continue
                if node.module is None:  # from . import submodule
                    sub = importlib.util.resolve_name("." * node.level + alias.name, package)
                    sub_spec = importlib.util.find_spec(sub)
                    assert sub_spec is not None and sub_spec.origin is not None
                    return ast.get_docstring(ast.parse(Path(sub_spec.origin).read_text()))
                source = importlib.util.resolve_name("." * node.level + node.module, package)
                return _source_doc(source, alias.name)
    return None


def _public_names() -> list[tuple[str, str]]:
    names = []
    for module in ("aiosnap", "aiosnap.storage", "aiosnap.cli"):
        names += [(module, name) for name in importlib.import_module(module).__all__]
    return names


@pytest.mark.parametrize(("module", "name"), _public_names(), ids=lambda v: v)
def test_public_name_has_a_docstring(module: str, name: str) -> None:
    doc = _source_doc(module, name)
    assert doc and doc.strip(), f"{module}.{name} has no docstring in its source (an empty API entry)"
    obj = getattr(importlib.import_module(module), name)
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
        assert (inspect.getdoc(obj) or "").strip(), f"{module}.{name}.__doc__ is empty"


# -- (b) the code in the pages ------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    mark: str  # the last line before the fence that is not blank

    @property
    def run(self) -> bool:
        return self.mark == RUN_MARK

    @property
    def fragment(self) -> str | None:
        """Why the block does not run, as its mark says."""
        match = FRAGMENT_MARK.fullmatch(self.mark)
        return match.group(1) if match else None

    @property
    def id(self) -> str:
        return f"{_shown(self.page)}:{self.line}"


def _shown(page: Path) -> Path:
    return page.relative_to(ROOT) if page.is_relative_to(ROOT) else page


def _python_blocks(page: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    previous = ""  # the last non-blank line before a fence
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped.startswith("```"):
            if stripped:
                previous = stripped
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        fence = stripped[: len(stripped) - len(stripped.lstrip("`"))]
        lang = stripped[len(fence) :].strip().split(" ")[0]
        start, i = i + 1, i + 1
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        assert i < len(lines), f"{page}:{start}: unclosed code block"
        if lang in ("python", "py"):
            body = "\n".join(line[indent:] for line in lines[start:i])
            blocks.append(Block(page, start, body + "\n", previous))
        previous = ""
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in _python_blocks(page)]


def _compile(block: Block) -> CodeType:
    return compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


def _as_script(block: Block) -> CodeType:
    """A block that runs compiles as the file a reader would paste it into: no top-level
    ``await`` (a SyntaxError in a script), no include line that only the site expands."""
    return compile(block.code, block.id, "exec", dont_inherit=True)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_python_block_compiles(block: Block) -> None:
    _compile(block)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.run], ids=lambda b: b.id)
def test_marked_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = _as_script(block)
    namespace: dict[str, object] = {"__name__": "__main__"}
    log = logging.getLogger("aiosnap")
    handlers, level = list(log.handlers), log.level
    try:
        exec(code, namespace)
    finally:
        log.handlers[:], log.level = handlers, level


#: Pages that show an example file whole: the page's copy is the file.
EMBEDDED = {
    "fsdp2-example.md": "examples/fsdp2.py",
    "nodes.md": "examples/nodes.py",
    "storage-backend.md": "examples/dict_storage.py",
    "integration-accelerate.md": "examples/accelerate_ddp.py",
    "integration-transformers.md": "examples/transformers_ddp.py",
}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(_shown(p)))
def test_a_page_read_raw_holds_its_code_whole(page: Path) -> None:
    """A page on GitHub or in an editor is read as it is: an include that only the site
    expands (``--8<-- "examples/x.py"``) shows a reader a line that is not the code. An
    example file's code is written out in the page, and kept the same as the file."""
    text = page.read_text()
    assert not [line for line in text.splitlines() if SNIPPET.match(line)], f"{_shown(page)} includes a file"
    example = EMBEDDED.get(page.name)
    if example is not None:
        code = (ROOT / example).read_text()
        assert code in [b.code for b in _python_blocks(page)], f"{_shown(page)}'s copy of {example} differs"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_every_python_block_runs_or_says_why_it_cannot(block: Block) -> None:
    assert block.run or block.fragment, (
        f"{block.id}: put {RUN_MARK} on the line before the fence if the block runs as it is, "
        "else <!-- fragment: <why it cannot> -->"
    )


def test_the_marks_are_read_from_the_line_before_the_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run -->\n```python\nx = 1\n```\n\n<!-- fragment: needs a bucket -->\n\n```python\ny\n```\n"
        "<!-- fragment: -->\n```python\nz\n```\nprose\n```python\nw\n```\n"
    )
    blocks = _python_blocks(page)
    assert [(b.run, b.fragment) for b in blocks] == [
        (True, None),
        (False, "needs a bucket"),
        (False, None),  # a fragment must say why
        (False, None),
    ]


def test_every_quickstart_example_runs() -> None:
    blocks = [b for b in BLOCKS if b.page.name == "quickstart.md"]
    assert len(blocks) >= 2
    assert all(b.run for b in blocks), "mark each quickstart example <!-- run --> (it must run as it is)"


# -- (c) the site: navigation, links ------------------------------------------------------------


def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = re.search(r"^nav:\n((?:[ \t]+.*\n|\n)+)", text, re.M)
    assert nav is not None, "mkdocs.yml has no nav"
    return re.findall(r"([\w./-]+\.md)\s*$", nav.group(1), re.M)


def test_every_nav_page_exists_and_every_page_is_in_the_nav() -> None:
    nav = _nav_pages()
    assert "api.md" in nav and "index.md" in nav
    missing = [page for page in nav if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml names pages that do not exist: {missing}"
    orphans = sorted(p.name for p in DOCS.glob("*.md") if p.name not in nav)
    assert not orphans, f"pages not in the nav of mkdocs.yml (mkdocs --strict fails): {orphans}"


def test_api_reference_names_importable_modules() -> None:
    identifiers = re.findall(r"^:::\s*(\S+)", (DOCS / "api.md").read_text(), re.M)
    assert {"aiosnap", "aiosnap.storage", "aiosnap.cli"} <= set(identifiers)
    for identifier in identifiers:
        importlib.import_module(identifier)


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text)  # code spans and emphasis render as their text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if page.parent == DOCS and DOCS not in dest.parents:
            broken.append(f"{target} (outside docs/: not in the site)")
        elif not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_blocks_in_list_items_are_indented_four_spaces(page: Path) -> None:
    """Python-Markdown (the site) ends a list item at a code fence or a new paragraph indented
    less than 4 spaces, where GitHub does not: the rest of the item renders as plain text."""
    lines = page.read_text().splitlines()
    bad = [
        n + 1
        for n, line in enumerate(lines)
        if re.match(r"^ {1,3}\S", line)
        and (line.lstrip().startswith("```") or (n and not lines[n - 1].strip()))
    ]
    assert not bad, f"{page.name}: indent these lines of list items by 4 spaces: {bad}"
