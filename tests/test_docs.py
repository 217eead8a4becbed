"""Docs that stay true: every `kvsim ...` command line in README.md and docs/**/*.md parses with
the real argparse parser (never run), the generated reference pages are fresh, a cheap results
table regenerates to what the page shows, and the base install needs no torch."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_docs  # noqa: E402

from kvsim.cli import build_parser, commands  # noqa: E402


def doc_files() -> list[Path]:
    """The hand-written pages (the CLI page is the parsers' own help: its freshness is tested)."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
            *sorted(p for p in (ROOT / "docs").rglob("*.md")  # not the generated help pages
                    if p.name != "cli.md" and p.parent.name != "cli")]


def _joined_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    out, cur = [], ""
    for line in text.split("\n"):
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    return out + ([cur] if cur else [])


def extract(text: str) -> list[str]:
    """Every `kvsim ...` command: in code blocks (indented or fenced; after `&&` too) and in
    inline code spans."""
    found = []
    for line in _joined_lines(text):
        s = line.strip()
        for part in re.split(r"&&|;", s):
            part = part.strip().lstrip("$ ").strip()
            if part.startswith("kvsim ") and not line.startswith(("- ", "|")) and \
                    (line.startswith(("    ", "\t")) or part == s.lstrip("$ ").strip()):
                found.append(part)
    for span in re.findall(r"`([^`]+)`", text):  # a span may wrap across lines
        if "\n\n" in span:
            continue  # not a span: a stray backtick pairs with one paragraphs away
        span = " ".join(span.replace("\\\n", " ").split())
        if span.startswith("kvsim "):
            found.append(span)
    return found


def argv_of(cmd: str) -> list[str] | None:
    """The argument vector of a documented command; None for a placeholder (`kvsim COMMAND`)."""
    cmd = re.sub(r"\s+#.*$", "", cmd)  # a trailing comment
    cmd = cmd.split(" | ")[0].split(" > ")[0]
    try:
        toks = shlex.split(cmd)[1:]
    except ValueError:
        toks = cmd.split()[1:]
    out = []
    for t in toks:
        if t.startswith("("):
            break  # prose after the command
        if t in ("...", "…") and out and out[-1].startswith("--"):
            t = "X"  # `--traces ...`: a placeholder value
        elif t in ("...", "…") or t.startswith("[") and t.endswith("]") and "=" not in t:
            continue  # an elision or an optional placeholder such as [TRACE]
        if "|" in t:
            t = t.split("|")[0]  # `--setting aware|agnostic`: one of the alternatives
        out.append(t)
    if not out or out[0] not in commands():
        return None
    return out


def documented() -> list[tuple[str, str]]:
    seen, cases = set(), []
    for f in doc_files():
        if not f.exists():
            continue
        for cmd in extract(f.read_text()):
            argv = argv_of(cmd)
            if argv is not None and tuple(argv) not in seen:
                seen.add(tuple(argv))
                cases.append((str(f.relative_to(ROOT)), " ".join(argv)))
    return cases


PLACEHOLDER = re.compile(r"^(\$\w+|[A-Z][A-Z_0-9]*)$")  # --seed S, --policy "$P", --context N


def parses(argv: list[str], required: bool = False) -> str | None:
    """None if the real parser accepts ``argv``, else what it said. Placeholder values are
    replaced by one the option accepts (its first choice, else 1), and unless ``required`` no
    option is required (prose names a command without all its options), so that the check
    reaches every flag."""
    parser = build_parser(argv)
    sub = parser._subparsers._group_actions[0].choices.get(argv[0]) if argv else None
    if sub is not None:
        argv = list(argv)
        last = sub._option_string_actions.get(argv[-1])
        if last is not None and last.nargs != 0 and not isinstance(last.nargs, str):
            argv.append("X")  # prose naming a flag alone (`kvsim policy-profile --show`)
        for i in range(1, len(argv)):
            act = sub._option_string_actions.get(argv[i - 1])
            if act is not None and act.nargs != 0 and PLACEHOLDER.match(argv[i]):
                argv[i] = str(act.choices[0]) if act.choices else "1"
        if not required:
            for act in sub._actions:
                act.required = False
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            if e.code:
                return err.getvalue().strip() or f"exit {e.code}"
    return None


