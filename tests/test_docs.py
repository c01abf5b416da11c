"""The documents stay usable: every relative link in README.md and docs/*.md resolves (the file
exists, a ``#anchor`` is a heading of the target, GitHub-style), and every command in the
README's bash blocks is valid (a ``paged-*`` command's ``--help`` lists each option used and the
line parses; pip extras and pytest markers exist; the test command is CI's)."""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\][^(])*?\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
BASH_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
EXTERNAL = ("http://", "https://", "mailto:")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text without markup, lowercased, characters other than
    letters, digits, ``_``, ``-`` and spaces dropped, spaces turned into ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link: its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeats numbered ``-1``, ``-2`` as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside code blocks and inline code."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return LINK.findall(text)


def broken_links(path: Path) -> list[str]:
    """``path``'s relative links whose file is missing or whose ``#anchor`` is no heading of it."""
    bad = []
    for target in links(path):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert broken_links(doc) == []


def test_link_checker_catches_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading (x/y.py)\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](other.md#a-code-heading-xypy) [gone](missing.md) "
                   "[bad anchor](other.md#nope) [self](#title)\n\n# Title\n"
                   "```\n[in code](missing2.md)\n```\n")
    bad = broken_links(doc)
    assert len(bad) == 2 and "missing.md" in bad[0] and "#nope" in bad[1], bad


def test_slug_follows_github():
    assert slug("Decode GEMV (`compile/kernels/cpu/gemv.py`)") == "decode-gemv-compilekernelscpugemvpy"
    assert slug("Serving: paged-serve against llama.cpp's server") == \
        "serving-paged-serve-against-llamacpps-server"
    assert slug("B = 1 and b_max") == "b--1-and-b_max"


# -- the README's commands ------------------------------------------------------------------

def command_lines(markdown: str) -> list[list[str]]:
    """Each simple command of the bash blocks as shell words (continuations joined, comments
    dropped, ``&&`` / ``||`` / ``;`` / ``|`` chains split)."""
    commands = []
    for block in BASH_BLOCK.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words: list[str] = []
            for token in lexer:
                if token in {"&&", "||", ";", "|", "&"}:
                    commands.append(words)
                    words = []
                else:
                    words.append(token)
            commands.append(words)
    return [c for c in commands if c]


def cli_command(name: str):
    """The click command installed as console script ``name`` (pyproject's scripts)."""
    target = PYPROJECT["project"]["scripts"].get(name)
    assert target, f"{name}: not a console script of pyproject.toml"
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def paged_command_problems(words: list[str]) -> list[str]:
    """Why a ``paged-*`` command line is not valid: its ``--help`` fails, an option it uses is not
    in its ``--help``, or its arguments do not parse."""
    name, args = words[0], words[1:]
    cmd = cli_command(name)
    result = CliRunner().invoke(cmd, ["--help"], prog_name=name)
    if result.exit_code != 0:
        return [f"{name} --help exited {result.exit_code}"]
    problems = []
    for arg in args:
        if arg.startswith("-") and arg != "-":
            option = arg.split("=", 1)[0]
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", result.output):
                problems.append(f"{name}: {option} is not in its --help")
    if not problems:
        try:
            cmd.make_context(name, list(args))
        except Exception as e:  # click's usage errors: a bad value, a missing required option
            problems.append(f"{name} {' '.join(args)}: {e}")
    return problems


def pip_problems(words: list[str]) -> list[str]:
    """A ``pip install`` of this project names only extras pyproject.toml defines."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    problems = []
    for word in words[2:]:
        match = re.fullmatch(r"\.\[([\w,-]+)\]", word)
        if match:
            problems += [f"pip: no extra {e!r} in pyproject.toml"
                         for e in match.group(1).split(",") if e not in extras]
    return problems


def pytest_problems(words: list[str]) -> list[str]:
    """A pytest run selects only markers pyproject.toml declares, on paths that exist."""
    declared = {m.split(":")[0].strip() for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    problems = []
    for prev, word in zip(words[2:], words[3:]):
        if prev == "-m":
            used = set(re.findall(r"\w+", word)) - {"not", "and", "or"}
            problems += [f"pytest: marker {m!r} not declared" for m in sorted(used - declared)]
        elif not word.startswith("-") and prev != "-n" and not (ROOT / word).exists():
            problems.append(f"pytest: no path {word}")
    return problems


def command_problems(words: list[str]) -> list[str]:
    if words[0].startswith("paged-"):
        return paged_command_problems(words)
    if words[:2] == ["pip", "install"]:
        return pip_problems(words)
    if words[:3] == ["python", "-m", "pytest"]:
        return pytest_problems(words)
    if words[0] == "curl":
        return []
    return [f"{' '.join(words)}: no check for {words[0]!r} commands (add one to tests/test_docs.py)"]


README_COMMANDS = command_lines((ROOT / "README.md").read_text())


@pytest.mark.parametrize("words", README_COMMANDS, ids=lambda w: " ".join(w)[:60])
def test_readme_command_is_valid(words):
    assert command_problems(words) == []


def test_readme_runs_every_paged_command_it_names():
    used = {w[0] for w in README_COMMANDS}
    assert {"paged-compile", "paged-run", "paged-serve", "paged-cache"} <= used


def test_readme_test_command_is_cis():
    """CI (`.ci/run`) runs exactly the README's test command."""
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    pytest_line = next(line for line in ci_lines if line.startswith("python -m pytest"))
    readme_blocks = BASH_BLOCK.findall((ROOT / "README.md").read_text())
    assert any(block.strip().endswith(" && " + pytest_line) for block in readme_blocks)


def test_command_checks_catch_bad_commands():
    assert paged_command_problems(["paged-run", "--no-such-option", "1"])
    assert paged_command_problems(["paged-compile", "--cache-dtype", "int3"])
    assert paged_command_problems(["paged-bench", "--section", "decode"]) == []
    assert pip_problems(["pip", "install", "-e", ".[nosuchextra]"])
    assert pytest_problems(["python", "-m", "pytest", "-m", "not nosuchmarker", "tests"])
    assert command_problems(["make", "all"])
    assert command_lines("```bash\npaged-run --a 1 && paged-cache  # note\n```\n") == \
        [["paged-run", "--a", "1"], ["paged-cache"]]
