"""The package's house rules that a reader relies on: no module over 600 lines (a longer
one is split along its jobs), and comments and docstrings that give the reason, never an
issue number (a reader of a clone has no issue tracker to follow "issue #26" into)."""
from __future__ import annotations

import ast
import io
import re
import tokenize

import pytest

from .helpers import REPO

MAX_LINES = 600
PACKAGE = REPO / "moetrace"
MODULES = sorted(PACKAGE.rglob("*.py"))
#: "issue #26", "issues 24", "(#23", "#13)": an issue cited by number
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+\b|\(#\d+\b|(?<![\w&])#\d+\)", re.IGNORECASE)


def _rel(p) -> str:
    return p.relative_to(REPO).as_posix()


def test_the_modules_are_found():
    assert len(MODULES) > 50 and PACKAGE / "__init__.py" in MODULES


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_no_module_over_600_lines(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{_rel(path)}: {n} lines (at most {MAX_LINES}: split it along its jobs)"


def _comments_and_docstrings(source: str):
    """(line, text) of every comment and every module, class and function docstring."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                yield body[0].lineno, body[0].value.value


def test_the_issue_pattern_finds_what_it_should():
    cites = ["# start-up (issue #26)", "# issue 24 describes it", "stored null (#23)", "(#13: the presets)",
             "Issues #3 and #4"]
    plain = ["color:#222", "ProfilerStep#3 is a step", "# the 2nd slot", "#: 4 ranks", "&#39;) an entity"]
    assert all(ISSUE_NUMBER.search(t) for t in cites)
    assert not any(ISSUE_NUMBER.search(t) for t in plain)


def test_no_comment_or_docstring_cites_an_issue_number():
    """In the package, the benchmarks and the tests (but this file, which quotes examples)."""
    others = sorted((REPO / "benchmarks").rglob("*.py")) + sorted((REPO / "tests").rglob("*.py"))
    found = []
    for path in MODULES + [p for p in others if p.name != "test_house_rules.py"]:
        for line, text in _comments_and_docstrings(path.read_text(encoding="utf-8")):
            for m in ISSUE_NUMBER.finditer(text):
                found.append(f"{_rel(path)}:{line + text[:m.start()].count(chr(10))}: {m.group(0)!r}")
    assert not found, "give the reason instead of the issue number:\n" + "\n".join(found)
