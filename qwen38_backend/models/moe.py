"""Flash-Next mixture of experts: fp32 softmax router, top-k, gathered SwiGLU experts, and a
sigmoid-gated shared expert.

Weights layout (transformers' Qwen3NextExperts, which the 31-tensor MTP count confirms):
`mlp.gate.weight` [E, H], `mlp.experts.gate_up_proj` [E, 2I, H] (gate = FIRST half),
`mlp.experts.down_proj` [E, H, I], `mlp.shared_expert.{gate,up,down}_proj.weight`,
`mlp.shared_expert_gate.weight` [1, H]. Per-expert tensors (`mlp.experts.{e}.gate_proj.weight`,
the layout transformers' save_pretrained writes) are stacked by `fuse_expert_weights`.
"""

from __future__ import annotations

import math
import re
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..kernel_import import kernel_module
from ..rows import STEP_MAX_ROWS, kernel_product, per_row
from .layers import SwiGLU, can_fuse, fuse_linears, sum_fp32
from .parallel import all_sum, part_of, ranks, require_divisible

# Below this many (token, expert) pairs the unsorted gather is cheaper than sorting.
_SORT_THRESHOLD = 64


def route(logits: mx.array, top_k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Softmax in fp32 over experts, top-k, optional renormalisation.

    Returns (indices [T, k] uint32, weights [T, k] fp32). The order of the k experts within a
    row is unspecified (it does not change the weighted sum).
    """
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    inds = mx.argpartition(-probs, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(probs, inds, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return inds.astype(mx.uint32), weights


class Experts(nn.Module):
    """E SwiGLU experts stored as fused 3-D tensors, applied with `mx.gather_mm`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = mx.zeros((num_experts, 2 * intermediate, hidden))
        self.down_proj = mx.zeros((num_experts, hidden, intermediate))

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        """x [T, H], inds [T, k] -> per-(token, expert) outputs [T, k, H]."""
        T, k = inds.shape
        xe = x[:, None, None, :]  # [T, 1, 1, H]: one row per token, shared by its k experts
        if _sorts(T, k):
            # Prefill: one GEMM per expert over its tokens (a per-row gather_mm re-reads the
            # expert's weights for every row, which is ~100x slower on CPU).
            return _grouped(x, inds, self.num_experts, self._grouped_mm)
        gu = mx.gather_mm(  # [T, k, 1, 2I]
            xe, self.gate_up_proj.swapaxes(-1, -2), _rows(xe.shape[:-2]), inds
        )
        h = _swiglu(gu, self.intermediate)
        out = mx.gather_mm(h, self.down_proj.swapaxes(-1, -2), _rows(h.shape[:-2]), inds)
        return out.reshape(T, k, -1)

    def _grouped_mm(self, buf: mx.array) -> mx.array:
        """buf [E, cap, H]: every expert's rows -> [E, cap, H]."""
        h = _swiglu(buf @ self.gate_up_proj.swapaxes(-1, -2), self.intermediate)
        return h @ self.down_proj.swapaxes(-1, -2)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        return QuantizedExperts(self, group_size, bits, mode)


class QuantizedExperts(nn.Module):
    """Affine-quantized experts (MLX layout: weight/scales/biases per fused tensor)."""

    def __init__(self, src: Experts, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = (
            src.num_experts,
            src.hidden,
            src.intermediate,
        )
        self.group_size, self.bits, self.mode = group_size, bits, mode
        for name in ("gate_up_proj", "down_proj"):
            w, s, b = mx.quantize(getattr(src, name), group_size, bits)
            setattr(self, name, {"weight": w, "scales": s, "biases": b})

    def _qmm(self, x: mx.array, name: str, inds: mx.array, sorted_indices: bool) -> mx.array:
        p = getattr(self, name)
        return mx.gather_qmm(
            x,
            p["weight"],
            p["scales"],
            p["biases"],
            lhs_indices=_rows(x.shape[:-2]),
            rhs_indices=inds,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            sorted_indices=sorted_indices,
        )

    def _grouped_mm(self, buf: mx.array) -> mx.array:
        experts = mx.arange(self.num_experts)
        h = _swiglu(self._qmm(buf, "gate_up_proj", experts, True), self.intermediate)
        return self._qmm(h, "down_proj", experts, True)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        T, k = inds.shape
        xe = x[:, None, None, :]
        if _sorts(T, k):
            return _grouped(x, inds, self.num_experts, self._grouped_mm)
        h = _swiglu(self._qmm(xe, "gate_up_proj", inds, False), self.intermediate)
        return self._qmm(h, "down_proj", inds, False).reshape(T, k, -1)


def weighted_experts(
    experts: nn.Module, x: mx.array, inds: mx.array, weights: mx.array
) -> mx.array:
    """sum_j weights[t, j] * expert_{inds[t, j]}(x_t): the routed half of SparseMoE, [T, H]."""
    routed = experts(x, inds)  # [T, k, H]
    return sum_fp32(routed * weights[..., None].astype(routed.dtype), axis=1)


def _sorts(T: int, k: int) -> bool:
    """Whether T tokens' k experts each run grouped by expert (a prefill chunk) rather than
    one product per (token, expert) pair: a step's few rows never are, so each of a verify's
    rows is computed as its plain step computes it."""
    return T > STEP_MAX_ROWS and T * k >= _SORT_THRESHOLD


@cache
def _rows(batch: tuple[int, ...]) -> mx.array:
    """The lhs_indices gather_(q)mm makes when given none (each row its own batch entry),
    made once per shape: built per call, it is one more kernel per expert matmul."""
    rows = mx.arange(math.prod(batch), dtype=mx.uint32).reshape(batch)
    mx.eval(rows)
    return rows


def _grouped(x: mx.array, inds: mx.array, num_experts: int, mm) -> mx.array:
    """Lay the (token, expert) pairs out as [E, cap, H] (rows of one expert together, zero
    padded to the largest group), run `mm` on it, and read each pair's row back: [T, k, H]."""
    T, k = inds.shape
    flat = inds.reshape(-1).astype(mx.int32)
    order = mx.argsort(flat)
    sorted_e = flat[order]
    counts = mx.zeros((num_experts,), mx.int32).at[sorted_e].add(1)
    starts = mx.cumsum(counts) - counts
    slot = mx.arange(flat.size) - starts[sorted_e]
    cap = int(counts.max().item())  # a host sync; prefill only
    dest = sorted_e * cap + slot
    buf = mx.zeros((num_experts * cap, x.shape[-1]), x.dtype)
    buf[dest] = x[order // k]
    out = mm(buf.reshape(num_experts, cap, -1)).reshape(num_experts * cap, -1)[dest]
    return out[mx.argsort(order)].reshape(T, k, -1)


def _swiglu(gu: mx.array, intermediate: int) -> mx.array:
    return nn.silu(gu[..., :intermediate]) * gu[..., intermediate:]


class SparseMoE(nn.Module):
    """sum_k w_k * expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    _checked = ""  # the dtype prepare_decode decided for
    _route_for = ""  # the dtype whose steps route with kernels/moe_route.py ("": none)
    _kernel_for = ""  # the dtype whose steps run kernels/expert_qmv.py ("": none)

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        norm_topk_prob: bool = True,
    ):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.router_width = num_experts  # the router's logits (every expert, however sharded)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert = SwiGLU(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def fuse(self) -> None:
        """The router and the shared expert's gate (both read x) as one product (after
        loading and any `shard`): one launch a step fewer."""
        parts = [self.gate, self.shared_expert_gate]
        if not can_fuse(parts):
            return
        self.router_gate_proj = fuse_linears(parts)
        del self["gate"], self["shared_expert_gate"]

    def logits(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(router logits [T, experts], the shared expert's gate logit [T, 1]) of x."""
        # per_row: a verify row's products are a plain step's on the CPU (rows.py)
        if "router_gate_proj" in self:
            y = per_row(self.router_gate_proj, x)
            return y[..., : self.router_width], y[..., self.router_width :]
        return per_row(self.gate, x), per_row(self.shared_expert_gate, x)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(expert ids, weights) [T, top_k] of x's rows."""
        return self._routed(self.logits(x)[0])

    def _routed(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        if self._route_for == str(logits.dtype) and logits.shape[0] <= STEP_MAX_ROWS:
            kernel = kernel_module("moe_route")
            if kernel.fits(logits, self.top_k):
                return kernel.route(logits, self.top_k, self.norm_topk_prob)
        return route(logits, self.top_k, self.norm_topk_prob)

    def shard(self, group: mx.distributed.Group) -> None:
        """Expert parallel: this rank keeps experts [rank * E/n, (rank + 1) * E/n) and a
        column share of the shared expert; the router stays whole, so every rank routes
        alike, and the partial outputs are summed over the group once per call."""
        rank, size = ranks(group)
        experts = self.experts
        require_divisible("experts", experts.num_experts, size)
        local = experts.num_experts // size
        for name in ("gate_up_proj", "down_proj"):
            value = experts[name]
            if isinstance(value, dict):  # quantized: weight / scales / biases
                experts[name] = {k: part_of(v, 0, group) for k, v in value.items()}
            else:
                experts[name] = part_of(value, 0, group)
        experts.num_experts = local
        self.first_expert = rank * local
        self.shared_expert.shard(group, reduce=False)
        self.group = group

    def prepare_decode(self) -> None:
        """Decide (outside any compiled trace: the probes run ops) which kernels a step's MoE
        runs: the routing in one launch (kernels/moe_route.py) and the routed experts in two
        (kernels/expert_qmv.py: 4-bit affine experts on one device), each where it passed
        its probe for this shape and dtype."""
        router = self["router_gate_proj"] if "router_gate_proj" in self else self.gate
        dtype = router.get("scales", router.get("weight")).dtype  # the logits' dtype
        if self._checked == str(dtype):
            return  # decided once per dtype: this runs every step
        self._checked, self._route_for, self._kernel_for = str(dtype), "", ""
        routing = kernel_module("moe_route")
        if routing is not None and routing.available(
            self.router_width, self.top_k, self.norm_topk_prob, dtype
        ):
            self._route_for = str(dtype)
        experts = self.experts
        if not isinstance(experts, QuantizedExperts) or getattr(self, "group", None):
            return
        kernel = kernel_module("expert_qmv")
        shape = (experts.hidden, experts.intermediate, experts.num_experts, self.top_k)
        scales = experts.gate_up_proj["scales"].dtype
        if kernel is not None and kernel.available(*shape, experts.group_size, scales):
            self._kernel_for = str(scales)

    def _fused(self, x: mx.array) -> bool:
        """Whether this call's routed experts run as the expert kernels (prepare_decode)."""
        if self._kernel_for != str(x.dtype) or x.shape[0] > STEP_MAX_ROWS:
            return False
        return kernel_module("expert_qmv").fits(x, self.experts, self.top_k)

    def __call__(self, x: mx.array) -> mx.array:
        logits, gate = self.logits(x)
        inds, weights = self._routed(logits)
        group = getattr(self, "group", None)
        if group is not None:
            return all_sum(self._local_experts(x, inds, weights) + self._shared(x, gate), group)
        if self._fused(x):  # the shared expert run in the kernels, or its output added there
            e, kernel = self.experts, kernel_module("expert_qmv")
            args = (x, inds, weights, e.gate_up_proj, e.down_proj, e.group_size)
            se = self.shared_expert
            if kernel.runs_shared(se, x.dtype):
                weights_of = (gate, se.gate_up_proj.weight, se.down_proj.weight)
                return kernel.routed_sum(*args, shared_weights=weights_of)
            return kernel.routed_sum(*args, shared=(gate, se(x)))
        return weighted_experts(self.experts, x, inds, weights) + self._shared(x, gate)

    def step_launches(self, x: mx.array, view) -> list[mx.array] | None:
        """A one-row step's MoE up to its last launch, as launches (kernels/fused.py): the
        fused router product, the routing kernel and the experts' up launch with the shared
        expert's pair: [activations, expert ids, weights, the shared expert's gate logit],
        the router's outputs taken by `view(a, offset, shape)`; `finish` then runs the down
        launch. None where the step does not run these kernels (then `__call__`)."""
        if "router_gate_proj" not in self or not self._fused(x) or x.shape[0] != 1:
            return None
        se, kernel = self.shared_expert, kernel_module("expert_qmv")
        if not kernel.runs_shared(se, x.dtype):
            return None
        y = kernel_product(self.router_gate_proj, x)
        if y is None or self._route_for != str(y.dtype):
            return None
        logits = view(y, 0, (1, self.router_width))
        gate = view(y, self.router_width, (1, 1))
        routing = kernel_module("moe_route")
        if not routing.fits(logits, self.top_k):
            return None
        inds, weights = routing.route(logits, self.top_k, self.norm_topk_prob)
        e = self.experts
        h = kernel.activations(x, inds, e.gate_up_proj, e.group_size, se.gate_up_proj.weight)
        return [h, inds, weights, gate]

    def finish(self, h: mx.array, inds: mx.array, weights: mx.array, gate: mx.array):
        """The MoE's output [1, hidden] from `step_launches`' outputs: the down launch."""
        se, e = self.shared_expert, self.experts
        shared = (gate, se.gate_up_proj.weight, se.down_proj.weight)
        return kernel_module("expert_qmv").summed(
            h, inds, weights, e.down_proj, e.group_size, e.hidden, shared_weights=shared
        )

    def _shared(self, x: mx.array, gate: mx.array) -> mx.array:
        """The gated shared expert; `gate`: its gate logit (`logits`' second output)."""
        return mx.sigmoid(gate) * self.shared_expert(x)

    def _local_experts(self, x: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        """sum over the (token, expert) pairs routed to this rank's experts, [T, H]."""
        T, k = inds.shape
        local = inds.astype(mx.int32) - self.first_expert
        mine = (local >= 0) & (local < self.experts.num_experts)
        if not _sorts(T, k):
            # a step: pairs of other ranks point at expert 0 with weight 0 (no host sync)
            routed = self.experts(x, mx.where(mine, local, 0).astype(mx.uint32))
            w = mx.where(mine, weights, 0.0)
            return sum_fp32(routed * w[..., None].astype(routed.dtype), axis=1)
        # prefill: run only this rank's pairs (the others would all pile onto one expert)
        pairs = mx.array(np.flatnonzero(np.array(mine.reshape(-1))).astype(np.int32))
        out = mx.zeros((T, x.shape[-1]), x.dtype)
        if pairs.size == 0:
            return out
        tokens = pairs // k
        routed = self.experts(x[tokens], local.reshape(-1)[pairs][:, None].astype(mx.uint32))
        w = weights.reshape(-1)[pairs][:, None].astype(routed.dtype)
        return out.at[tokens].add(routed[:, 0] * w)


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Stack per-expert `experts.{e}.{gate,up,down}_proj.weight` into the fused 3-D tensors."""
    groups: dict[str, dict[str, dict[int, mx.array]]] = {}
    out = {}
    for name, w in weights.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = w
            continue
        groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = w
    for prefix, parts in groups.items():
        n = max(max(p) for p in parts.values()) + 1

        def stacked(kind: str, prefix: str = prefix, parts=parts, n: int = n) -> mx.array:
            got = parts.get(kind, {})
            missing = [e for e in range(n) if e not in got]
            if missing:
                from ..errors import WeightsError

                raise WeightsError(f"{prefix}: experts {missing[:8]} lack {kind}.weight")
            return mx.stack([got[e] for e in range(n)])

        out[f"{prefix}.gate_up_proj"] = mx.concatenate(
            [stacked("gate_proj"), stacked("up_proj")], axis=1
        )
        out[f"{prefix}.down_proj"] = stacked("down_proj")
    return out
