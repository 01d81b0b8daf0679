"""The docs name only what exists: a rename in the code fails here until the docs follow it.

The code is read from its source (AST), not imported (the settings aside), so this needs no
broker, store or optional package:

- every module of the SDK and the services is on the map of the code (docs/architecture.md),
  and every module the map lists exists;
- every code name README.md and docs/**/*.md put in backticks (outside fenced blocks)
  resolves. Which spans are code names: a dotted name whose first part is ``yoke``,
  ``services``, a module of the project by its name or its tail (``topology``,
  ``calls.records``) or one of its classes (``Store.insert_message``: members, ``self.``
  attributes, pydantic fields by name and camelCase alias, inherited from project bases); a
  dotted name whose last part is a class or constant of the project behind a prefix that is
  none of its modules (``upgrades.REMOVABLE_IN``: a module renamed); a CamelCase word (a class:
  ``Store``); an UPPER_SNAKE word (a constant, or a name the repository uses outside the docs:
  ``MAX_TOOLS``, ``OPENAI_API_KEY``); a ``YOKE_*`` variable (a setting, or used outside the
  docs); a file path (the repository holds it, whole or as its tail) and a test
  (``test_mesh.py::test_...``, defined in that file). Wire names the code declares
  (``yoke.commands``, ``conversation.message.posted``, ``yoke.tool.NAME``) are not code, and
  neither is a lowercase word alone (a field, a collection, a verb). ``EXTERNAL`` lists the
  few spans shaped like ours that are someone else's;
- every setting (``yoke.core.settings.Settings``) has a row in a settings table.
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic.alias_generators import to_camel

from yoke.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SOURCE_ROOTS = {"yoke": ROOT / "shared" / "yoke", "services": ROOT / "services"}

IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"{IDENTIFIER}(?:\.{IDENTIFIER})+")
CAMEL_CASE = re.compile(r"_?[A-Z][a-z0-9]+[A-Za-z0-9_]*")
CONSTANT = re.compile(r"_?[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
ENV_VAR = re.compile(r"YOKE_[A-Z0-9_]*[A-Z0-9]")
TEST_ID = re.compile(rf"(?P<file>[\w/.-]+\.py)::(?P<name>{IDENTIFIER})(?:\[.*\])?")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
FILE_SUFFIXES = (".py", ".md", ".json", ".toml", ".yml", ".yaml", ".js", ".html", ".sh", ".cfg")

# Names in backticks that look like a project class or constant and are someone else's.
EXTERNAL = {
    "Authorization": "an HTTP header",
    "Host": "an HTTP header",
    "Origin": "an HTTP header",
    "EventSource": "the browser's server-sent events API",
    "BatchSpanProcessor": "OpenTelemetry's SDK",
    "DuplicateKeyError": "pymongo",
    "YokeToolCallsOverdue": "a Prometheus alert (deploy/prometheus)",
    "YokeEscalationUnclaimed": "a Prometheus alert (deploy/prometheus)",
    "VIRTUAL_ENV": "the variable a Python virtual environment sets",
    "site/index.html": "what `make docs` builds, not kept in the repository",
    "tests/test_tools.py": "a plugin's own tests (docs/tools.md), not this repository's",
}


@dataclass
class Namespace:
    """What a module or class defines: names, and for a class its bases' names."""

    names: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class Code:
    """The project's modules and classes, by the names docs use for them."""

    modules: dict[str, Namespace]  # dotted module name -> its top-level names
    classes: dict[str, list[Namespace]]  # class name -> every class of that name
    short: dict[str, list[str]]  # a module's relative names (``records``, ``calls.records``)
    defined: set[str]  # every name defined anywhere (top level or in a class)

    def module_attributes(self, module: str, parts: list[str]) -> bool:
        """Whether ``parts`` resolve inside ``module`` (a submodule, a name, a class member)."""
        if not parts:
            return True
        head, *rest = parts
        if f"{module}.{head}" in self.modules:
            return self.module_attributes(f"{module}.{head}", rest)
        if head not in self.modules[module].names:
            return False
        if not rest:
            return True
        return head in self.classes and self.class_attributes(head, rest)

    def class_attributes(
        self, name: str, parts: list[str], seen: frozenset[str] = frozenset()
    ) -> bool:
        """Whether ``parts`` resolve on a class ``name`` (its own members or its bases')."""
        head, *rest = parts
        for namespace in self.classes.get(name, []):
            if head in namespace.names:
                return not rest or (head in self.classes and self.class_attributes(head, rest))
            for base in namespace.bases:
                if base not in seen and self.class_attributes(base, parts, seen | {name}):
                    return True
        return False


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of the SDK and the services: its dotted name and its file."""
    for top, directory in SOURCE_ROOTS.items():
        for path in sorted(directory.rglob("*.py")):
            relative = path.relative_to(directory).with_suffix("")
            parts = [top, *relative.parts]
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


@functools.cache
def trees() -> dict[str, ast.Module]:
    """Every module's syntax tree, parsed once for all the checks."""
    return {name: ast.parse(path.read_text(), filename=str(path)) for name, path in modules()}


