"""The documentation is true: the generated references match the code, every link, path,
command and Python name the README and docs/ mention exists, and the commands they show
run as written on the shipped samples."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").rglob("*.md")])
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
# a word in capitals (with _ . / -) stands for the reader's own file or value
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]{2,}\b")


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def _code(text: str) -> list[str]:
    """Fenced blocks and inline code spans of a Markdown text."""
    blocks = [m.group(2) for m in FENCE.finditer(text)]
    rest = FENCE.sub("", text)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", _prose(path.read_text()), re.M)}


def test_generated_references_are_current():
    """The regeneration command's own check, in a fresh interpreter (as a person runs it:
    click caches each command's help option, so a process that already built contexts
    another way could render another help text)."""
    from moetrace.commands._docgen import REGENERATE

    res = subprocess.run([sys.executable, "-m", "moetrace.commands._docgen", "--check"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr.strip() or f"run {REGENERATE} to regenerate"


def test_every_command_has_its_heading_in_the_cli_reference():
    from moetrace.cli import cli

    page = (REPO / "docs/reference/cli.md").read_text()
    for name in cli.load_all():
        assert f"\n## moetrace {name}\n" in page, name


def test_readme_is_short_and_its_test_command_is_the_ci_command():
    readme = (REPO / "README.md").read_text()
    assert len(readme) < 15_000, len(readme)
    ci = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
    ci = ci.replace("pip install -q ", "pip install ")
    assert ci in readme, ci
    first = readme.index("```bash")   # the first command is the main job on the samples
    assert "bash sample_traces/demo.sh" in readme[first:readme.index("```", first + 3)]
    assert "run.report(" not in readme


def test_relative_links_resolve():
    bad = []
    for doc in DOCS + sorted((REPO / "benchmarks/results").glob("*.md")):
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{_rel(doc)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{_rel(doc)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


PATH_RE = re.compile(r"(?<![\w/.-])((?:sample_traces|benchmarks|tests|moetrace|schemas|docs|\.ci)/[\w./-]*[\w/])")


# files of other projects' repositories that the docs cite (DeepEP, vllm-ascend)
EXTERNAL = {"docs/legacy.md", "tests/test_core.py", "tests/test_internode.py",
            "docs/source/user_guide/configuration/additional_config.md"}


def _named_paths(text: str):
    for m in PATH_RE.finditer(text):
        p = m.group(1)
        if any(c in text[m.end():m.end() + 2] for c in "{*<$") or re.search(r"[A-Z]{2}", p) or p in EXTERNAL:
            continue   # a pattern (rank{r}, *.py, <table>, NN_name.sql), not a file
        yield p


def test_named_paths_exist():
    """Every repository path the docs (and the code's comments) point a reader to."""
    bad = []
    sources = DOCS + sorted((REPO / "moetrace").rglob("*.py")) + sorted((REPO / "moetrace").rglob("*.sql"))
    for doc in sources:
        text = doc.read_text()
        if doc.suffix == ".md" and doc.parent.name == "reference" and doc.name in ("cli.md", "views.md"):
            continue   # generated from the code itself
        for p in _named_paths(text if doc.suffix == ".md" else "\n".join(re.findall(r"docs/[\w./-]+\.md", text))):
            if not (REPO / p.rstrip("/")).exists():
                bad.append(f"{_rel(doc)}: {p}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_named_commands_exist():
    from moetrace.cli import cli

    names = set(cli.load_all())
    bad = []
    for doc in DOCS:
        if doc == REPO / "docs/reference/cli.md":
            continue   # generated from the commands themselves
        for code in _code(doc.read_text()):
            # a command line: at the start of a line, after a prompt, or after &&, | or $(
            for m in re.finditer(r"(?:^[ \t]*(?:\$ )?|(?:&&|\||\$\()\s*)moetrace ([a-z][a-z_-]*)", code, re.M):
                if m.group(1) not in names:
                    bad.append(f"{_rel(doc)}: moetrace {m.group(1)}")
    assert not bad, "\n".join(sorted(set(bad)))


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_named_python_api_exists():
    """``moetrace.<name>`` anywhere in code, and ``run.<method>`` / ``st.<method>`` in the
    Python examples, name things that exist (``run.report()`` once did not)."""
    from moetrace.run import Run, Store

    bad = []
    for doc in DOCS:
        text = doc.read_text()
        for code in _code(text):
            for name in re.findall(r"(?<![\w/-])(moetrace(?:\.[A-Za-z_]\w*)+)", code):
                if not _resolve(name.rstrip(".")):
                    bad.append(f"{_rel(doc)}: {name}")
        for lang, block in FENCE.findall(text):
            if lang != "python" or "moetrace" not in block:
                continue   # another project's Python (an engine's own objects)
            for var, attr in re.findall(r"\b(run|rr|st)\.([A-Za-z_]\w*)", block):
                if not hasattr(Run if var in ("run", "rr") else Store, attr):
                    bad.append(f"{_rel(doc)}: {var}.{attr}")
    assert not bad, "\n".join(sorted(set(bad)))


# -- the commands shown run as written --------------------------------------------------

def _bash_commands(text: str) -> list[str]:
    """The ``moetrace ...`` lines of a page's ```bash blocks that need nothing but the
    samples: no placeholder, no absolute path (your store, /data/...), no cluster URL."""
    out = []
    for lang, block in FENCE.findall(text):
        if lang != "bash":
            continue
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            bare = re.sub(r"\"[^\"]*\"|'[^']*'", "", line)   # SQL in quotes is not a placeholder
            if PLACEHOLDER.search(bare) or " /" in bare or "://" in bare:
                break   # the reader's own data: the rest of the block reads it too
            if line.startswith("moetrace "):
                out.append(line)
    return out


def _run(commands: list[str], cwd: Path) -> str:
    (cwd / "sample_traces").symlink_to(REPO / "sample_traces")
    script = f'moetrace() {{ "{sys.executable}" -m moetrace "$@"; }}\nset -e\n' + "\n".join(commands) + "\n"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}   # the pages show a 120-column terminal
    res = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{commands}\n{res.stderr[-3000:]}"
    return res.stdout


def _check_quoted(page: str, out: str, report: str, extra: list[str] = ()) -> None:
    """Every number in the page's ```text blocks is in what the commands printed or wrote."""
    quoted = [b for lang, b in FENCE.findall(page) if lang == "text"] + list(extra)
    assert quoted
    for block in quoted:
        for number in re.findall(r"\d[\d,]*\.?\d*", block):
            assert number in out or number in report, number


@pytest.mark.slow
def test_the_metrics_page_example_runs_and_says_what_it_quotes(tmp_path):
    page = (REPO / "docs/explanation/metrics.md").read_text()
    out = _run(_bash_commands(page), tmp_path)
    _check_quoted(page, out, (tmp_path / "demo-report/report.md").read_text().replace("**", ""))


@pytest.mark.slow
def test_the_tutorial_runs_and_says_what_the_page_quotes(tmp_path):
    page = (REPO / "docs/tutorial.md").read_text()
    out = _run(_bash_commands(page), tmp_path)
    report = (tmp_path / "moetrace-demo/report-dsv3/report.md").read_text().replace("**", "")
    # the README's example output is the tutorial's replay too
    readme = [b for lang, b in FENCE.findall((REPO / "README.md").read_text()) if lang == ""][:1]
    _check_quoted(page, out, report, readme)
    # the Python API page's example, on the store the tutorial made
    api = (REPO / "docs/reference/python-api.md").read_text()
    example = next(b for lang, b in FENCE.findall(api) if lang == "python")
    res = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


# the how-to pages that show commands on the samples (own-csv.md's block runs in
# tests/test_own_data.py, which also checks its output)
HOW_TO = sorted(p.name for p in (REPO / "docs/how-to").glob("*.md")
                if p.name != "own-csv.md" and _bash_commands(p.read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md"] + [f"docs/how-to/{n}" for n in HOW_TO])
def test_shown_commands_run_on_the_samples(page, tmp_path):
    text = (REPO / page).read_text()
    if page == "README.md":
        commands = re.findall(r"`(moetrace ingest st sample_traces/[^`]+)`", text)
    else:
        commands = _bash_commands(text)
    assert commands, page
    _run(commands, tmp_path)
