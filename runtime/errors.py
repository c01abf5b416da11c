"""The error family of paged-decode.

Every error a user can cause derives from :class:`PagedDecodeError`; the CLI turns these into one
clean line and a non-zero exit.  Messages say what went wrong, the offending value, and the next
step.  ``compile/`` may import this module; it imports nothing from ``compile/``.
"""

from __future__ import annotations


class PagedDecodeError(Exception):
    """Base of every error paged-decode raises on purpose."""


class ConfigError(PagedDecodeError, ValueError):
    """A model config, preset or option value is unsupported or inconsistent."""


class WeightsError(PagedDecodeError):
    """A checkpoint is missing, incomplete, or does not match its config."""


class CompileError(PagedDecodeError):
    """TVM failed to build an artifact (the TVM error is chained as ``__cause__``)."""


class ArtifactError(PagedDecodeError):
    """An artifact is missing, damaged, stale, or built for something else."""


class LockTimeoutError(ArtifactError):
    """Another process held an artifact's build lock longer than the lock timeout."""


class InputError(PagedDecodeError, ValueError):
    """A request carries a bad value (token id, prompt, sampling parameter, block table...)."""


class OutOfBlocksError(PagedDecodeError):
    """The KV pool has fewer free blocks than an operation needs."""

    def __init__(self, requested: int, free: int, total: int):
        self.requested, self.free, self.total = requested, free, total
        super().__init__(
            f"KV pool out of blocks: requested {requested}, free {free} of {total}; "
            "release finished sequences or allocate a larger pool (num_blocks / memory budget)"
        )


class TokenIdError(InputError):
    """A token id or prompt is not an integer id inside the vocabulary, or has the wrong shape."""


class BlockTableError(InputError):
    """A caller-managed block table has the wrong dtype or shape, points outside the pool, or does
    not cover ``context_len``."""


class OwnershipError(BlockTableError):
    """A caller-managed step would write a block that another live sequence holds (its own, or
    one shared with the caller after ``fork``), or mixes another sequence's blocks into a table
    of blocks no sequence holds."""


class WriteOffsetError(InputError):
    """A flattened write offset is not ``block_table[0, (context_len - 1) // block_size] *
    block_size + (context_len - 1) % block_size``."""


class SamplingError(InputError):
    """A sampling parameter or the logits handed to the sampler are unusable."""


class CapacityError(InputError):
    """A sequence would grow past ``max_blocks_cap * block_size`` tokens of the artifact."""


class HandleError(InputError):
    """A ``SessionHandle`` is released, or belongs to another pool or allocation."""


class QueueFullError(PagedDecodeError):
    """The batching engine already holds its maximum of running and waiting requests; retry
    once some finish (an HTTP server answers 429 with ``Retry-After``)."""


class EngineStoppedError(InputError):
    """The batching engine is closed, or its thread stopped: load a new engine (an
    :class:`InputError`, as a submission to a closed engine always was)."""


class GrammarError(InputError):
    """A structured-output constraint (JSON schema, grammar) is invalid or cannot be built for
    this tokenizer."""


class BusyError(PagedDecodeError):
    """A generation was started on a thread that has one of the same generator unfinished (it
    would wait for itself); finish or close the first stream."""


class ValidityError(PagedDecodeError):
    """A session was used with a validity key it was not built for (pool swapped, cap changed...)."""


class TopologyChanged(ValidityError):
    """The pool topology (allocation, layers, block size, dtype) changed under a live session."""


class OffsetRebindError(PagedDecodeError):
    """The per-token write offset was bound twice in one step with different values."""


class ExecutionError(PagedDecodeError):
    """A compiled function failed inside the TVM VM (the TVM error is chained as ``__cause__``).

    The kernels assert their inputs (token ids, block table entries, ``context_len``,
    ``write_off``) as a second line of defence behind the session's Python checks, so this usually
    means a check was bypassed or the artifact does not match the pool or weights.
    """


class NonFiniteLogitsError(ExecutionError):
    """A step's logits hold NaN or infinity (weights damaged after packing, or a kernel fault):
    the step is refused rather than its logits returned, and its sequences were not advanced.
    ``step`` names the step (prefill, decode at a position, batched decode), ``rows`` the
    rows of a batched step that failed and ``sequences`` their sequence ids (set by the step
    runner), so a scheduler ends those sequences' requests and steps the others again."""

    def __init__(self, message: str, step: str = "", rows: tuple[int, ...] = (0,),
                 sequences: tuple[int, ...] = ()):
        self.step, self.rows, self.sequences = step, rows, sequences
        super().__init__(message)
