"""Refusals are one line that names the file, with control characters shown escaped; no
report output carries markup from the data.

Generated cases: file names holding each kind of hostile character (line breaks,
terminal escape sequences that set the title or clear the screen, C1 controls, bidi
overrides) x each way a command refuses a file (missing, unreadable content, unknown
format, an output named so); inputs that are a store; inputs nested too deeply. Each: one
line, exit 2, the name in :func:`moetrace.errors.shown` form, no raw control character.
Then a run whose source carries HTML, link and table markup, reported: report.md,
report.html and the terminal summary show it as text."""
from __future__ import annotations

import re

from moetrace.errors import TerminalGuard, one_line, shown

from .helpers import module_fixture, tree_hash
from .helpers.bounded_cli import run_cases, synth_store

HOSTILE = {
    "newline": "a\nb",
    "carriage_return": "a\rmoetrace: ok",
    "title": "t\x1b]0;pwned\x07",
    "clear": "c\x1b[2J\x1b[H",
    "c1_csi": "d\u009b31m",
    "bidi": "e\u202etxt.exe",
    "bell_tab": "f\x07\tg",
}


@module_fixture
def store(tmp_path_factory):
    return synth_store(tmp_path_factory.mktemp("names"))


def _no_raw_controls(text: str) -> None:
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", text), repr(text)


def test_hostile_names_in_refusals(store, tmp_path):
    cases, want = [], []
    for kind, bad in HOSTILE.items():
        d = tmp_path / kind
        d.mkdir()
        frac = d / f"{bad}.csv"
        frac.write_text("step,layer,expert,tokens\n0,0,0,1.5\n")
        odd = d / f"{bad}.bin"
        odd.write_bytes(b"\x00garbage")
        for how, args, name in (
            ("missing", ["ingest", d / "s1", d / f"{bad}.parquet"], f"{bad}.parquet"),
            ("fraction", ["ingest", d / "s2", frac], frac.name),
            ("unknown", ["ingest", d / "s3", odd], odd.name),
            ("no_store", ["runs", d / f"{bad}-store"], f"{bad}-store"),
            ("bad_out", ["sql", "st", "SELECT 1", "-o", d / f"{bad}.txt"], f"{bad}.txt"),
        ):
            cases.append({"args": args, "cwd": store})
            want.append((kind, how, d, name))
    before = tree_hash(store / "st")
    for (kind, how, d, name), res in zip(want, run_cases(cases, tmp_path / "run")):
        res.refused(shown(name))
        _no_raw_controls(res.stderr + res.stdout)
        assert not any(p.name.startswith("s") and p.is_dir() for p in d.iterdir()), (kind, how)
    assert tree_hash(store / "st") == before


def test_store_as_input_and_deep_nesting_are_one_named_line(store, tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"step": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"logical_count": ' + "[" * 200_000 + "]" * 200_000 + "}")
    cases = [
        {"args": ["ingest", "st", "st"], "cwd": store},
        {"args": ["ingest", tmp_path / "o1", store / "st"], "cwd": store},
        {"args": ["ingest", tmp_path / "o2", store / "st" / "runs"], "cwd": store},
        {"args": ["ingest", tmp_path / "o3", store], "cwd": store},
        {"args": ["ingest", tmp_path / "o4", deep], "cwd": store},
        {"args": ["ingest", tmp_path / "o5", deep_json, "--format", "sglang"], "cwd": store},
    ]
    before = tree_hash(store / "st")
    names = ["st", "st", "runs", str(store), "deep.jsonl", "deep.json"]
    for name, res in zip(names, run_cases(cases, tmp_path / "run")):
        res.refused(name)
    assert tree_hash(store / "st") == before
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def test_terminal_guard_and_one_line():
    import io

    buf = io.StringIO()
    g = TerminalGuard(buf)
    g.write("row\tx\x1b]0;t\x07\nnext\u202e\n")
    assert buf.getvalue() == "row\tx\\x1b]0;t\\x07\nnext\\u202e\n"
    assert one_line("a\nb\x1b[2J") == "a\\nb\\x1b[2J"
    assert shown("名前 é.csv") == "名前 é.csv"        # printable text is left as it is


MARKUP = {
    "html": "<img src=x onerror=alert(1)>",
    "link": "[click](javascript:alert(1))",
    "pipe": "a|b|c",
    "code": "`x` <b onclick=y>bold `",
}


def test_report_outputs_escape_markup_from_the_data(tmp_path):
    """Every report output (report.md, report.html, the terminal summary) shows names
    from the data as text: no raw tag, no link, no extra table column."""
    cases = []
    for kind, name in MARKUP.items():
        d = tmp_path / kind
        d.mkdir()
        src = d / f"{name}.csv"
        src.write_text("step,layer,expert,tokens\n" + "".join(f"{s},0,{e},{1 + (s + e) % 3}\n"
                                                           for s in range(4) for e in range(4)))
        cases.append({"args": ["ingest", d / "st", src, "--ranks", "2", "--top-k", "2"], "cwd": d})
        cases.append({"args": ["report", d / "st", "--out-dir", d / "rep"], "cwd": d, "timeout": 240})
    res = run_cases(cases, tmp_path / "run")
    for i, kind in enumerate(MARKUP):
        ing, rep = res[2 * i], res[2 * i + 1]
        assert ing.rc == 0, ing.stderr
        assert rep.rc == 0, rep.stderr
        d = tmp_path / kind
        md = (d / "rep" / "report.md").read_text()
        html = (d / "rep" / "report.html").read_text()
        outside_code = re.sub(r"(`+).+?\1", "", md)
        assert "<img" not in outside_code and "<b " not in outside_code, kind
        assert not re.search(r"(?<!\\)\]\(javascript", outside_code), kind   # "\]" is an escaped bracket
        assert "<img src=x" not in html and "<b onclick" not in html, kind
        assert 'href="javascript' not in html, kind
        for line in md.splitlines():   # a table keeps its columns
            if line.startswith("|") and "a\\|b" in line:
                assert "a\\|b\\|c" in line
        _no_raw_controls(rep.stdout)
