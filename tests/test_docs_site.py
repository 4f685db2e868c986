"""The documentation: the site builds without a warning, the CLI page is the commands' own
help, and the README stays a short front page that starts with the set-up commands."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CLI_PAGE = ROOT / "docs" / "cli.md"
#: the README is the front page; what does not fit goes to docs/
README_MAX_LINES = 300
#: the longest sentence of the README's "What it is", in words
WHAT_IT_IS_MAX_WORDS = 30


def _cli_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "scripts" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_strict(tmp_path: Path) -> None:
    """mkdocs.yml sets strict and warns on broken links and anchors, pages left out of
    the nav and nav entries without a page: any of them fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "WARNING" not in output, output
    for page in ("index", "cli", "architecture", "benchmarks", "updates"):
        built = tmp_path / "site" / ("index.html" if page == "index" else f"{page}/index.html")
        assert built.is_file(), page


def test_cli_page_is_current() -> None:
    page = _cli_reference().render()
    assert page == CLI_PAGE.read_text(encoding="utf-8"), (
        "docs/cli.md is not the commands' current help: run python scripts/cli_reference.py")


def test_cli_page_covers_every_command() -> None:
    page = CLI_PAGE.read_text(encoding="utf-8")
    headings = re.findall(r"^#{2,3} `(hps[^`]*)`$", page, re.MULTILINE)
    for command in ("hps", "hps demo", "hps serve", "hps load", "hps lookup", "hps publish",
                    "hps inspect", "hps convert", "hps bench", "hps bench gpu",
                    "hps models", "hps models add", "hps config", "hps config dump"):
        assert command in headings, command
    assert len(headings) == len(set(headings))
    assert page.count("Usage: hps") == len(headings)
    assert "-h, --help" in page


def test_cli_page_ignores_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A narrow terminal or forced colour changes nothing: click's formatter at a fixed
    width, no rich."""
    reference = _cli_reference()
    page = reference.render()
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TERM", "xterm-256color")
    assert reference.render() == page
    assert "\x1b" not in page
    fence = False
    for line in page.splitlines():
        fence ^= line.startswith("```")
        if fence and not line.startswith("```"):
            assert len(line) <= reference.WIDTH, line


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/")


def test_readme_starts_with_the_setup_commands() -> None:
    """The first fenced block, before any section, runs the demo and the tests, in a
    clone: its first line, a comment, says how to get one."""
    text = README.read_text(encoding="utf-8")
    first = re.search(r"^```[a-z]*\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    assert first is not None
    assert "\n## " not in text[:first.start()]
    clone, *lines = first.group(1).splitlines()
    assert clone.startswith("# ") and "git clone" in clone and "&& cd " in clone, clone
    commands = [line.split("#")[0].strip() for line in lines]
    assert len(lines) == 3 and commands[0].startswith("python3 -m venv"), lines
    assert commands[1].startswith("pip install") and commands[1].endswith("&& hps demo")
    # the tests: how long they take, and that using hps does not need them
    assert commands[2] == "bash scripts/test.sh"
    comment = lines[2].split("#", 1)[1]
    assert "not needed to use hps" in comment and re.search(r"~\d+ min", comment), comment


def test_readme_names_every_command_and_the_key_dtype_header() -> None:
    import typer.main

    from hps.tools.cli import app

    text = README.read_text(encoding="utf-8")
    commands = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert [c for c in commands if f"`hps {c}`" not in text] == []
    # the binary lookup is shown with the header that says its keys' dtype, in a block
    # the docs test runs
    blocks = re.findall(r"^```bash\n(.*?)^```$", text, re.S | re.M)
    assert any("application/octet-stream" in b and "X-HPS-Key-Dtype: int32" in b
               for b in blocks)


def test_what_it_is_reads_in_short_sentences() -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split("## What it is", 1)[1].split("\n## ", 1)[0]
    prose = re.sub(r"^\|.*$", "", section, flags=re.M)  # tables are not sentences
    sentences = [s for s in re.split(r"(?<=[.:])\s+|\n\s*\n|\n- ", prose) if s.strip()]
    longest = max(sentences, key=lambda s: len(s.split()))
    assert len(longest.split()) <= WHAT_IT_IS_MAX_WORDS, longest


def test_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    for target in targets:
        if "://" not in target:
            assert (ROOT / target).exists(), target
