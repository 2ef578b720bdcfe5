"""The README and docs/ stand on their own: every link resolves inside the repository, every
file, module and name they cite exists, and nothing points at a file outside it.

A link is `[text](target)` outside code; a target is a path relative to the document (it
must exist inside the repository) with an optional `#anchor`, or an `#anchor` alone. Anchors
are GitHub's heading slugs: lower case, punctuation other than `-` and `_` dropped, spaces as
`-`, a repeated slug suffixed `-1`, `-2`, ... A link that leaves the repository (an absolute
URL, or a path above the root) fails: the documents are read from a clone, offline.

Cited code is checked in backticks: a repository path (`crosscheck/launch/schedule.py`,
`tests/test_jax_*.py`), a test file named alone (`test_torch_hardening.py`), and a dotted
name (`crosscheck.verification.verifier.verify`, `examples.torch_nanogpt:step`): the longest
prefix that is a module must exist, and the name after it must be defined at that module's
top level (a def, class, assignment or import, or a key of crosscheck's lazy `_EXPORTS`).
The reorganisation of the package moved modules; this keeps the documents from pointing at
where they used to be.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
#: Paths into the repository's own folders, as cited in backticks.
REPO_PATH = re.compile(r"^(?:crosscheck|jax_impl|torch_impl|tests|examples|docs|scripts|\.ci)/\S*$")
TEST_FILE = re.compile(r"^test_\w+\.py$")
DOTTED = re.compile(
    r"^((?:crosscheck|jax_impl|torch_impl|examples)(?:\.[A-Za-z_]\w*)*)(?::([A-Za-z_]\w*))?"
)
#: Documents whose backticked paths are upstream projects' files (slime's `tests/...`), not ours.
UPSTREAM_CITATIONS = {"docs/modes.md"}
#: Files outside the repository that documents once pointed at.
OUTSIDE = re.compile(r"\.\./shared|shared/(?:DESIGN|BUGS|LAYOUT|STYLE)\.md|\b(?:DESIGN|BUGS)\.md")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(document: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in _prose_lines(document.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return frozenset(result)


def _links(document: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _prose_lines(document.read_text(encoding="utf-8")):
        prose = CODE_SPAN.sub("", line)
        found += [(number, m.group(1)) for m in LINK.finditer(prose)]
    return found


def _code_spans(document: Path) -> list[tuple[int, str]]:
    spans = []
    for number, line in _prose_lines(document.read_text(encoding="utf-8")):
        spans += [(number, m.group(2).strip()) for m in CODE_SPAN.finditer(line)]
    return spans


def _where(document: Path, number: int) -> str:
    return f"{document.relative_to(ROOT)}:{number}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(document: Path) -> None:
    broken = []
    for number, target in _links(document):
        path_part, _, anchor = target.partition("#")
        if re.match(r"^[a-z][a-z0-9+.-]*:", path_part):
            broken.append(f"{_where(document, number)}: {target} leaves the repository")
            continue
        resolved = (document.parent / path_part).resolve() if path_part else document
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{_where(document, number)}: {target} leaves the repository")
        elif not resolved.exists():
            broken.append(f"{_where(document, number)}: {target}: no such file")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{_where(document, number)}: {target}: no heading #{anchor}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_outside_the_repository(document: Path) -> None:
    text = document.read_text(encoding="utf-8")
    hits = [
        f"{_where(document, number)}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "\n".join(hits)


@functools.cache
def _top_level_names(module: Path) -> frozenset[str]:
    tree = ast.parse(module.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            # crosscheck's lazy exports: {"verify": "crosscheck.verification.verifier", ...}
            exports = any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets)
            if exports and isinstance(node.value, ast.Dict):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    return None


def _dotted_problem(span: str) -> str | None:
    """Why a dotted name cited in backticks does not exist, or None."""
    match = DOTTED.fullmatch(span)
    parts = match.group(1).split(".")
    name_after_colon = match.group(2)
    for length in range(len(parts), 0, -1):
        module = _module_file(parts[:length])
        if module is not None:
            break
    else:
        return f"no module {parts[0]}"
    rest = parts[length:]
    if name_after_colon:
        if rest:
            return f"no module {'.'.join(parts)}"
        rest = [name_after_colon]
    if rest and rest[0] not in _top_level_names(module):
        return f"{module.relative_to(ROOT)} defines no {rest[0]}"
    return None


@pytest.mark.parametrize(
    "document",
    [d for d in DOCUMENTS if str(d.relative_to(ROOT)) not in UPSTREAM_CITATIONS],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_cited_files_modules_and_names_exist(document: Path) -> None:
    missing = []
    for number, span in _code_spans(document):
        where = _where(document, number)
        head = span.split("(")[0]  # a call cites the name before its arguments
        if REPO_PATH.match(span):
            if not any(ROOT.glob(span.rstrip("/"))):
                missing.append(f"{where}: {span}: no such file")
        elif TEST_FILE.match(span):
            if not (ROOT / "tests" / span).exists():
                missing.append(f"{where}: {span}: no such test file")
        elif DOTTED.fullmatch(head):
            problem = _dotted_problem(head)
            if problem:
                missing.append(f"{where}: {span}: {problem}")
    assert not missing, "\n".join(missing)


def test_slugs_follow_github() -> None:
    assert slug("The catalogue run: `python -m crosscheck bugs`") == (
        "the-catalogue-run-python--m-crosscheck-bugs"
    )
    assert slug("3. Sensitivity: the smallest skew a case detects") == (
        "3-sensitivity-the-smallest-skew-a-case-detects"
    )
    assert slug("Why s = R") == "why-s--r"


def test_the_readme_worked_example_of_auxiliary_terms_is_what_the_example_prints():
    """The README's numbers come from the oracle: rerun the example and compare the text."""
    import subprocess
    import sys

    printed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "aux_terms.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()
    assert f"```\n{printed}\n```" in (ROOT / "README.md").read_text()


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_picture_is_in_the_repository(document: Path) -> None:
    pictures = [
        (n, m.group(1))
        for n, line in _prose_lines(document.read_text())
        for m in IMAGE.finditer(line)
    ]
    missing = [
        f"{_where(document, n)}: {target}"
        for n, target in pictures
        if not (document.parent / target).resolve().is_relative_to(ROOT)
        or not (document.parent / target).is_file()
    ]
    assert not missing, missing


def test_the_readme_counts_the_patterns_it_catalogues_and_shows_verifys_picture() -> None:
    from PIL import Image

    from crosscheck.diagnosis.patterns import PATTERNS

    text = (ROOT / "README.md").read_text()
    assert f"The {len(PATTERNS)} catalogued patterns" in text
    # The picture is what `verify --plot` draws for the 9x example's rank-local count (the
    # command beside it in the README): its title, kept in the PNG's Title text, says so.
    assert "![" in text and "(docs/images/nine_x.png)" in text
    title = Image.open(ROOT / "docs" / "images" / "nine_x.png").text["Title"]
    assert title.startswith("examples.torch_hf_loss:step_rank_count: rank-mean, weight ratio 9x")
    assert title.endswith("seed, R=2, M=1; intended token_mean")
