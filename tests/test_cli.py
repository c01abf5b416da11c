"""The commands through click's test runner (tiny preset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from paged_decode.cli import bench_cmd, cache_cmd, compile_cmd, run_cmd, serve_cmd


@pytest.fixture
def runner():
    return CliRunner()


def test_compile_then_cache_hit(runner, artifact_root):
    args = ["--model", "tiny", "--block-size", "4", "--max-context", "64",
            "--artifacts", str(artifact_root)]
    first = runner.invoke(compile_cmd, args)
    assert first.exit_code == 0, first.output
    second = runner.invoke(compile_cmd, args)
    assert second.exit_code == 0, second.output
    assert "cache hit: yes" in second.output
    lines = dict(line.split(":", 1) for line in second.output.splitlines() if ":" in line)
    assert lines["key"].strip() in lines["artifact"]


def test_print_key_compiles_nothing(runner, tmp_path):
    result = runner.invoke(compile_cmd, ["--model", "tiny", "--max-context", "200", "--print-key",
                                         "--artifacts", str(tmp_path)])
    assert result.exit_code == 0, result.output
    key = json.loads(result.output)
    # no --block-size: the CPU's default, 64 tokens; 200 rounds up to 4 blocks
    assert key["key"]["block_size"] == 64 and key["key"]["max_blocks_cap"] == 4
    assert len(key["digest"]) == 16
    assert not any(p.name.startswith("tiny") for p in tmp_path.iterdir())


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-preset"], "no-such-preset"),
    (["--model", "/nonexistent/model.gguf"], "model.gguf"),
    (["--model", "tiny", "--block-size", "0"], "block_size=0"),
    (["--model", "tiny", "--max-context", "16", "--max-blocks-cap", "2"], "exactly one"),
    (["--model", "tiny", "--target", "llvm-but-wrong"], "llvm-but-wrong"),
    (["--model", "llama-160M"], "did you mean 'llama-160m'"),
    (["--model", "/nonexistent/dir/model"], "no such file or directory"),
])
def test_bad_input_is_one_clean_line(runner, tmp_path, args, needle):
    result = runner.invoke(compile_cmd, args + ["--artifacts", str(tmp_path)])
    assert result.exit_code != 0
    assert needle in result.output and "Traceback" not in result.output
    assert result.output.startswith("error: ")


def test_run_tiny_streams_and_reports_speed(runner, artifact_root):
    result = runner.invoke(run_cmd, ["--model", "tiny", "--block-size", "4", "--max-context",
                                     "64", "--artifacts", str(artifact_root), "--prompt", "hello",
                                     "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert "decode: 11 tokens" in result.output and "tokens/s" in result.output
    assert "warning" not in result.output


def test_run_warns_of_sampling_options_greedy_decoding_ignores(runner, artifact_root):
    args = ["--model", "tiny", "--block-size", "4", "--max-context", "64", "--artifacts",
            str(artifact_root), "--prompt", "hello", "--max-new-tokens", "4"]
    greedy = runner.invoke(run_cmd, args + ["--seed", "7", "--top-k", "40"])
    assert greedy.exit_code == 0, greedy.output
    assert "warning: --top-k, --seed change nothing at --temperature 0" in greedy.output
    sampled = runner.invoke(run_cmd, args + ["--seed", "7", "--temperature", "0.8"])
    assert sampled.exit_code == 0 and "warning" not in sampled.output, sampled.output


def test_run_encodes_the_prompt_once(runner, artifact_root, monkeypatch):
    """paged-run encodes the prompt once, for the capacity check and the generation both; the
    generation streams the same text as ``Engine.stream_text`` on the same prompt."""
    from paged_decode.compile.api import prepare
    from paged_decode.runtime.engine import Engine
    from paged_decode.runtime.tokenizer import Tokenizer

    p = prepare("tiny", block_size=4, max_context=64, artifacts=artifact_root)
    want = "".join(Engine.load(p.artifact_dir, p.weights_dir).stream_text(
        "hello there", max_new_tokens=8))
    calls = []
    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode",
                        lambda self, *a, **k: calls.append(a) or encode(self, *a, **k))
    result = runner.invoke(run_cmd, ["--model", "tiny", "--block-size", "4", "--max-context",
                                     "64", "--artifacts", str(artifact_root), "--prompt",
                                     "hello there", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert calls == [("hello there",)]
    assert want and want in result.output


def test_run_warns_up_front_when_the_generation_outgrows_the_artifact(runner, artifact_root):
    from paged_decode.compile.api import prepare
    from paged_decode.runtime.engine import Engine

    p = prepare("tiny", block_size=4, max_context=64, artifacts=artifact_root)
    n = len(Engine.load(p.artifact_dir, p.weights_dir).encode_prompt("hello"))
    args = ["--model", "tiny", "--block-size", "4", "--max-context", "64", "--artifacts",
            str(artifact_root), "--prompt", "hello"]
    over = runner.invoke(run_cmd, args + ["--max-new-tokens", str(64 - n + 2)])
    want = (f"] warning: the prompt ({n} tokens) and --max-new-tokens {64 - n + 2} need 65 KV "
            f"slots and the artifact holds 64: the generation fails after {64 - n + 1} tokens "
            "unless a stop token ends it; rerun with --max-context 65")
    lines = over.output.splitlines()
    at = next(i for i, line in enumerate(lines) if want in line)
    assert all(line.startswith("[") for line in lines[:at + 1]), over.output  # before any text
    assert over.exit_code == 1 and lines[-1].startswith("error: ")  # on a line of its own
    assert "65 tokens exceed max_tokens=64" in lines[-1]  # the CapacityError, where announced
    by_blocks = [a if a != "--max-context" else "--max-blocks-cap" for a in args]
    by_blocks[by_blocks.index("--max-blocks-cap") + 1] = "16"  # the same 64 tokens
    over = runner.invoke(run_cmd, by_blocks + ["--max-new-tokens", str(64 - n + 2)])
    assert "rerun with --max-blocks-cap 17\n" in over.output, over.output
    exact = runner.invoke(run_cmd, args + ["--max-new-tokens", str(64 - n + 1)])
    assert exact.exit_code == 0 and "warning" not in exact.output, exact.output
    assert f"decode: {64 - n} tokens" in exact.output


def test_run_rejects_a_prompt_longer_than_the_artifact_before_generating(runner, artifact_root):
    from paged_decode.compile.api import prepare
    from paged_decode.runtime.engine import Engine

    p = prepare("tiny", block_size=4, max_context=64, artifacts=artifact_root)
    prompt = "hello there " * 40
    n = len(Engine.load(p.artifact_dir, p.weights_dir).encode_prompt(prompt))
    assert n > 64
    result = runner.invoke(run_cmd, ["--model", "tiny", "--block-size", "4", "--max-context",
                                     "64", "--artifacts", str(artifact_root), "--prompt", prompt,
                                     "--max-new-tokens", "5"])
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == (
        f"error: the prompt is {n} tokens and the artifact holds 64; rerun with --max-context "
        f"{n + 4}, or shorten --prompt")
    assert all(line.startswith("[") for line in result.output.splitlines()[:-1])  # no text


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "hi", "--max-new-tokens", "-3"], "error: --max-new-tokens -3: must be 0 or more"),
    (["--prompt", ""], "error: --prompt is empty"),
])
def test_run_rejects_bad_run_options_before_compiling(runner, tmp_path, args, needle):
    root = tmp_path / "root"
    result = runner.invoke(run_cmd, ["--model", "tiny", "--artifacts", str(root)] + args)
    assert result.exit_code == 1 and result.output.startswith(needle), result.output
    assert not root.exists() or not any(root.iterdir())  # nothing compiled


def test_run_names_the_build_options_when_the_pool_does_not_fit(runner, artifact_root,
                                                                monkeypatch):
    from paged_decode.runtime import kv_pool

    class NoMemory:
        @staticmethod
        def for_arrays(_specs):
            raise MemoryError("1 bytes asked of host memory, 0 available")

    monkeypatch.setattr(kv_pool, "HostArena", NoMemory)
    result = runner.invoke(run_cmd, ["--model", "tiny", "--block-size", "4", "--max-context",
                                     "64", "--artifacts", str(artifact_root), "--prompt", "hi"])
    assert result.exit_code == 1
    last = result.output.splitlines()[-1]
    assert last.startswith("error: could not allocate") and "0 available" in last
    assert last.endswith("(a smaller --max-context or --max-blocks-cap)")


def test_run_rejects_bad_sampling(runner, artifact_root):
    result = runner.invoke(run_cmd, ["--model", "tiny", "--artifacts", str(artifact_root),
                                     "--prompt", "x", "--top-p", "1.5"])
    assert result.exit_code != 0 and "top_p" in result.output


def test_cache_lists_artifacts(runner, artifact_root, build):
    build("tiny", block_size=4, max_context=64)
    result = runner.invoke(cache_cmd, ["--artifacts", str(artifact_root)])
    assert result.exit_code == 0 and "tiny-llvm-" in result.output


def test_cache_listing_a_missing_root_creates_nothing(runner, tmp_path):
    result = runner.invoke(cache_cmd, ["--artifacts", str(tmp_path / "none")])
    assert result.exit_code == 0 and "no artifacts or weight packs in" in result.output
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("root", ["a-file", "a-file/below"])
def test_unusable_artifact_root_is_one_clean_line(runner, tmp_path, root):
    (tmp_path / "a-file").write_text("not a folder")
    result = runner.invoke(compile_cmd, ["--model", "tiny", "--artifacts", str(tmp_path / root)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("error: artifact root ") and "writable folder" in result.output


def test_cache_says_when_empty(runner, tmp_path):
    result = runner.invoke(cache_cmd, ["--artifacts", str(tmp_path)])
    assert result.exit_code == 0 and result.output.startswith("no artifacts or weight packs in")


def test_readme_python_example_runs(artifact_root, monkeypatch):
    """The README's Python API block, executed as written (artifacts in the session's root)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("\n### Python\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("PAGED_DECODE_ARTIFACTS", str(artifact_root))
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["logits"].shape == (scope["engine"].artifact.manifest.vocab_size,)
    assert scope["session"].realize_count == 1  # realize_token (prefill is not a decode step)


def test_bench_rejects_an_unknown_model_before_writing(runner, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(bench_cmd, ["--model", "tiny", "--model", "tinyy", "--out", str(out)])
    assert result.exit_code == 1 and result.output.startswith("error: model 'tinyy'")
    assert not out.exists()


def test_readme_batching_example_runs(artifact_root, monkeypatch, capsys):
    """The README's many-sequences block, run after the Python API block it builds on."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    first = readme.split("\n### Python\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    batch = readme.split("### Many sequences at once", 1)[1].split("```python\n", 1)[1]
    monkeypatch.setenv("PAGED_DECODE_ARTIFACTS", str(artifact_root))
    scope: dict = {}
    exec(compile(first, "README.md", "exec"), scope)
    exec(compile(batch.split("```", 1)[0], "README.md", "exec"), scope)
    assert len(scope["texts"]) == 2 and scope["stream"].finish_reason in ("stop", "length")


def test_weight_format_choices_are_the_registrys():
    """Every command that builds offers exactly the weight policies the build side knows (a
    format added to the registry appears in the CLI, one removed disappears)."""
    from paged_decode.compile.weights import WEIGHT_POLICIES

    for cmd in (compile_cmd, run_cmd, serve_cmd):
        (opt,) = [p for p in cmd.params if p.name == "weight_dtype"]
        assert list(opt.type.choices) == list(WEIGHT_POLICIES), cmd.name


def test_ray_address_without_replicas_is_refused_before_building(runner, tmp_path):
    result = runner.invoke(serve_cmd, ["--model", "tiny", "--ray-address", "auto",
                                       "--artifacts", str(tmp_path / "a")])
    assert result.exit_code == 1 and "--ray-address needs --ray-replicas" in result.output
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


@pytest.mark.parametrize("cmd, args", [
    (serve_cmd, ["--kv-cache-gb", "nan"]), (serve_cmd, ["--kv-cache-gb", "inf"]),
    (serve_cmd, ["--shutdown-timeout", "nan"]), (compile_cmd, ["--lock-timeout", "inf"]),
    (run_cmd, ["--temperature", "nan", "--prompt", "x"]),
    (compile_cmd, ["--max-context", "100000000000"]), (run_cmd, ["--max-blocks-cap", "0"]),
])
def test_non_finite_and_unaddressable_options_are_usage_errors(runner, tmp_path, cmd, args):
    """NaN passes every comparison and 1e11 tokens no int32 position holds: refused while
    parsing, before a compile could start."""
    result = runner.invoke(cmd, ["--model", "tiny", "--artifacts", str(tmp_path / "a"), *args])
    assert result.exit_code == 2 and args[1] in result.output, result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def test_bench_ray_replicas_needs_the_serve_section(runner, tmp_path):
    result = runner.invoke(bench_cmd, ["--ray-replicas", "2", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "--section serve" in result.output
    assert not (tmp_path / "o").exists()
