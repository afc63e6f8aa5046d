"""Layers shared by every model family: norms, RoPE, GQA attention (optionally gated), SwiGLU."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import scalars
from ..kernel_import import kernel_module
from ..rows import (
    STEP_MAX_ROWS,
    forward_pad,
    kernel_dtype,
    kernel_product,
    project,
    quantized_mode,
    split_rows,
    swiglu_product,
)
from .parallel import ranks, require_divisible, split_inputs_of, split_outputs_of, summed_over


class _Derived:
    """A value computed from a parameter, recomputed only when the parameter is replaced.
    (A plain object, so nn.Module does not register it as a parameter.)"""

    def __init__(self) -> None:
        self.source: mx.array | None = None
        self.value: mx.array | None = None

    def get(self, source: mx.array, fn) -> mx.array:
        if self.source is not source:
            self.source, self.value = source, fn(source)
        return self.value


class RMSNorm(nn.Module):
    """RMSNorm; `zero_centered` stores w and scales by (1 + w), with 1 + w kept in fp32
    (a parameter of its own once `fuse()` ran)."""

    def __init__(self, dims: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = mx.zeros((dims,)) if zero_centered else mx.ones((dims,))
        self._scale = _Derived()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.for_product(x)
        if not self.zero_centered:
            return y
        return y if y.dtype == x.dtype else y.astype(x.dtype)

    def for_product(self, x: mx.array) -> mx.array:
        """The normalised rows before the zero-centred form's cast back to x's dtype (fp32
        for a half-precision x): for rows.project, which rounds them as that cast would,
        inside the product's kernel (one launch fewer). The plain form is the norm itself."""
        if not self.zero_centered:
            return mx.fast.rms_norm(x, self.weight, self.eps)
        # a half-precision x with the fp32 scale is normalised in fp32 (output fp32): MLX
        # casts x up itself; one launch doing cast, norm and cast back decoded slower on the
        # H200 (results/h200/norm_kernel_*_4k.json)
        return mx.fast.rms_norm(x, self.scale(), self.eps)

    def compute_dtype(self, dtype: mx.Dtype) -> mx.Dtype:
        """The dtype this norm computes rows of `dtype` in: fp32 for the zero-centred form
        (its scale is fp32, so MLX casts the rows up first), else `dtype`."""
        return mx.float32 if self.zero_centered else dtype

    def scale(self) -> mx.array:
        """1 + w in fp32: the folded parameter once `fuse()` ran (a compiled step replays its
        graph, and 1 + w inside it would be a kernel every token), else derived once per
        weight (also where a weight was set again after `fuse()`: it is the newer)."""
        if "weight" not in self:
            return self.folded
        return self._scale.get(self.weight, lambda w: 1.0 + w.astype(mx.float32))

    def fuse(self) -> None:
        """The zero-centred form's scale 1 + w as its parameter `folded` (after loading; the
        weight goes, so nothing reads a stale one)."""
        if self.zero_centered and "weight" in self:
            self.folded = 1.0 + self.weight.astype(mx.float32)
            mx.eval(self.folded)
            del self["weight"]


def fuse_linears(linears: list[nn.Module]) -> nn.Module:
    """One linear whose output is the concatenation of `linears`' outputs (same input).

    Fewer, larger matmuls per token: on a GPU each projection is a kernel launch. Works for
    plain and affine-quantized linears (rows, scales and biases concatenate along outputs).
    """
    first = linears[0]
    cat = {
        key: mx.concatenate([m[key] for m in linears], axis=0)
        for key in ("weight", "scales", "biases", "bias")
        if key in first
    }
    if isinstance(first, nn.QuantizedLinear):
        fused = nn.QuantizedLinear(
            first.group_size, 1, bias="bias" in cat, group_size=first.group_size, bits=first.bits
        )
    else:
        fused = nn.Linear(1, 1, bias="bias" in cat)
    fused.update(cat)
    mx.eval(fused.parameters())
    return fused


