"""What a person meets first on the command line: the pool paged-run takes, the terminal
conversation, ``--prompt -``, ``--version``, and ``paged-cache --clear`` asking first."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from paged_decode import cli
from paged_decode.runtime.kv_pool import PagedKVCache
from paged_decode.runtime.tokenizer import Tokenizer

from .conftest import BATCHED, BUCKETS

BUILD = BATCHED  # the batching tests' build of tiny and llama_ckpt: compiled once for all
ARGS = ["--block-size", "4", "--max-context", "64", "--batch-buckets", ",".join(map(str, BUCKETS))]


@pytest.fixture
def pools(monkeypatch) -> list[int]:
    """The num_blocks of every pool paged-run makes."""
    made = []
    real = PagedKVCache.for_artifact.__func__

    def spy(cls, artifact, **kwargs):
        pool = real(cls, artifact, **kwargs)
        made.append(pool.num_blocks)
        return pool

    monkeypatch.setattr(PagedKVCache, "for_artifact", classmethod(spy))
    return made


@pytest.mark.parametrize("new_tokens", [1, 9, 40])
def test_run_pool_holds_the_prompt_and_the_new_tokens(build, artifact_root, pools, new_tokens):
    prepared = build("tiny", **BUILD)
    prompt = "hello there"
    n_prompt = len(Tokenizer.from_dir(prepared.weights_dir).encode_prompt(prompt))
    result = CliRunner().invoke(cli.run_cmd, ["--model", "tiny", *ARGS, "--artifacts",
                                              str(artifact_root), "--prompt", prompt,
                                              "--max-new-tokens", str(new_tokens)])
    assert result.exit_code == 0, result.output
    # the last new token is never written to the cache; 4-token blocks, at most 16
    assert pools == [min(-(-(n_prompt + new_tokens - 1) // 4), 16)]


def _chat_args(ckpt, root):
    return ["--model", str(ckpt.path), *ARGS, "--artifacts", str(root), "--chat",
            "--max-new-tokens", "3"]


def test_chat_without_prompt_keeps_history_and_exit_leaves(build, llama_ckpt, artifact_root,
                                                            pools, monkeypatch):
    build(llama_ckpt.path, **BUILD)
    seen = []
    real = Tokenizer.apply_chat_template

    def spy(self, messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", spy)
    result = CliRunner().invoke(cli.run_cmd, _chat_args(llama_ckpt, artifact_root),
                                input="the fox\n\nthe dog\n/exit\nnever read\n")
    assert result.exit_code == 0, result.output
    assert pools == [16]  # a conversation may fill the whole context
    assert [m["content"] for m in seen[0]] == ["the fox"]
    first, second = seen[-1][1], seen[-1]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[0]["content"] == "the fox" and second[2]["content"] == "the dog"
    assert isinstance(first["content"], str)  # the first reply, as it was written
    assert not any(m["content"] == "never read" for turn in seen for m in turn)
    assert "/exit ends the conversation" in result.output


def test_chat_ends_at_the_end_of_input(build, llama_ckpt, artifact_root):
    build(llama_ckpt.path, **BUILD)
    result = CliRunner().invoke(cli.run_cmd, _chat_args(llama_ckpt, artifact_root),
                                input="the fox\n")
    assert result.exit_code == 0, result.output


def test_prompt_dash_reads_stdin(build, artifact_root):
    build("tiny", **BUILD)
    args = ["--model", "tiny", *ARGS, "--artifacts", str(artifact_root), "--max-new-tokens", "6"]
    runner = CliRunner()
    piped = runner.invoke(cli.run_cmd, [*args, "--prompt", "-"], input="hello there")
    given = runner.invoke(cli.run_cmd, [*args, "--prompt", "hello there"])
    assert piped.exit_code == 0 and given.exit_code == 0, piped.output + given.output
    text = [line for line in given.stdout.splitlines() if line]
    assert [line for line in piped.stdout.splitlines() if line] == text
    empty = runner.invoke(cli.run_cmd, [*args, "--prompt", "-"], input="  \n")
    assert empty.exit_code == 1 and "stdin held no text" in empty.output


@pytest.mark.parametrize("cmd", [cli.compile_cmd, cli.run_cmd, cli.serve_cmd, cli.bench_cmd,
                                 cli.cache_cmd, cli.main])
def test_every_command_has_version(cmd):
    result = CliRunner().invoke(cmd, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(cli.PACKAGE_VERSION)


def test_cache_clear_asks_first(build, tmp_path):
    built = build("tiny", **BUILD)
    root = tmp_path / "root"
    art = Path(shutil.copytree(built.artifact_dir, root / built.artifact_dir.name))
    pack = Path(shutil.copytree(built.weights_dir, root / "weights" / built.weights_dir.name))
    runner = CliRunner()
    no = runner.invoke(cli.cache_cmd, ["--artifacts", str(root), "--clear"], input="n\n")
    assert no.exit_code == 1 and "nothing deleted" in no.output
    assert art.is_dir() and pack.is_dir()
    yes = runner.invoke(cli.cache_cmd, ["--artifacts", str(root), "--clear"], input="y\n")
    assert yes.exit_code == 0 and "cleared 1 artifacts and 1 weight packs" in yes.output
    assert not art.exists() and not pack.exists()


def test_ctrl_c_stops_a_reply_and_the_conversation_goes_on(load, llama_ckpt):
    from paged_decode.repl import chat_loop
    from paged_decode.runtime.engine import Engine
    from paged_decode.runtime.sampling import SamplingParams

    from .conftest import make_pool

    artifact, weights = load(llama_ckpt.path, **BUILD)
    tokenizer = Tokenizer.from_dir(weights.path)
    engine = Engine(artifact, weights, make_pool(artifact, 16), tokenizer)
    lines, written, said = iter(["the fox", "the dog", "/exit"]), [], []

    def write(text: str) -> None:
        if len(said) == 1 and not written:  # the first piece of the first reply: Ctrl-C
            written.append("^C")
            raise KeyboardInterrupt
        written.append(text)

    replies = chat_loop(engine, max_new_tokens=4, sampling=SamplingParams(),
                        read=lambda _prompt: next(lines), write=write, say=said.append)
    assert replies == 2 and "(stopped)" in said
    # the stopped reply freed its blocks: the pool is as full as before the conversation
    assert engine.pool.num_free == 16


def test_build_steps_draw_a_bar_on_a_terminal_and_plain_lines_elsewhere(capsys):
    from paged_decode.progress import Progress

    steps = ["[1/3] compile: writing (0 s so far)", "[3/3] compile: linking (9 s so far)",
             "weights of tiny as float32"]
    bar = Progress(tty=True)
    for line in steps:
        bar(line)
    drawn = capsys.readouterr().err
    assert "\r[" + "." * 20 + "] 1/3 compile: writing" in drawn
    assert "\r[" + "#" * 13 + "." * 7 + "] 3/3 compile: linking" in drawn
    assert "so far" not in drawn  # the bar's own clock replaces the line's
    # each step's line ends before the next line starts
    assert drawn.rstrip("\n").endswith("weights of tiny as float32")
    assert drawn.count("\n") == 3
    plain = Progress(tty=False)
    for line in steps:
        plain(line)
    out = capsys.readouterr().err.splitlines()
    assert [line.split("] ", 1)[1] for line in out] == steps and "\r" not in "".join(out)


def test_artifacts_default_to_the_users_cache_not_the_package(monkeypatch, tmp_path):
    from paged_decode.runtime.locate import PACKAGE_DIR, artifacts_root

    monkeypatch.delenv("PAGED_DECODE_ARTIFACTS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = artifacts_root()
    assert root == tmp_path / "xdg" / "paged-decode" and root.is_dir()
    assert PACKAGE_DIR not in root.parents
    monkeypatch.setenv("PAGED_DECODE_ARTIFACTS", str(tmp_path / "given"))
    assert artifacts_root() == tmp_path / "given"
    assert artifacts_root(tmp_path / "flag") == tmp_path / "flag"
