"""What a GGUF file must satisfy before anything is compiled or packed from it.

Three checks, each a :class:`WeightsError` naming the tensor or metadata key and the fix:

- :func:`check_layout`: every tensor's extent (the bytes its type and shape imply) ends where
  the next tensor begins (after the alignment padding, in the order the header lists them, as
  llama.cpp's own loader requires) and inside the file.  A type or shape edited in the header
  shows here, before its bytes are read as another tensor's.
- :func:`check_values`: every float tensor (F32 / F16 / BF16 / F64: norms, embeddings) and every
  block scale of the block formats (Q8_0's d, Q4_1's d and m, the k-quants' d and dmin, ...)
  finite.  Vectorised over the memory-mapped bytes: a scale is a float16 whose exponent bits
  are all ones exactly when it is NaN or infinite.
- :func:`check_vocabulary`: the token list (and its types / scores) as long as the vocabulary
  the embedding has, and every special token id inside it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from paged_decode.runtime.errors import WeightsError

# byte offsets of the float16 scales inside one block of each block format (llama.cpp's
# ggml-common.h): the leading d (and m / dmin), or Q6_K's and Q3_K's trailing d, Q2_K's
# trailing d and dmin.  Formats not listed here are checked on their dequantized values.
SCALE_OFFSETS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,),
    "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
}
_F16_EXP, _BF16_EXP = 0x7C00, 0x7F80  # exponent bits: all ones is NaN or infinity
_REDOWNLOAD = "the file is damaged: re-download it (or convert the model again)"


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _implied_bytes(path: Path, name: str, raw_type: int, dims: list[int]) -> tuple[str, int]:
    """``(type name, bytes)`` that a tensor's type and shape imply."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise WeightsError(f"{path}: tensor {name} has type id {raw_type}, which no GGUF "
                           f"version defines; {_REDOWNLOAD}") from None
    if not dims or dims[0] % block:
        raise WeightsError(f"{path}: tensor {name} ({qtype.name}) has shape {dims}, whose rows "
                           f"are not whole {block}-weight blocks; {_REDOWNLOAD}")
    return qtype.name, int(np.prod(dims, dtype=np.int64)) * type_size // block


def check_layout(path: Path, infos, data_offset: int, alignment: int, file_size: int) -> None:
    """Tensor i's data starts where tensor i - 1's implied bytes end, padded to the file's
    alignment; the first starts at the data section; the last ends inside the file.

    ``infos``: ``(name, GGML type id, dims fastest-first, offset in the data section)`` in
    header order."""
    expected, prev = 0, None
    for name, raw_type, dims, offset in infos:
        type_name, n_bytes = _implied_bytes(path, name, raw_type, dims)
        if offset != expected:
            what = (f"{prev[0]} ({prev[1]}, shape {prev[2]}) implies {prev[3]} bytes ending at "
                    f"{data_offset + expected}" if prev else f"the data section starts at "
                    f"{data_offset}")
            raise WeightsError(f"{path}: tensor {name} starts at byte {data_offset + offset}, but "
                               f"{what}: a tensor's type or shape does not match its extent; "
                               f"{_REDOWNLOAD}")
        if data_offset + offset + n_bytes > file_size:
            raise WeightsError(f"{path}: tensor {name} ({type_name}, shape {dims}) implies "
                               f"{n_bytes} bytes ending at byte {data_offset + offset + n_bytes},"
                               f" past the end of the {file_size}-byte file: it is truncated or "
                               f"its type or shape is wrong; {_REDOWNLOAD}")
        prev = (name, type_name, dims, n_bytes)
        expected = _align(offset + n_bytes, alignment)


def open_checked(path: Path):
    """A ``gguf.GGUFReader`` of ``path`` whose tensor extents passed :func:`check_layout` before
    the reader mapped any tensor's bytes (the reader itself fails on a short file with a
    message naming no tensor)."""
    import gguf

    size = path.stat().st_size

    class _Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            infos = [(bytes(f.parts[1]).decode("utf-8", "replace"), int(f.parts[4][0]),
                      [int(d) for d in f.parts[3]], int(f.parts[5][0])) for f in fields]
            check_layout(path, infos, int(start_offs), int(self.alignment), size)
            super()._build_tensors(start_offs, fields)
    return _Reader(path)


def _nonfinite_count(t) -> int | None:
    """How many of ``t``'s float values or block scales are NaN or infinite (None: a format
    whose scales are not listed, checked once dequantized)."""
    kind = t.tensor_type.name
    data = np.asarray(t.data)
    if kind in ("F32", "F64"):
        return int(data.size - np.count_nonzero(np.isfinite(data)))
    if kind in ("F16", "BF16"):  # the exponent bits: 2.5x numpy's isfinite over float16
        exp = _F16_EXP if kind == "F16" else _BF16_EXP
        return int(np.count_nonzero((data.reshape(-1).view(np.uint16) & exp) == exp))
    if kind not in SCALE_OFFSETS:
        return None
    import gguf

    type_size = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
    words = data.reshape(-1).view(np.uint8).reshape(-1, type_size).view("<u2")
    return sum(int(np.count_nonzero((words[:, at // 2] & _F16_EXP) == _F16_EXP))
               for at in SCALE_OFFSETS[kind])


def check_values(path: Path, reader) -> None:
    """Every float tensor's values and every block scale finite."""
    for t in reader.tensors:
        bad = _nonfinite_count(t)
        if bad:
            what = "values" if t.tensor_type.name in ("F32", "F64", "F16", "BF16") else \
                "block scales"
            raise WeightsError(f"{path}: tensor {t.name} ({t.tensor_type.name}) has {bad} NaN or "
                               f"infinite {what}; no model computes with them: {_REDOWNLOAD}")


def check_finite_array(name: str, where: str, array: np.ndarray) -> None:
    """A dequantized tensor's values finite (the formats :data:`SCALE_OFFSETS` does not list)."""
    if not np.isfinite(array).all():
        bad = int(array.size - np.count_nonzero(np.isfinite(array)))
        raise WeightsError(f"{name} in {where}: {bad} values are NaN or infinite once "
                           f"dequantized; {_REDOWNLOAD}")


_FIX_KEY = ("the file's metadata is damaged: re-download it, or set the key with gguf's "
            "gguf-set-metadata")


def check_vocabulary(path: Path, fields: dict, vocab_size: int) -> None:
    """``tokenizer.ggml.tokens`` (with ``token_type`` / ``scores``) has ``vocab_size`` entries
    (the embedding's rows) and every ``tokenizer.ggml.*_token_id`` is inside it."""
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None and fields.get("tokenizer.ggml.model") != "none":
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            values = fields.get(key)
            if values is not None and len(values) != vocab_size:
                raise WeightsError(f"{path}: {key} has {len(values)} entries, but the vocabulary "
                                   f"(token_embd.weight's rows, llama.vocab_size) has {vocab_size};"
                                   f" {_FIX_KEY}")
    for key, value in sorted(fields.items()):
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or not 0 <= int(value) < vocab_size:
                raise WeightsError(f"{path}: {key}={value!r} is outside the vocabulary "
                                   f"[0, {vocab_size}); {_FIX_KEY}")
