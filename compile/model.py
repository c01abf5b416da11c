"""The Relax module: ``decode``, ``decode_dev``, ``prefill`` and ``_metadata`` of one
decoder, its layer features (biases, q/k norms, post norms, the gate activation, the
embedding scale, soft-capping, sliding windows and RoPE per layer) read from its
``ModelConfig``.

Signatures (B = 1, ``num_blocks`` symbolic, ``max_blocks_cap`` fixed, ``n`` symbolic):
  decode(token_ids (1,) int32, block_table (1, cap) int32, context_len Prim int64,
         write_off Prim int64, kv_pools Tuple[2 L x (num_blocks, Hkv, bs, D)], params Tuple)
         -> logits (1, vocab) float32
  decode_dev(token_ids, block_table, context_len (1,) int64, write_off (1,) int64, kv_pools,
             params) -> logits (1, vocab) float32 -- decode with both scalars in tensors
  prefill(token_ids (n,) int32, block_table (1, cap) int32, start_pos Prim int64,
          kv_pools, params) -> logits of the last position (1, vocab) float32
  batch_decode_<B> for each batch bucket B (static):
    (token_ids (B,) int32, block_tables (B, cap) int32, context_lens (B,) int64,
     write_offs (B,) int64, kv_pools, params) -> logits (B, vocab) float32
    -- one new token per row, each row its own sequence; context_len 0 marks a padding row
  _metadata() -> the manifest JSON string, less its disk-only fields (the model name among them)
The pools are written by ``call_tir_inplace``; attention reads the returned pool, which keeps
each write alive through dead-code elimination.
"""

from __future__ import annotations

import dataclasses
import json

import tvm
from tvm import relax, tirx

from paged_decode.runtime.manifest import DISK_ONLY