def own_modules() -> list[str]:
    """The modules the map must name: packages' ``__init__`` and ``__main__`` are not."""
    return [name for name, path in modules() if path.name not in ("__init__.py", "__main__.py")]


def _class_namespace(node: ast.ClassDef) -> Namespace:
    namespace = Namespace(bases=[_base_name(base) for base in node.bases])
    for item in node.body:
        namespace.names.update(_defined(item))
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(item):
                targets = (
                    inner.targets
                    if isinstance(inner, ast.Assign)
                    else [inner.target]
                    if isinstance(inner, (ast.AnnAssign, ast.AugAssign))
                    else []
                )
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        namespace.names.add(target.attr)
    # A pydantic model's fields are read and written by their camelCase alias too.
    namespace.names |= {to_camel(name) for name in namespace.names}
    return namespace


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _defined(node: ast.stmt) -> set[str]:
    """The names one statement of a module or class body defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {
            name.id
            for target in node.targets
            for name in ast.walk(target)
            if isinstance(name, ast.Name)
        }
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, (ast.If, ast.Try)):
        inner = [*node.body, *node.orelse]
        if isinstance(node, ast.Try):
            inner += [s for handler in node.handlers for s in handler.body]
        return set().union(*(_defined(s) for s in inner)) if inner else set()
    return set()


@functools.cache
def code() -> Code:
    found = Code(modules={}, classes=defaultdict(list), short=defaultdict(list), defined=set())
    for name, tree in trees().items():
        namespace = Namespace()
        for statement in tree.body:
            namespace.names |= _defined(statement)
        # The SDK's lazily exported names (yoke/__init__.py's _EXPORTS) are its names too.
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and name == "yoke":
                namespace.names |= {str(k.value) for k in node.keys if isinstance(k, ast.Constant)}
            if isinstance(node, ast.ClassDef):
                members = _class_namespace(node)
                found.classes[node.name].append(members)
                found.defined |= members.names | {node.name}
        found.modules[name] = namespace
        found.defined |= namespace.names
        parts = name.split(".")
        for start in range(1, len(parts)):
            found.short[".".join(parts[start:])].append(name)
    return found


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def backticked(text: str) -> list[str]:
    """Inline code spans, outside fenced blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"`([^`\n]+)`", text)