def can_fuse(linears: list[nn.Module]) -> bool:
    kinds = {
        (type(m), getattr(m, "group_size", 0), getattr(m, "bits", 0), "bias" in m) for m in linears
    }
    return len(kinds) == 1 and type(linears[0]) in (nn.Linear, nn.QuantizedLinear)


def split_outputs(y: mx.array, sizes: list[int]) -> list[mx.array]:
    """Split the last axis of a fused projection's output into the parts' sizes."""
    cuts, total = [], 0
    for n in sizes[:-1]:
        total += n
        cuts.append(total)
    return mx.split(y, cuts, axis=-1)


def fuse_projections(net: nn.Module) -> None:
    """Call `fuse()` on every trunk module that offers it (after the weights are loaded).

    The MTP draft head keeps its weights' layout (its tensors are inspected as such)."""
    for name, module in net.named_modules():
        if name.startswith("mtp"):
            continue
        fuse = getattr(module, "fuse", None)
        if callable(fuse):
            fuse()


@dataclass(frozen=True)
class RopeSpec:
    """How positions rotate a head: rotary dims, base, and optional precomputed frequencies."""

    dims: int
    theta: float
    scale: float = 1.0
    interleaved: bool = False
    freqs: mx.array | None = None

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """x: [1, heads, T, head_dim]; rotates the first `dims` features of every head."""
        base = None if self.freqs is not None else self.theta
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.interleaved,
            base=base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )


def rope_from_config(
    head_dim: int,
    theta: float,
    scaling: dict | None,
    partial_factor: float = 1.0,
    interleaved: bool = False,
) -> RopeSpec:
    """Build a RopeSpec from HF config fields (default, linear and llama3 scaling)."""
    dims = int(head_dim * partial_factor)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return RopeSpec(dims, theta, interleaved=interleaved)
    if kind == "linear":
        return RopeSpec(dims, theta, scale=1.0 / float(scaling["factor"]), interleaved=interleaved)
    if kind == "llama3":
        return RopeSpec(
            dims, theta, interleaved=interleaved, freqs=_llama3_freqs(dims, theta, scaling)
        )
    from ..errors import UnsupportedArchitectureError

    raise UnsupportedArchitectureError(
        f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


def _llama3_freqs(dims: int, theta: float, s: dict) -> mx.array:
    # Wavelength-dependent interpolation of Llama 3.1: long wavelengths scaled by `factor`,
    # short ones kept, a smooth blend between.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    orig = float(s.get("original_max_position_embeddings", 8192))
    freqs = theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # 1 / inv_freq
    wavelen = 2 * math.pi * freqs
    smooth = (orig / wavelen - low) / (high - low)
    blended = freqs / ((1 - smooth) / factor + smooth)
    out = mx.where(wavelen > orig / low, freqs * factor, freqs)
    medium = (wavelen <= orig / low) & (wavelen >= orig / high)
    return mx.where(medium, blended, out)


class Attention(nn.Module):
    """GQA self-attention: optional qkv bias, q/k norm, per-head output gate, partial rotary.

    The KV store owns attention over the past (`kv.attend`), so the contiguous and the paged
    stores are interchangeable without touching this layer.
    """

    _qk_checked = ""  # the dtype prepare_decode decided for
    _qk_kernel_for = ""  # the dtype whose steps run kernels/qk_norm_rope.py ("": none)

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RopeSpec,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        zero_centered_norm: bool = False,
        output_gate: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope = rope
        self.output_gate = output_gate
        self.scale = head_dim**-0.5
        q_out = n_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden, q_out, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=o_bias)
        self.has_qk_norm = qk_norm_eps is not None
        if self.has_qk_norm:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered_norm)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered_norm)

    def project_qkv(
        self, x: mx.array, offset: int | mx.array, norm: RMSNorm | None = None
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Return roped q [1,H,T,D], k and v [1,Hkv,T,D], and the gate [T, H*D] (or None)
        of x's rows (with `norm`: of norm.for_product(x), rows.project)."""
        T = x.shape[0]
        H, D = self.n_heads, self.head_dim
        if "qkv_proj" in self:
            qkv = project(self.qkv_proj, x, norm=norm)
            step = isinstance(offset, mx.array) and T <= STEP_MAX_ROWS
            if step and self._qk_kernel_for == str(qkv.dtype):
                return self._step_heads(qkv, offset)
            q, k, v = split_outputs(qkv, self._qkv_sizes)
        else:
            x = x if norm is None else norm.for_product(x)
            q, k, v = (project(self[name], x) for name in ("q_proj", "k_proj", "v_proj"))
        gate = None
        if self.output_gate:
            q = q.reshape(T, H, 2 * D)
            q, gate = q[..., :D], q[..., D:].reshape(T, H * D)
        q = q.reshape(1, T, H, D)
        k = k.reshape(1, T, self.n_kv_heads, D)
        v = v.reshape(1, T, self.n_kv_heads, D)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope(q.transpose(0, 2, 1, 3), offset)
        k = self.rope(k.transpose(0, 2, 1, 3), offset)
        return q, k, v.transpose(0, 2, 1, 3), gate

    def _step_heads(self, qkv: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        """project_qkv's outputs from the fused rows of a step, the q/k norms and RoPE in one
        CUDA launch (kernels/qk_norm_rope.py; prepare_decode chose it)."""
        q, k, gate = kernel_module("qk_norm_rope").qk_norm_rope(
            qkv, self.q_norm.scale(), self.k_norm.scale(), offset, self._qk_layout
        )
        return self.heads_from(qkv, q, k, gate)

    def heads_from(self, qkv: mx.array, q: mx.array, k: mx.array, gate=None) -> tuple:
        """project_qkv's (q, k, v, gate) from the fused rows and the q/k kernel's outputs."""
        T, D, kv_heads = qkv.shape[0], self.head_dim, self.n_kv_heads
        v = qkv[:, -kv_heads * D :].reshape(1, T, kv_heads, D).transpose(0, 2, 1, 3)
        return q, k, v, gate

    def qkv_launches(self, x: mx.array, offset: mx.array, norm: RMSNorm | None = None):
        """project_qkv's launches for a step's one row, kernels only: [the fused rows qkv, q,
        k, (gate)] (heads_from takes them), the fused product (rows.kernel_product, with
        `norm` as a launch of its own) then the q/k norm + RoPE kernel, the bits of
        project_qkv's; None where the step does not run them, or where the q/k kernel's
        block (a head: head_dim threads) is not the products' (a fused launch takes one
        thread count)."""
        if "qkv_proj" not in self or x.shape[0] != 1 or not isinstance(offset, mx.array):
            return None
        if self.head_dim != kernel_module("rows_matmul").THREADS:
            return None
        qkv = kernel_product(self.qkv_proj, x, norm=norm)
        if qkv is None or self._qk_kernel_for != str(qkv.dtype):
            return None
        heads = kernel_module("qk_norm_rope").qk_norm_rope(
            qkv, self.q_norm.scale(), self.k_norm.scale(), offset, self._qk_layout
        )
        return [qkv, *(a for a in heads if a is not None)]

    def prepare_decode(self) -> None:
        """Decide (outside any compiled trace: the kernel's probe runs ops) whether a step's
        q/k norms and RoPE run as one CUDA launch: fused q/k/v, zero-centred norms of one eps,
        a rotation without precomputed frequencies, and the kernel passed its probe for the
        fused product's dtype. Decided once per dtype: this runs every token."""
        linear = self.get("qkv_proj")
        if linear is None:
            return
        dtype = linear.get("scales", linear.get("weight")).dtype  # the product's dtype
        if self._qk_checked == str(dtype):
            return
        self._qk_checked = str(dtype)
        self._qk_kernel_for = ""
        kernels = kernel_module("qk_norm_rope")
        norms = (self.q_norm, self.k_norm) if self.has_qk_norm else ()
        if (
            kernels is None
            or not norms
            or not all(n.zero_centered for n in norms)
            or self.q_norm.eps != self.k_norm.eps
            or self.rope.freqs is not None
        ):
            return
        rope = self.rope
        layout = kernels.HeadLayout(
            self.n_heads, self.n_kv_heads, self.head_dim, self.output_gate,
            self.q_norm.eps, rope.dims, rope.theta, rope.scale, rope.interleaved,
        )  # fmt: skip
        if kernels.available(layout, dtype):
            self._qk_layout = layout
            self._qk_kernel_for = str(dtype)

    def shard(self, group: mx.distributed.Group) -> None:
        """Keep this rank's heads (tensor parallel; before `fuse`): q/k/v rows cut by head,
        o_proj's inputs cut and its output summed over the group."""
        _, size = ranks(group)
        require_divisible("attention heads", self.n_heads, size)
        require_divisible("key/value heads", self.n_kv_heads, size)
        for name in ("q_proj", "k_proj", "v_proj"):
            split_outputs_of(self[name], group)
        self.o_proj = summed_over(self.o_proj, group)
        self.n_heads //= size
        self.n_kv_heads //= size

    def fuse(self) -> None:
        """Replace q/k/v projections by one fused matmul (after loading)."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if not can_fuse(parts):
            return
        self._qkv_sizes = [p.weight.shape[0] for p in parts]
        if isinstance(parts[0], nn.QuantizedLinear):
            self._qkv_sizes = [p.scales.shape[0] for p in parts]
        self.qkv_proj = fuse_linears(parts)
        for name in ("q_proj", "k_proj", "v_proj"):
            del self[name]

    def output(self, out: mx.array, gate: mx.array | None) -> mx.array:
        """Attention output [1, H, T, D] -> gated (if any) and projected [T, hidden]."""
        return project(self.o_proj, self.gated(out, gate))

    def gated(self, out: mx.array, gate: mx.array | None) -> mx.array:
        """Attention output [1, H, T, D] -> o_proj's input rows [T, H * D], gated (if any)."""
        out = out.transpose(0, 2, 1, 3).reshape(out.shape[2], -1)
        return out if gate is None else out * mx.sigmoid(gate)

    def __call__(self, x: mx.array, kv, offset: int | mx.array) -> mx.array:
        q, k, v, gate = self.project_qkv(x, offset)
        return self.output(kv.attend(q, k, v, self.scale), gate)


def compiled(module: nn.Module, method: str) -> Callable:
    """`module.method` under mx.compile, traced once per module (and row padding: a trace
    holds how the products in it run: rows.forward_pad(), rows.kernel_dtype(),
    rows.split_rows(), rows.quantized_mode()).

    The module's parameters are implicit inputs (read at every call, so replaced weights are
    seen). Meant for the fixed-shape pieces of a decode step: one graph replay with fused
    elementwise ops instead of dozens of ops re-built from Python per token, which on a GPU is
    what separates the kernels.
    """
    cache = module.__dict__.setdefault("_compiled_methods", {})
    key = (method, forward_pad(), kernel_dtype(), split_rows(), quantized_mode())
    if key not in cache:
        cache[key] = mx.compile(getattr(module, method), inputs=module)
    return cache[key]


class PreNormBlock(nn.Module):
    """A block h + attn(norm(h)), then h + mlp(norm(h)), with `self_attn` an Attention.

    Subclasses provide input_layernorm, self_attn, post_attention_layernorm and mlp.
    `decode_attention` is the step of a few rows (a decode step, a speculative verify: up to
    rows.STEP_MAX_ROWS): everything but the KV store's attend runs as two compiled graphs
    (before and after it), the same graphs for one row and for several."""

    # False: decode builds the step op by op like prefill (benchmarks compare the two)
    compile_decode = True

    def attention_block(self, h: mx.array, kv, offset: int) -> mx.array:
        if h.shape[0] <= STEP_MAX_ROWS and self.compile_decode:
            return self.decode_attention(h, kv, offset)
        h = h + self.self_attn(self.input_layernorm(h), kv, offset)
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode_attention(self, h: mx.array, kv, offset: int) -> mx.array:
        self.self_attn.prepare_decode()  # outside the trace: the kernel's probe runs ops
        if h.shape[0] == 1 and str(h.dtype) not in self._fusion_decided:
            self._decide_fusions(h.dtype)  # outside the trace: the probes run launches
        # the position as an array: a Python int would be traced as a constant
        q, k, v, *gate = compiled(self, "_attention_in")(h, scalars.int32(offset))
        finish = compiled(self, "_attention_out")
        scale = self.self_attn.scale
        attend_then = getattr(kv, "attend_then", None)  # PagedKV: hands `finish` over early
        if attend_then is None:
            return finish(h, kv.attend(q, k, v, scale), *gate)
        return attend_then(q, k, v, scale, lambda out: finish(h, out, *gate))

    def _attention_in(self, h: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        attn, norm = self.self_attn, self.input_layernorm
        fused = None
        if h.shape[0] == 1 and str(h.dtype) in self._fuse_in_for:  # (what the probe ran)
            fused = kernel_module("fused").run(lambda _: attn.qkv_launches(h, offset, norm))
        if fused is not None:
            q, k, v, gate = attn.heads_from(*fused)
        else:
            q, k, v, gate = attn.project_qkv(h, offset, norm=norm)
        return (q, k, v) if gate is None else (q, k, v, gate)

    def _attention_out(self, h: mx.array, out: mx.array, gate: mx.array | None = None):
        attn, post = self.self_attn, self.post_attention_layernorm
        a = attn.gated(out, gate)
        if h.shape[0] == 1 and str(h.dtype) in self._fuse_out_for:  # (what the probe ran)
            fused = kernel_module("fused").run(
                lambda view: _listed(residual_launches(h, a, attn.o_proj, post, self.mlp))
            )
            if fused is not None:
                return fused[0]
        return residual_step(h, a, attn.o_proj, post, self.mlp)

    # the block input dtypes whose one-row step runs its q/k/v side (the input norm, the
    # fused product, the q/k kernel: Attention.qkv_launches) and its o_proj to the block's
    # output (residual_launches) as one fused launch each, and those decided (frozensets: a
    # module would hold a dict as a child)
    _fuse_in_for: frozenset[str] = frozenset()
    _fuse_out_for: frozenset[str] = frozenset()
    _fusion_decided: frozenset[str] = frozenset()

    def _decide_fusions(self, h_dtype: mx.Dtype) -> None:
        """Whether a one-row step's q/k/v side and its o_proj (with the residual),
        post-attention norm and MLP (with the residual) run as one launch each with the bits
        of their launches apart (kernels/fused.py; probed on random rows of these dtypes,
        once per shape)."""
        fused, attn = kernel_module("fused"), self.self_attn
        if fused is not None:
            keys = mx.random.split(mx.random.key(46), 3)
            o_proj = attn.o_proj.weight
            h = mx.random.normal((1, o_proj.shape[0]), key=keys[0]).astype(h_dtype)
            a = mx.random.normal((1, o_proj.shape[1]), key=keys[1]).astype(o_proj.dtype)
            offset = mx.array(37, dtype=mx.int32)
            post, mlp, norm = self.post_attention_layernorm, self.mlp, self.input_layernorm
            products = (attn.get("qkv_proj"), attn.o_proj, mlp.get("gate_up_proj"), mlp.down_proj)
            weights = [p.get("weight") for p in products if p is not None]  # (a sharded one: none)
            kinds = [(w.shape, str(w.dtype)) for w in weights if w is not None]
            key = (str(h_dtype), kinds)
            if fused.agrees(
                str(("attention in", key)), lambda _: attn.qkv_launches(h, offset, norm)
            ):
                self._fuse_in_for |= {str(h_dtype)}
            out = lambda _: _listed(residual_launches(h, a, attn.o_proj, post, mlp))  # noqa: E731
            if fused.agrees(str(("attention out", key)), out):
                self._fuse_out_for |= {str(h_dtype)}
        self._fusion_decided |= {str(h_dtype)}


def residual_step(
    h: mx.array, a: mx.array, out_proj: nn.Module, norm: RMSNorm, mlp: nn.Module
) -> mx.array:
    """s + mlp(norm(s)) for s = h + out_proj(a), inside a compiled step, the sums in the
    products' epilogues where the row-invariant kernel runs them (rows.project: no kernel of
    their own), each rounded to the products' dtype as a sum of that dtype is.

    Both sums are stored in the dtype the norm computes in (fp32 for a zero-centred norm of
    half-precision rows), which holds them exactly: nothing casts s for the norm, nor the
    block's output for the next block's input norm (SequenceState.run_layers casts the last
    one back). A sum cast back to the products' dtype first is exact."""
    s = project(out_proj, a, residual=h, dtype=norm.compute_dtype(h.dtype))
    return mlp(s, residual=s, dtype=s.dtype, norm=norm)


def residual_launches(
    h: mx.array, a: mx.array, out_proj: nn.Module, norm: RMSNorm, mlp: nn.Module
) -> mx.array | None:
    """residual_step's output for a step's rows as launches with nothing between them
    (rows.kernel_product: out_proj with the residual, the norm as a launch of its own, gate /
    up with the swiglu, down with the residual), with residual_step's bits, or None where
    the step does not run them: what a fused launch takes as phases (kernels/fused.py)."""
    if "gate_up_proj" not in mlp:
        return None
    s = kernel_product(out_proj, a, residual=h, dtype=norm.compute_dtype(h.dtype))
    y = None if s is None else kernel_product(mlp.gate_up_proj, s, swiglu=True, norm=norm)
    return None if y is None else kernel_product(mlp.down_proj, y, residual=s, dtype=s.dtype)


def _listed(a: mx.array | None) -> list[mx.array] | None:
    return None if a is None else [a]


@mx.compile
def sum_fp32(x: mx.array, axis: int) -> mx.array:
    """x summed over `axis` in fp32 in index order, rounded once to x's dtype: as the CPU
    sums half types (bit for bit) and as the stream-mix and expert kernels sum. MLX's CUDA
    sum accumulates in the half type itself (a bf16 mean of four differs in ~1/3 of its
    values). One fused kernel: the parts are read in place, never copied to fp32 whole (a
    prefill chunk's [T, k, H] routed outputs would double)."""
    parts = mx.split(x, x.shape[axis], axis=axis)
    total = parts[0].astype(mx.float32)
    for part in parts[1:]:
        total = total + part.astype(mx.float32)
    return total.squeeze(axis).astype(x.dtype)


@mx.compile
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up as one fused kernel."""
    return nn.silu(gate) * up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def shard(self, group: mx.distributed.Group, reduce: bool = True) -> None:
        """Keep this rank's intermediate columns (before `fuse`); `reduce=False` leaves the
        sum of the partial outputs to the caller."""
        _, size = ranks(group)
        require_divisible("MLP intermediate size", self.gate_proj.weight.shape[0], size)
        split_outputs_of(self.gate_proj, group)
        split_outputs_of(self.up_proj, group)
        if reduce:
            self.down_proj = summed_over(self.down_proj, group)
        else:
            split_inputs_of(self.down_proj, group)

    def fuse(self) -> None:
        """gate and up as one matmul (after loading)."""
        if not can_fuse([self.gate_proj, self.up_proj]):
            return
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self["gate_proj"], self["up_proj"]

    def __call__(
        self,
        x: mx.array,
        residual: mx.array | None = None,
        dtype: mx.Dtype | None = None,
        norm: RMSNorm | None = None,
    ) -> mx.array:
        """down(silu(gate(x)) * up(x)), plus `residual` then cast to `dtype` (rows.project);
        with `norm`, of norm.for_product(x) (normed in the product's kernel where it can)."""
        if norm is not None:
            y = swiglu_product(self.gate_up_proj, x, norm) if "gate_up_proj" in self else None
            if y is not None:
                return project(self.down_proj, y, residual=residual, dtype=dtype)
            x = norm.for_product(x)
        if "gate_up_proj" not in self:
            y = swiglu(project(self.gate_proj, x), project(self.up_proj, x))
        elif (y := swiglu_product(self.gate_up_proj, x)) is None:
            y = swiglu(*mx.split(project(self.gate_up_proj, x), 2, axis=-1))
        return project(self.down_proj, y, residual=residual, dtype=dtype)