from .config import ModelConfig
from .formats import FORMATS
from .kernels.kernel_set import KernelSet
from .kernels.registry import kernels_for
from .params import param_specs
from .rope import rope_inv_freq


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """What one artifact is compiled for (the model shape plus the cache layout)."""

    config: ModelConfig
    max_blocks_cap: int
    block_size: int
    cache_dtype: str
    weight_dtype: str  # the format of every matrix not named in weight_formats
    batch_buckets: tuple[int, ...] = ()  # rows of each compiled batch_decode_<B>
    weight_formats: tuple[tuple[str, str], ...] = ()  # (param name, format) exceptions

    def param_specs(self):
        return param_specs(self.config, self.weight_dtype, self.weight_formats)

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence can hold: ``max_blocks_cap * block_size``."""
        return self.max_blocks_cap * self.block_size


def _f32(*shape):
    return relax.TensorType(list(shape), "float32")


class _Builder:
    """Emits one function body; ``n_static`` is 1 for decode and None for prefill and batched
    decode (matmuls over the rows); ``all_rows``: logits of every row (batched decode), not
    only the last (prefill)."""

    def __init__(self, bb: relax.BlockBuilder, spec: BuildSpec, n_static, funcs: dict,
                 k: KernelSet, all_rows: bool = False, rows: int | None = None):
        self.bb, self.spec, self.cfg, self.n_static, self.k = bb, spec, spec.config, n_static, k
        self.all_rows = all_rows
        self.rows = rows  # a batch bucket's rows (None: prefill, decode)
        self._funcs = funcs  # kernel name -> GlobalVar, shared by the functions of one module

    def kernel(self, prim_func) -> relax.GlobalVar:
        name = prim_func.attrs["global_symbol"]
        if name not in self._funcs:
            self._funcs[name] = self.bb.add_func(prim_func, name)
        return self._funcs[name]

    def call(self, prim_func, args, out_shape):
        return self.bb.emit(relax.call_tir(self.kernel(prim_func), args, _f32(*out_shape)))

    @property
    def decode(self) -> bool:
        return self.n_static == 1

    def linear(self, x, w, n, N, K, bias=None, res=None, opts=None):
        """Prefill matmul, or decode GEMV, with an optional bias / residual epilogue; ``w`` a
        parameter name; ``opts`` (``head_opts``) go to the kernel."""
        opts = opts or {}
        w, wdt = self.p[w], self.fmt[w]
        epilogue, extra = ("bias", [bias]) if bias is not None else (
            ("residual", [res]) if res is not None else ("none", []))
        if self.decode:
            return self.call(self.k.gemv(N, K, wdt, epilogue, **opts), [x, w] + extra, (1, N))
        if self._small_rows(wdt, K):
            return self.call(self.k.linear_rows(N, K, wdt, epilogue, self.rows, **opts),
                             [x, w] + extra, (n, N))
        return self.call(self.k.linear(N, K, wdt, epilogue, **opts), [x, w] + extra, (n, N))

    def _small_rows(self, wdt: str, K: int) -> bool:
        """Whether this batch bucket is small enough for the small-batch kernels (float: the
        GEMVs streaming each weight row once for all rows; quantized: the int8 tiles)."""
        return self.rows is not None and self.k.takes_small_rows(wdt, self.rows, K)

    def norm_linear(self, x, g, w, n, N, K, bias=None):
        """rmsnorm(x) * g @ W.T (+ bias): one fused GEMV for decode, norm + matmul for prefill."""
        eps, wdt = self.cfg.rms_norm_eps, self.fmt[w]
        if self.decode:
            epilogue, extra = ("bias", [bias]) if bias is not None else ("none", [])
            return self.call(self.k.gemv(N, K, wdt, epilogue, eps), [x, g, self.p[w]] + extra,
                             (1, N))
        xn = self.call(self.k.rmsnorm(K, eps, None), [x, g], (n, K))
        return self.linear(xn, w, n, N, K, bias=bias)

    def norm_swiglu(self, x, g, w, n):
        """The MLP's input norm, gate / up product and gate activation (SiLU fused into the
        product; GELU-tanh a kernel of its own after it) -> (n, intermediate)."""
        cfg, wdt = self.cfg, self.fmt[w]
        h, inter = cfg.hidden_size, cfg.intermediate_size
        if cfg.gate_act != "silu":  # the product without activation, then the gate kernel
            y = self.norm_linear(x, g, w, n, 2 * inter, h)
            return self.call(self.k.gelu_tanh_gate(inter, self.n_static), [y], (n, inter))
        w = self.p[w]
        if self.decode:
            return self.call(self.k.gemv_swiglu(inter, h, wdt, cfg.rms_norm_eps), [x, g, w],
                             (1, inter))
        xn = self.call(self.k.rmsnorm(h, cfg.rms_norm_eps, None), [x, g], (n, h))
        if self._small_rows(wdt, h):
            return self.call(self.k.linear_swiglu_rows(inter, h, wdt, self.rows), [xn, w],
                             (n, inter))
        return self.call(self.k.linear_swiglu(inter, h, wdt), [xn, w], (n, inter))

    def qk_norm(self, qkv, n, pre):
        """qkv with each q and k head RMS-normed over its own head_dim by the layer's
        ``q_norm`` / ``k_norm`` (before RoPE): the heads as rows of the RMSNorm kernel."""
        cfg, d = self.cfg, self.cfg.head_dim
        parts = self.bb.emit(relax.op.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=1))
        out = []
        for i, (heads, g) in enumerate(((cfg.n_q_heads, "q_norm"), (cfg.n_kv_heads, "k_norm"))):
            rows = self.bb.emit(relax.op.reshape(relax.TupleGetItem(parts, i), (n * heads, d)))
            y = self.call(self.k.rmsnorm(d, cfg.rms_norm_eps, None), [rows, self.p[pre + g]],
                          (n * heads, d))
            out.append(self.bb.emit(relax.op.reshape(y, (n, heads * d))))
        v = self.bb.emit(relax.TupleGetItem(parts, 2))
        return self.bb.emit(relax.op.concat([*out, v], axis=1))

    def layer(self, x, n, layer, kv, attn_args):
        """One decoder layer; returns (x, (k_pool, v_pool)) with the pools written."""
        cfg, pre = self.cfg, f"layers.{layer}."
        h, q_size = cfg.hidden_size, cfg.q_size
        g = self.p[pre + "input_norm"]
        if pre + "wv" in self.p:  # q / k and v rows in different formats (params.split_qkv)
            qk_size = q_size + cfg.kv_size
            qk = self.norm_linear(x, g, pre + "wqk", n, qk_size, h, bias=self.p.get(pre + "bqk"))
            v = self.norm_linear(x, g, pre + "wv", n, cfg.kv_size, h, bias=self.p.get(pre + "bv"))
            qkv = self.bb.emit(relax.op.concat([qk, v], axis=1))
        else:
            qkv = self.norm_linear(x, g, pre + "wqkv", n, cfg.qkv_size, h,
                                   bias=self.p.get(pre + "bqkv"))
        if cfg.qk_norm:
            qkv = self.qk_norm(qkv, n, pre)
        rope, attn_factory, geo, extra_rope, extra_attn = attn_args
        inv_freq = self.inv_freq[cfg.is_sliding(layer) and bool(cfg.rope_local_theta)]
        written = self.bb.emit(relax.call_tir_inplace(
            self.kernel(rope), [qkv, kv[0], kv[1], inv_freq] + extra_rope, [1, 2, -1],
            [self.pool_ty, self.pool_ty, _f32(n, q_size)]))
        k_new = self.bb.emit(relax.TupleGetItem(written, 0))
        v_new = self.bb.emit(relax.TupleGetItem(written, 1))
        q_rot = self.bb.emit(relax.TupleGetItem(written, 2))
        attn = attn_factory(*geo, **self.attn_opts(layer))
        o = self.call(attn, [q_rot, k_new, v_new] + extra_attn, (n, q_size))
        x = self.residual(self.linear(o, pre + "wo", n, h, q_size, res=self.fused_res(x)), x,
                          pre + "post_attn_norm", n)
        act = self.norm_swiglu(x, self.p[pre + "post_norm"], pre + "w_gate_up", n)
        y = self.linear(act, pre + "w_down", n, h, cfg.intermediate_size, res=self.fused_res(x))
        return self.residual(y, x, pre + "post_ffn_norm", n), (k_new, v_new)

    def fused_res(self, x):
        """The residual a linear layer adds in its epilogue: none where a post norm comes
        between the product and the add."""
        return None if self.cfg.post_norms else x

    def residual(self, y, x, norm, n):
        """x + post_norm(y) with a post norm (``ModelConfig.post_norms``), else ``y`` (the
        linear layer has added x already)."""
        if not self.cfg.post_norms:
            return y
        h = self.cfg.hidden_size
        return self.call(self.k.rmsnorm_add(h, self.cfg.rms_norm_eps, self.n_static),
                         [y, self.p[norm], x], (n, h))

    def attn_opts(self, layer: int) -> dict:
        """The attention kernel's keywords for ``layer``: a sliding layer's window (which the
        kernel drops where the artifact's context is no longer: ``attention_options``),
        soft-capping and score scale, each only where the model has it."""
        cfg, opts = self.cfg, {}
        if cfg.is_sliding(layer):
            opts["window"] = cfg.sliding_window
        if cfg.attn_softcap:
            opts["softcap"] = cfg.attn_softcap
        if cfg.attn_scale:
            opts["scale"] = cfg.attn_scale
        return opts

    def body(self, token_ids, n, pools, params, attn_args):
        """Embedding, the layers, the final norm of the last row and the LM head."""
        cfg, spec = self.cfg, self.spec
        specs = spec.param_specs()
        self.p = p = {s.name: self.bb.emit(relax.TupleGetItem(params, i))
                      for i, s in enumerate(specs)}
        self.fmt = {s.name: s.format for s in specs}
        self.inv_freq = [relax.const(rope_inv_freq(cfg, sliding), "float32")
                         for sliding in (False, True)]
        embed = self.k.embedding(cfg.vocab_size, cfg.hidden_size, self.fmt["embed"], self.n_static)
        x = self.call(embed, [token_ids, p["embed"]], (n, cfg.hidden_size))
        if cfg.embed_scale != 1.0:
            x = self.call(self.k.scale(cfg.hidden_size, cfg.embed_scale, self.n_static), [x],
                          (n, cfg.hidden_size))
        for layer in range(cfg.n_layers):
            kv = [self.bb.emit(relax.TupleGetItem(pools, 2 * layer + j)) for j in (0, 1)]
            x, _ = self.layer(x, n, layer, kv, attn_args)
        logits = self.head(x, n)
        if not cfg.final_softcap:
            return logits
        rows = n if self.all_rows else 1
        return self.call(self.k.softcap(cfg.vocab_size, cfg.final_softcap,
                                        None if self.all_rows else 1), [logits],
                         (rows, cfg.vocab_size))

    def head(self, x, n):
        """The final norm and the LM head: every row's logits, or the last row's."""
        cfg, p = self.cfg, self.p
        head = "embed" if cfg.tie_word_embeddings else "lm_head"
        v, h, eps = cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps
        if self.all_rows:
            x = self.call(self.k.rmsnorm(h, eps, None), [x, p["final_norm"]], (n, h))
            return self.linear(x, head, n, v, h, opts=self.head_opts(head))
        if not self.decode:  # only the last position's logits
            x = self.call(self.k.rmsnorm(h, eps, None, last_only=True), [x, p["final_norm"]],
                          (1, h))
            return self.call(self.k.gemv(v, h, self.fmt[head], **self.head_opts(head)),
                             [x, p[head]], (1, v))
        return self.call(self.k.gemv(v, h, self.fmt[head], "none", eps, **self.head_opts(head)),
                         [x, p["final_norm"], p[head]], (1, v))

    def head_opts(self, head: str) -> dict:
        """A quantized LM head reads int16 activations where the kernel set's do
        (``KernelSet.quant_head_wide_x``: ``kernels.cpu.quant.gemv``, ``linear_int8``)."""
        wide = FORMATS[self.fmt[head]].quantized and self.k.quant_head_wide_x
        return {"wide_x": True} if wide else {}


def _per_call_inputs(n: int) -> dict:
    """Function attributes marking the first ``n`` parameters as the per-call inputs and the rest
    (pools, weights) as bound ones: the VM then checks the weights' types and shapes only inside
    the kernels (every kernel checks its own arguments), not once more per call at the function's
    entry, three packed calls per weight tensor (docs/design.md)."""
    return {"num_input": n}


def _pool_and_param_vars(spec: BuildSpec):
    cfg = spec.config
    nb = tirx.Var("num_blocks", "int64")
    pool_ty = relax.TensorType([nb, cfg.n_kv_heads, spec.block_size, cfg.head_dim], spec.cache_dtype)
    pools = relax.Var("kv_pools", relax.TupleType([pool_ty] * (2 * cfg.n_layers)))
    params = relax.Var("params", relax.TupleType(
        [relax.TensorType(list(s.shape), s.dtype) for s in spec.param_specs()]))
    return pool_ty, pools, params


def _emit_decode(bb: relax.BlockBuilder, spec: BuildSpec, funcs: dict, k: KernelSet,
                 dev: bool = False):
    """``decode``, or with ``dev`` ``decode_dev``: the same body, but context_len / write_off
    are (1,) int64 tensors handed straight to the ``*_decode_dev`` kernels (no host scalars,
    so the step can be captured and replayed as a CUDA graph)."""
    cfg, cap, bs, cdt = spec.config, spec.max_blocks_cap, spec.block_size, spec.cache_dtype
    pool_ty, pools, params = _pool_and_param_vars(spec)
    token_ids = relax.Var("token_ids", relax.TensorType([1], "int32"))
    table = relax.Var("block_table", relax.TensorType([1, cap], "int32"))
    scalar_ty = relax.TensorType([1], "int64") if dev else tvm.ir.PrimType("int64")
    ctx = relax.Var("context_len", scalar_ty)
    off = relax.Var("write_off", scalar_ty)
    b = _Builder(bb, spec, 1, funcs, k)
    b.pool_ty = pool_ty
    geo = (cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim, bs, cap, cdt)
    rope, attn = ((k.rope_kv_write_decode_dev, k.paged_attention_decode_dev) if dev
                  else (k.rope_kv_write_decode, k.paged_attention_decode))
    attn_args = (rope(*geo), attn, geo, [table, off, ctx], [table, ctx])
    with bb.function("decode_dev" if dev else "decode", [token_ids, table, ctx, off, pools, params],
                     attrs=_per_call_inputs(4)):
        with bb.dataflow():
            logits = b.body(token_ids, 1, pools, params, attn_args)
            out = bb.emit_output(logits)
        bb.emit_func_output(out)


def _emit_prefill(bb: relax.BlockBuilder, spec: BuildSpec, funcs: dict, k: KernelSet):
    cfg, cap, bs, cdt = spec.config, spec.max_blocks_cap, spec.block_size, spec.cache_dtype
    pool_ty, pools, params = _pool_and_param_vars(spec)
    n = tirx.Var("n", "int64")
    token_ids = relax.Var("token_ids", relax.TensorType([n], "int32"))
    table = relax.Var("block_table", relax.TensorType([1, cap], "int32"))
    start = relax.Var("start_pos", tvm.ir.PrimType("int64"))
    b = _Builder(bb, spec, None, funcs, k)
    b.pool_ty = pool_ty
    geo = (cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim, bs, cap, cdt)
    attn_args = (k.rope_kv_write_prefill(*geo), k.paged_attention_prefill, geo,
                 [table, start], [table, start])
    with bb.function("prefill", [token_ids, table, start, pools, params],
                     attrs=_per_call_inputs(3)):
        with bb.dataflow():
            logits = b.body(token_ids, n, pools, params, attn_args)
            out = bb.emit_output(logits)
        bb.emit_func_output(out)


def _emit_batch_decode(bb: relax.BlockBuilder, spec: BuildSpec, funcs: dict, k: KernelSet,
                       B: int):
    """``batch_decode_<B>``: the prefill body's matmuls over B rows of different sequences,
    with ragged RoPE / KV write and attention (each row its own table and length)."""
    cfg, cap, bs, cdt = spec.config, spec.max_blocks_cap, spec.block_size, spec.cache_dtype
    pool_ty, pools, params = _pool_and_param_vars(spec)
    token_ids = relax.Var("token_ids", relax.TensorType([B], "int32"))
    tables = relax.Var("block_tables", relax.TensorType([B, cap], "int32"))
    ctx = relax.Var("context_lens", relax.TensorType([B], "int64"))
    offs = relax.Var("write_offs", relax.TensorType([B], "int64"))
    b = _Builder(bb, spec, None, funcs, k, all_rows=True, rows=B)
    b.pool_ty = pool_ty
    geo = (cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim, bs, cap, cdt, B)
    attn_args = (k.rope_kv_write_batch(*geo), k.paged_attention_batch, geo,
                 [tables, offs, ctx], [tables, ctx])
    with bb.function(f"batch_decode_{B}", [token_ids, tables, ctx, offs, pools, params],
                     attrs=_per_call_inputs(4)):
        with bb.dataflow():
            logits = b.body(token_ids, B, pools, params, attn_args)
            out = bb.emit_output(logits)
        bb.emit_func_output(out)


def build_module(spec: BuildSpec, manifest: dict, kernels: KernelSet | None = None
                 ) -> tvm.IRModule:
    """The IRModule with ``decode``, ``decode_dev`` (when the kernel set has its kernels),
    ``prefill`` and ``_metadata`` (CPU kernels by default)."""
    bb = relax.BlockBuilder()
    funcs: dict[str, relax.GlobalVar] = {}
    kernels = kernels or kernels_for("llvm")
    _emit_decode(bb, spec, funcs, kernels)
    if kernels.rope_kv_write_decode_dev is not None and kernels.paged_attention_decode_dev:
        _emit_decode(bb, spec, funcs, kernels, dev=True)
    _emit_prefill(bb, spec, funcs, kernels)
    for rows in spec.batch_buckets:
        _emit_batch_decode(bb, spec, funcs, kernels, rows)
    with bb.function("_metadata", []):
        embedded = {k: v for k, v in manifest.items() if k not in DISK_ONLY}
        bb.emit_func_output(tvm.ir.StringImm(json.dumps(embedded, sort_keys=True)))
    return bb.get()