@functools.cache
def repo_files() -> tuple[str, ...]:
    """The repository's files (git's list; a copy without git: every file but caches)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        skipped = {".git", ".venv", ".local", "build", "site", "__pycache__", "yoke_mesh.egg-info"}
        listed = [
            str(path.relative_to(ROOT))
            for path in ROOT.rglob("*")
            if path.is_file() and not skipped & set(path.relative_to(ROOT).parts)
        ]
    return tuple(listed)


@functools.cache
def wire_names() -> re.Pattern[str]:
    """Dotted strings the code declares (exchanges, queues, routing keys, span names), as one
    pattern: a formatted part (``f"yoke.{service}.commands"``) or a trailing dot (a prefix)
    matches any name there (``yoke.S.commands``, ``yoke.tool.NAME``)."""
    patterns: set[str] = set()
    for tree in trees().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if DOTTED.fullmatch(node.value.rstrip(".")):
                    patterns.add(
                        re.escape(node.value) + (r"\w+" if node.value.endswith(".") else "")
                    )
            elif isinstance(node, ast.JoinedStr):
                parts = [
                    re.escape(str(part.value)) if isinstance(part, ast.Constant) else r"[\w*-]+"
                    for part in node.values
                ]
                if "." in "".join(parts) and not parts[0].startswith("["):
                    patterns.add("".join(parts))
    return re.compile("|".join(sorted(patterns)))


def is_wire_name(token: str) -> bool:
    return wire_names().fullmatch(token) is not None


@dataclass
class Verdict:
    checked: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)

    def judge(self, where: str, token: str, resolves: bool) -> None:
        self.checked.append(token)
        if not resolves:
            self.wrong.append(f"{where}: `{token}`")


def dotted_resolves(token: str) -> bool | None:
    """Whether a dotted code name resolves; None when it is not one of the project's."""
    found = code()
    parts = token.split(".")
    if parts[0] in ("yoke", "services"):
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in found.modules:
                if cut == 1 and (is_wire_name(token) or token.endswith(".*")):
                    return None
                return found.module_attributes(module, parts[cut:])
        return None
    if parts[0] in found.classes:
        return found.class_attributes(parts[0], parts[1:])
    for cut in range(len(parts) - 1, 0, -1):
        relative = ".".join(parts[:cut])
        if relative in found.short:
            return any(
                found.module_attributes(module, parts[cut:]) for module in found.short[relative]
            )
    return None


def check_docs() -> Verdict:
    found = code()
    files = repo_files()
    basenames = {Path(f).name for f in files}
    settings = set(Settings.model_fields)
    outside_docs = "\n".join(
        (ROOT / f).read_text(errors="replace")
        for f in files
        if not f.endswith(".md") and (ROOT / f).is_file() and (ROOT / f).stat().st_size < 1_000_000
    )
    upper_words = set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", outside_docs))
    verdict = Verdict()
    for doc in docs():
        where = str(doc.relative_to(ROOT))
        for token in backticked(doc.read_text()):
            token = token.strip().removesuffix("()")
            if token in EXTERNAL:
                continue
            if match := TEST_ID.fullmatch(token):
                path = _repo_path(match["file"], files)
                verdict.judge(where, token, path is not None and _defines(path, match["name"]))
            elif token.endswith(FILE_SUFFIXES) and PATH.fullmatch(token) and "/" in token:
                verdict.judge(where, token, _repo_path(token, files) is not None)
            elif token.endswith(FILE_SUFFIXES) and PATH.fullmatch(token):
                verdict.judge(where, token, token in basenames)
            elif ENV_VAR.fullmatch(token):
                name = token.removeprefix("YOKE_").lower()
                verdict.judge(where, token, name in settings or token in upper_words)
            elif DOTTED.fullmatch(token):
                resolves = dotted_resolves(token)
                last = token.rsplit(".", 1)[1]
                if resolves is not None:
                    verdict.judge(where, token, resolves)
                elif (
                    (CONSTANT.fullmatch(last) or CAMEL_CASE.fullmatch(last))
                    and last in found.defined
                    and token.split(".")[0] not in sys.stdlib_module_names
                    and not is_wire_name(token)
                ):
                    # The project's class or constant behind a prefix that is no module of it
                    # (any more): ``upgrades.REMOVABLE_IN`` once the module became ``_upgrades``.
                    verdict.judge(where, token, False)
            elif CONSTANT.fullmatch(token):
                # A constant of the code, a name the repository uses outside the docs (an
                # environment variable another program reads, a make variable, an AMQP error),
                # or the tail of a setting's name (``MAX_CONNECTIONS`` after "each
                # ``YOKE_GATEWAY_*``").
                verdict.judge(
                    where,
                    token,
                    token in found.defined
                    or token in upper_words
                    or any(name.upper().endswith("_" + token) for name in settings),
                )
            elif CAMEL_CASE.fullmatch(token) and not hasattr(builtins, token):
                verdict.judge(where, token, token in found.defined)
    return verdict