def test_every_documented_command_parses():
    cases = documented()
    assert len(cases) > 40  # the extraction finds the docs' commands, not nothing
    bad = [f"{where}: kvsim {cmd}\n    {why}" for where, cmd in cases
           if (why := parses(shlex.split(cmd)))]
    assert not bad, "documented commands the parser refuses:\n" + "\n".join(bad)


def test_a_removed_flag_is_caught():
    """The check fails on a flag the parser does not have (a flag removed from the code)."""
    assert parses(["replay", "--policy", "dense", "--no-progress"])  # replay has none
    assert parses(["replay", "--policy", "dense", "--gpu", "h100-sxm"]) is None
    text = "Run:\n\n    kvsim plan --gpu h100-sxm \\\n        --no-such-flag 3 --out d\n"
    (argv,) = [argv_of(c) for c in extract(text)]
    assert "--no-such-flag" in argv and "unrecognized" in parses(argv)


def test_extraction_handles_inline_and_continuations():
    text = ("Use `kvsim replay --policy dense --json` or\n\n"
            "    pip install x && kvsim catalog\n    kvsim plan --gpu a \\\n      --batch 1,2\n")
    got = [argv_of(c) for c in extract(text)]
    assert ["replay", "--policy", "dense", "--json"] in got
    assert ["catalog"] in got and ["plan", "--gpu", "a", "--batch", "1,2"] in got


def test_generated_reference_pages_are_fresh():
    """docs/reference/cli.md, cli/*.md and metrics.md equal what scripts/gen_docs.py makes
    now, and no page is left of a command that is gone."""
    pages = gen_docs.cli_pages()
    for path, text in pages.items():
        assert path.exists() and path.read_text() == text, \
            f"{path.name} is stale: run python scripts/gen_docs.py"
    assert set(gen_docs.CLI_DIR.glob("*.md")) == set(pages) - {gen_docs.CLI_PAGE}
    assert gen_docs.METRICS_PAGE.read_text() == gen_docs.metrics_page(), \
        "docs/reference/metrics.md is stale: run python scripts/gen_docs.py"


def test_policy_options_have_no_copy_in_the_source_tree():
    """A policy's options live in its Params only (no generated table beside them); the docs'
    policies page is made from them (and is fresh: test_generated_reference_pages_are_fresh)."""
    assert not (ROOT / "kvsim" / "policies" / "_flag_table.py").exists()
    from kvsim.policies import load_all
    page = (gen_docs.CLI_DIR / "policies.md").read_text()
    for name, cls in load_all().items():
        assert f"$ kvsim policies {name}" in page
        for f in __import__("dataclasses").fields(cls.Params):
            assert f.name in page, (name, f.name)


def script_output(name: str, *args: str) -> str:
    """What ``scripts/NAME.py ARGS`` prints, run in this process (no subprocess, no wall-clock
    limit: a loaded machine makes it slower, never wrong)."""
    import runpy
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [str(ROOT / "scripts" / f"{name}.py"), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def test_help_loads_no_torch():
    """Building every command's parser (its --help) imports no torch, no transformers and no
    policy module: the parsers know the shared policy options only."""
    code = ("import sys; from kvsim.cli import build_parser, commands\n"
            "for c in commands(): build_parser([c]).format_help()\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or "
            "m.startswith('kvsim.policies.') and m.split('.')[2] not in "
            "('options', 'registry', 'spec')]\n"
            "print(bad, file=sys.stderr); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=1800,  # a hang guard
                       capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"building the parsers imported {r.stderr}"


def test_replay_help_is_short_and_documents_every_shared_option():
    """`kvsim replay --help` at 80 columns: at most 150 lines, every shared policy option."""
    import os

    from kvsim.policies.options import SHARED
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "kvsim.cli", "replay", "--help"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and len(r.stdout.splitlines()) <= 150, len(r.stdout.splitlines())
    for name in SHARED:
        assert f"--{name} " in r.stdout


def test_every_metric_name_has_a_meaning():
    names = {n for ns in gen_docs.metric_names().values() for n in ns}
    assert not names - set(gen_docs.MEANING), "metrics without a glossary entry"


def test_cli_page_lists_every_command():
    page = gen_docs.CLI_PAGE.read_text()
    for name in commands():
        assert f"[`kvsim {name}`](cli/{name}.md)" in page
        assert (gen_docs.CLI_DIR / f"{name}.md").read_text().startswith(f"# kvsim {name}\n")


@pytest.mark.slow  # ~20 s: the script refits the engine leaving one point out at a time
def test_paper_table_regenerates():
    """The paper check's tables are scripts/paper_vllm_table.py's output, unedited."""
    page = (ROOT / "docs" / "results" / "paper-check.md").read_text()
    rows = [ln for ln in script_output("paper_vllm_table").splitlines() if ln.startswith("|")]
    assert rows
    missing = [r for r in rows if r not in page]
    assert not missing, "paper-check.md differs from scripts/paper_vllm_table.py:\n" + \
        "\n".join(missing[:5])


def test_verkv_profile_table_regenerates():
    """The VerKV page's per-length table (16x, eps 0.05) is scripts/verkv_table.py's output
    from the shipped profiles, unedited (a cheap table: the script reads two JSON files)."""
    made = {ln for ln in script_output("verkv_table").splitlines() if ln.startswith("|")}
    page = (ROOT / "docs" / "results" / "verkv-attention.md").read_text().splitlines()
    shown = [ln for ln in page if ln.startswith("| ") and ln.count("|") == 11
             and ln.split("|")[4].strip().isdigit()]
    assert len(shown) >= 12
    stale = [ln for ln in shown if ln not in made]
    assert not stale, "verkv-attention.md rows scripts/verkv_table.py no longer makes:\n" + \
        "\n".join(stale[:5])


def test_base_dependencies_have_no_torch():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in meta["dependencies"]]
    assert "torch" not in names and "transformers" not in names
    assert any(d.startswith("torch") for d in meta["optional-dependencies"]["model"])
    docs = meta["optional-dependencies"]["docs"]
    assert all("==" in d for d in docs) and any(d.startswith("mkdocs-material") for d in docs)


def test_no_progress_claim_matches_the_parsers():
    """--no-progress is documented only for commands that take it."""
    for cmd in ("replay", "plan"):
        assert parses([cmd, "--no-progress"])
    assert parses(["profile", "--no-progress"]) is None


@pytest.mark.parametrize("page", ["README.md"])
def test_readme_is_short(page):
    assert len((ROOT / page).read_text().splitlines()) <= 150


def test_task_quality_table_regenerates():
    """The task-quality page's table is scripts/quality_table.py's output from the shipped
    kvsim eval results, unedited (cheap: the script reads the JSON in docs/eval-smollm2/)."""
    runs = sorted(str(p) for p in (ROOT / "docs" / "eval-smollm2").glob("*.json"))
    made = "\n".join(ln for ln in script_output("quality_table", *runs).splitlines()
                     if ln.startswith("|"))
    assert made.count("\n") >= 4
    assert made in (ROOT / "docs" / "results" / "task-quality.md").read_text()


def test_verkv_per_layer_table_at_8k_regenerates():
    """The VerKV page's 8K per-layer table is `scripts/verkv_table.py --length 8192`'s output."""
    made = "\n".join(ln for ln in script_output("verkv_table", "--length", "8192").splitlines()
                     if ln.startswith("|"))
    assert made.count("\n") >= 12
    assert made in (ROOT / "docs" / "results" / "verkv-attention.md").read_text()