def _repo_path(token: str, files: tuple[str, ...]) -> str | None:
    """The repository file (or directory) a path names, whole or as its tail."""
    tail = token.rstrip("/")
    for name in files:
        if (
            name == tail
            or name.endswith("/" + tail)
            or name.startswith(tail + "/")
            or f"/{tail}/" in f"/{name}"
        ):
            return name
    return None


def _defines(path: str, name: str) -> bool:
    tree = ast.parse((ROOT / path).read_text())
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.name == name
        for node in ast.walk(tree)
    )


def map_of_the_code() -> str:
    """docs/architecture.md's "Map of the code" section, its "Layers" included."""
    text = ARCHITECTURE.read_text()
    start = text.index("\n## Map of the code")
    return text[start : text.index("\n## ", start + 1)]


def entries(section: str) -> dict[str, set[str]]:
    """Each table row and bullet of the map by its subject (its first code span: ``yoke.core``,
    ``services/gateway/``), with the code spans it holds."""
    found: dict[str, set[str]] = defaultdict(set)
    blocks = re.split(r"\n(?=\||- )", section)
    for block in blocks:
        spans = backticked(block)
        if spans:
            found[spans[0].rstrip("/").replace("/", ".")] |= set(spans)
    return found


def named_on_the_map(module: str, section: str, by_subject: dict[str, set[str]]) -> bool:
    """A module is named by its dotted name anywhere on the map, or inside the entry of a
    package above it by its name there (``calls.records``, ``records``, ``records.py``,
    ``a2a/door.py``)."""
    path = module.replace(".", "/") + ".py"
    if f"`{module}`" in section or f"`{path}`" in section or f"`shared/{path}`" in section:
        return True
    parts = module.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        spans = by_subject.get(".".join(parts[:cut]), set())
        relative = parts[cut:]
        names = {".".join(relative), "/".join(relative) + ".py", relative[-1], relative[-1] + ".py"}
        if spans & names:
            return True
    return False


def test_every_module_is_on_the_map() -> None:
    section = map_of_the_code()
    by_subject = entries(section)
    missing = [m for m in own_modules() if not named_on_the_map(m, section, by_subject)]
    assert len(own_modules()) > 100
    assert not missing, f"docs/architecture.md's map does not name: {', '.join(missing)}"


def test_every_module_the_map_lists_exists() -> None:
    """The other way round: a row's modules column names only modules of its package."""
    found = code()
    rows = [line.split("|") for line in map_of_the_code().splitlines() if line.startswith("| `")]
    listed = {
        f"{package}.{name}"
        for _, first, modules_cell, *_ in rows
        for package in backticked(first)
        if package in found.modules
        for name in backticked(modules_cell)
    }
    assert len(listed) > 80
    gone = sorted(name for name in listed if name not in found.modules)
    assert not gone, f"docs/architecture.md's map lists modules that do not exist: {gone}"


def test_every_code_name_and_path_in_the_docs_exists() -> None:
    verdict = check_docs()
    # What the rule picks up: if this falls, the rule has stopped reading the docs' names.
    assert len(set(verdict.checked)) > 500, len(set(verdict.checked))
    assert not verdict.wrong, "names nothing in the code:\n" + "\n".join(verdict.wrong)


def settings_rows() -> list[str]:
    """The first cell of every markdown table row in the docs: where a variable is defined."""
    return [
        line.split("|")[1]
        for doc in docs()
        for line in doc.read_text().splitlines()
        if line.startswith("|") and line.count("|") >= 3
    ]


def test_every_setting_has_a_row_in_a_settings_table() -> None:
    fields = sorted(Settings.model_fields)
    assert len(fields) > 50
    cells = "\n".join(settings_rows())
    missing = [f"YOKE_{name.upper()}" for name in fields if f"`YOKE_{name.upper()}`" not in cells]
    assert not missing, f"no settings table row names: {', '.join(missing)}"
