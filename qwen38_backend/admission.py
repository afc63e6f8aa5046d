"""Admission: the memory a session needs, computed before anything is allocated.

`memory_plan(config_or_model, context, **options)` lists every component in bytes from the
config and the options alone (a config dict is enough: `qwen38 info MODEL --context N`):

- weights: every parameter of the network as built for this config (built lazily: MLX does
  not allocate until evaluation), in the weights dtype, quantized as the config says; an
  engine Model counts its loaded parameters. Qwen3.8-Flash-Next's n-gram table is listed
  separately as memory-mapped (it is read a few rows per token, never resident as a whole).
- kv: K and V of every attention layer for the rows the store allocates. Which store, and
  its pool, is `kv.choose_kv` (the KV factory's own decision): the contiguous store grows in
  steps of 256 rows; the paged store in whole pages (growth simulated over the prefill chunks
  and decode steps with the pool's own `grown_capacity`; after the first chunk the engine
  reserves room for the whole context at once, Model.prefill) up to its pool: `kv_pool_tokens`,
  or the auto pool (`kv.policy.auto_pool_tokens` of the memory available, less the weights
  when they are not loaded yet).
- kv_spill (disk): with a pool smaller than the context, the spill file can come to hold
  every sealed page (pages leave the pool once written and are written once per version);
  `admit` checks it against the free space of the spill directory.
- kv_growth: the transient of the last growth (the old buffer lives until the copy is done).
- quest_meta: per sealed page, per KV head, key min and max in bf16 (paged store only; resident;
  not for Flash-Next, whose QSA indexer selects).
- recurrent: Gated DeltaNet state, fp32 [value heads, key dim, value dim] per layer, plus
  the conv rows (kernel - 1) x conv channels in the state dtype.
- indexer: QSA raw indexer keys per token and pooled keys per block of `compress_ratio`
  (buffers grown in steps of 256 rows); indexer_growth: the old buffer alive during the
  last growth.
- qsa_scratch: what one QSA selection holds at once: a decode step's block scores, selection
  rows and gathered K/V (budget + tail rows), or one prefill query group's (models/qsa.py
  query_bytes / group_queries; the groups are evaluated one at a time).
- ple_state: PLE conv rows and n-gram context ids.
- mtp_reserve: the MTP head's own KV (and indexer keys) over the context, when MTP is on.
- scratch: one prefill chunk's activations (widest layer output, fp32; a Gated DeltaNet
  block's chunked form where larger: models/gated_delta.py PREFILL_ROWS_LIVE; each layer is
  handed to the device as it is built, so one layer's, not all of them), the attention scores
  of one chunk (one-shot against the context while small or not fused, else the blocked
  walk's few blocks: kv/blocked.py), and the last position's logits; on CUDA the
  activations and scores times RELEASE_LAG (finished work's buffers are released late).

`admit(plan, available)` raises AdmissionError "needs X bytes, has Y, short by Z" (RAM),
the same for the spill file's disk, and refuses a pool too small for a sparse decode step.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import settle
from .config import model_family, text_config
from .errors import AdmissionError, InvalidOptionError
from .kv.blocked import BLOCK_TOKENS, ONE_SHOT_BYTES, SCORE_BLOCKS_LIVE, walk_block
from .kv.contiguous import ContiguousKV
from .kv.policy import (
    AUTO_MIN_PAGES,
    KV_OPTION_KEYS,
    KVChoice,
    auto_pool_tokens,
    choose_kv,
    spill_root,
)
from .kv.pool import grown_capacity
from .kv.quest import META_DTYPE, forced_pages
from .models.gated_delta import PREFILL_ROWS_LIVE

# On CUDA a finished layer's (or walk block's) buffers are released on MLX's worker thread some
# time after the device ran it (settle.py), so a chunk's peak passes the one layer's scratch
# this plan counts. A prefill settles every state.PREFILL_SETTLE_EVERY layers, which bounds
# the pile: on the H200 (27B dims, 2048-token chunk, 384 MiB walk blocks) 1.20x / 1.25x the
# planned scratch at 131K / 262K, two runs each (3.81 / 3.95 of 3.17 GB,
# benchmarks/results/h200/depth_settle8_score384*.json); unsettled it reached 3.9x (262K,
# depth262k_score128.json). tests/test_admission.py checks the committed runs against the plan.
RELEASE_LAG = 2.0

PLAN_OPTIONS = frozenset(
    {
        "dtype",
        "weights_dtype",
        "kv_dtype",
        "prefill_chunk",
        "mtp",
        "fused_attention",
        "release_lag",
        "available",
        "ranks",
    }
    | KV_OPTION_KEYS
)

_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
}
_MX = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
CONTIGUOUS_STEP = ContiguousKV.step  # also the QSA key buffers' step


@dataclass
class Component:
    name: str
    nbytes: int
    where: str = "ram"  # "ram" (needed resident), "disk" (spill file), "mmap" (paged in)
    detail: str = ""


@dataclass
class MemoryPlan:
    """Per-component bytes for one sequence of `context` tokens."""

    family: str
    context: int
    dtype: str
    components: list[Component] = field(default_factory=list)
    kv: KVChoice | None = None  # the KV store decision (kv.choose_kv)
    pool_pages: int | None = None  # per attention layer (paged); None: unbounded
    selection_pages: int = 0  # pages a sparse decode step may need resident at once
    spill_dir: Path | None = None  # where the spill file goes (when kv_spill > 0)
    ranks: int = 1  # the plan is one rank's of a model split over this many
    kv_token_bytes: int = 0  # K+V of one token over every attention layer
    # the prefill scratch counts buffers released late (RELEASE_LAG; CUDA), or the device
    # releases late and the plan is for a settled prefill (settle.py: one layer's scratch)
    lagged: bool = False
    settled: bool = False

    def __getitem__(self, name: str) -> int:
        return sum(c.nbytes for c in self.components if c.name == name)

    @property
    def weights(self) -> int:
        return self["weights"]

    @property
    def ram(self) -> int:
        """Bytes that must be resident (weights included)."""
        return sum(c.nbytes for c in self.components if c.where == "ram")

    @property
    def per_sequence(self) -> int:
        """Resident bytes beyond the weights (what a session adds to a loaded model)."""
        return self.ram - self.weights

    @property
    def disk(self) -> int:
        return sum(c.nbytes for c in self.components if c.where == "disk")

    def required(self, include_weights: bool = True) -> int:
        return self.ram if include_weights else self.per_sequence

    def as_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "context": self.context,
            "dtype": self.dtype,
            "ranks": self.ranks,
            "components": {c.name: {"bytes": c.nbytes, "where": c.where} for c in self.components},
            "ram_bytes": self.ram,
            "disk_bytes": self.disk,
            "kv_store": "paged" if self.kv is not None and self.kv.paged else "contiguous",
            "pool_tokens": None if self.pool_pages is None else self.pool_pages * self.page_tokens,
            "spill_dir": str(self.spill_dir) if self.disk else None,
        }

    @property
    def page_tokens(self) -> int:
        return self.kv.page_tokens if self.kv is not None else 0


# ----- available memory -------------------------------------------------------------------------
def available_memory() -> int | None:
    """Bytes a new allocation can use now: GPU memory on Metal/CUDA, else available RAM."""
    try:
        if mx.metal.is_available():
            info = mx.device_info()
            total = int(info.get("max_recommended_working_set_size", info.get("memory_size", 0)))
            return max(total - int(mx.get_active_memory()), 0) if total else None
        if mx.cuda.is_available():
            info = mx.device_info()
            total = int(info.get("total_memory", info.get("memory_size", 0)) or 0)
            free = info.get("free_memory")
            if free is not None:
                return int(free)
            return max(total - int(mx.get_active_memory()), 0) if total else None
    except (AttributeError, RuntimeError):
        pass
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


# ----- the plan ---------------------------------------------------------------------------------
def _dtype_name(value: Any, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, mx.Dtype):
        return str(value).replace("mlx.core.", "")
    name = str(value).replace("torch.", "")
    if name not in _BYTES:
        raise InvalidOptionError(f"dtype {value!r} is not one of float32, float16, bfloat16")
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(name, name)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _contiguous_rows(schedule: list[int], reserve_to: int = 0) -> tuple[int, int]:
    """(capacity rows, rows of the buffer replaced at the last growth) of a step-256 store;
    after the first append it reserves room for `reserve_to` rows (Model.prefill)."""
    cap = length = last_old = 0

    def grow(need: int) -> None:
        nonlocal cap, last_old
        if need > cap:
            last_old = length  # _reserve keeps keys[:length] alive while concatenating
            cap = _ceil(need, CONTIGUOUS_STEP) * CONTIGUOUS_STEP

    for i, n in enumerate(schedule):
        grow(length + n)
        length += n
        if i == 0:
            grow(reserve_to)
    return cap, last_old


def _paged_pages(
    schedule: list[int], page: int, max_pages: int | None, reserve_to: int = 0
) -> tuple[int, int]:
    """(capacity pages, pages before the last growth) of the pool: the pool's own growth rule
    (kv.pool.grown_capacity), stopping at its bound; after the first append it reserves
    room for `reserve_to` tokens (Model.prefill, PagePool.reserve)."""
    cap = length = last_old = 0
    for i, n in enumerate(schedule):
        length += n
        new = grown_capacity(cap, _ceil(length, page), max_pages)
        if i == 0 and reserve_to > length:
            reserved = grown_capacity(new, _ceil(reserve_to, page), None)
            new = reserved if max_pages is None else min(reserved, max_pages)
        if new > cap:
            last_old, cap = cap, new
    return cap, last_old


def _schedule(context: int, chunk: int, prompt: int | None) -> list[int]:
    """Appends a sequence sees: prefill chunks of the prompt, then one row per decode step."""
    prompt = context if prompt is None else min(prompt, context)
    out = [chunk] * (prompt // chunk)
    if prompt % chunk:
        out.append(prompt % chunk)
    out += [1] * (context - prompt)
    return out


def default_prefill_chunk() -> int:
    """Tokens per prefill chunk: $QWEN38_PREFILL_CHUNK, else 2048 on CUDA, 512 on another GPU
    and 128 on the CPU. On the CPU throughput is the same (measured on the demo) and a chunk
    is what a cancel waits for; on the H200 a chunk re-reads all weights, and 2048 prefilled
    27B dims ~2x faster at depth than 512 (benchmarks/results/h200/, README), for a walk
    scratch of SCORE_BLOCKS_LIVE x BLOCK_SCORE_BYTES of scores (kv/blocked.py). Metal
    machines share their RAM with the weights, so they keep 512."""
    env = os.environ.get("QWEN38_PREFILL_CHUNK", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise InvalidOptionError(f"QWEN38_PREFILL_CHUNK={env!r}: must be a positive integer")
        return int(env)
    if mx.default_device().type != mx.DeviceType.gpu:
        return 128
    return 2048 if mx.cuda.is_available() else 512


def memory_plan(config_or_model: Any, context: int, **options: Any) -> MemoryPlan:
    """Bytes per component for one sequence of `context` tokens (see the module docstring).

    config_or_model: an HF config dict, an engine Model, or a built network.
    Options: dtype (state/activation dtype), weights_dtype, kv_dtype, prefill_chunk (a Model's,
    else this device's default_prefill_chunk()),
    prompt_tokens (how many of the context are prefilled; default all), kv_paged,
    kv_page_tokens (32), kv_pool_tokens (resident KV rows; the rest spills to disk),
    mtp (default: on when the config has an MTP head), fused_attention (default: on GPU),
    release_lag (default: on CUDA; the prefill scratch times RELEASE_LAG; off there: a plan
    for a settled prefill, `plan.settled`),
    ranks (the model split over that many mx.distributed ranks: the plan is one rank's, with
    its share of the weights, KV heads and Gated DeltaNet heads; default: a loaded Model's
    world size, else 1).
    """
    prompt_tokens = options.pop("prompt_tokens", None)
    unknown = set(options) - PLAN_OPTIONS
    if unknown:
        raise InvalidOptionError(f"unknown memory plan option(s): {', '.join(sorted(unknown))}")
    if not isinstance(context, int) or context <= 0:
        raise InvalidOptionError(f"context must be a positive number of tokens, got {context!r}")
    what = _Subject.of(config_or_model, options)
    plan = MemoryPlan(family=what.family, context=context, dtype=what.dtype, ranks=what.ranks)
    add = plan.components.append

    weight_bytes, table_bytes = _weight_bytes(
        what.net, what.config, what.wdtype if what.built else None
    )
    add(
        Component(
            "weights",
            weight_bytes,
            "ram",
            "parameters" + (f" in {what.wdtype}" if what.built else ""),
        )
    )
    if table_bytes:
        add(Component("ngram_table", table_bytes, "mmap", "PLE n-gram table, memory-mapped"))

    dims = _Dims.of(what)
    plan.kv_token_bytes = dims.per_token
    chunk = int(
        options.get("prefill_chunk")
        or getattr(config_or_model, "prefill_chunk", None)  # a loaded Model's own
        or default_prefill_chunk()
    )
    schedule = _schedule(context, chunk, prompt_tokens)
    choice = choose_kv(**{k: options[k] for k in KV_OPTION_KEYS if k in options})
    plan.kv = choice
    available = None
    if choice.paged and choice.pool_pages() is None:
        # the factory's auto pool: the same rule on the memory available now (less the
        # weights when they are not loaded yet: a plan from a config)
        available = options.get("available")
        if available is None:
            available = available_memory()
        if available is not None and what.built:
            available = max(available - weight_bytes, 0)
    cfg = what.net.config
    plan.components += _kv_components(plan, dims, choice, schedule, available)
    plan.components += _state_components(cfg, dims, schedule, context, chunk, options)
    lag = options.get("release_lag")
    plan.lagged = settle.releases_late() if lag is None else bool(lag)
    plan.settled = settle.releases_late() and not plan.lagged
    add(_scratch(cfg, dims, context, chunk, options.get("fused_attention"), plan))
    return plan


@dataclass
class _Subject:
    """What a plan is for: the network (built lazily from a config when not given), its
    config and family, the dtypes and the ranks it is split over."""

    net: Any
    config: dict
    built: bool
    family: str
    dtype: str
    wdtype: str
    kvdtype: str
    ranks: int

    @classmethod
    def of(cls, config_or_model: Any, options: dict) -> _Subject:
        net = getattr(config_or_model, "net", None)
        model_dtype = getattr(config_or_model, "dtype", None)
        if isinstance(config_or_model, dict):
            config = config_or_model
        elif net is not None:
            config = dict(getattr(getattr(config_or_model, "weights", None), "config", {}) or {})
        else:
            net = config_or_model
            config = {}
        family = model_family(config) if config else _family_of(net)
        tc = text_config(config) if config else {}
        file_dtype = tc.get("dtype") or tc.get("torch_dtype") or config.get("torch_dtype")
        default = _dtype_name(model_dtype, "") if model_dtype is not None else None
        if not default:
            default = _dtype_name(file_dtype, "bfloat16") if file_dtype in _BYTES else "bfloat16"
        dtype = _dtype_name(options.get("dtype"), default)
        ranks = options.get("ranks") or getattr(config_or_model, "world_size", 1)
        if not isinstance(ranks, int) or ranks < 1:
            raise InvalidOptionError(f"ranks must be a positive number of ranks, got {ranks!r}")
        built = net is None
        if built:
            from .models import build_model

            net = build_model(config)  # lazy: parameters are not allocated until evaluated
            if ranks > 1:  # cut as load(group=) would; still lazy, and refused as it would be
                net.shard(RankShare(0, ranks))
        elif ranks != getattr(config_or_model, "world_size", 1):
            raise InvalidOptionError(
                f"ranks={ranks}: this model is loaded on "
                f"{getattr(config_or_model, 'world_size', 1)} rank(s); plan from its config"
            )
        return cls(
            net=net,
            config=config,
            built=built,
            family=family,
            dtype=dtype,
            wdtype=_dtype_name(options.get("weights_dtype"), dtype),
            kvdtype=_dtype_name(options.get("kv_dtype"), dtype),
            ranks=ranks,
        )


@dataclass
class _Dims:
    """One rank's layer inventory and per-token sizes (bytes)."""

    n_attn: int  # attention layers
    n_lin: int  # Gated DeltaNet layers
    hkv: int
    hd: int
    hq: int
    act: int  # bytes of an activation / state element
    kvb: int  # bytes of a KV element
    qsa: bool  # QSA selects (Flash-Next), not Quest
    ratio: int  # QSA's pooling ratio
    idx_dim: int  # QSA indexer key width
    indexer_budget: int  # QSA: tokens a step selects
    ranks: int

    @classmethod
    def of(cls, what: _Subject) -> _Dims:
        cfg = what.net.config
        n_layers = cfg.num_hidden_layers
        types = list(getattr(cfg, "layer_types", ["full_attention"] * n_layers))
        n_attn = sum(1 for t in types if t != "linear_attention")
        idx_dim = getattr(cfg, "indexer_head_dim", 0)
        ratio = getattr(cfg, "indexer_compress_ratio", 0)
        return cls(
            n_attn=n_attn,
            n_lin=n_layers - n_attn,
            hkv=cfg.num_key_value_heads // what.ranks,
            hd=cfg.head_dim,
            hq=cfg.num_attention_heads // what.ranks,
            act=_BYTES[what.dtype],
            kvb=_BYTES[what.kvdtype],
            qsa=bool(idx_dim and ratio and what.family == "qwen4_exp"),
            ratio=ratio,
            idx_dim=idx_dim,
            indexer_budget=getattr(cfg, "indexer_budget", 0),
            ranks=what.ranks,
        )

    @property
    def layer_token(self) -> int:
        """K+V of one token in one attention layer."""
        return self.hkv * self.hd * 2 * self.kvb

    @property
    def per_token(self) -> int:
        """K+V of one token over every attention layer."""
        return self.n_attn * self.layer_token


def _kv_components(
    plan: MemoryPlan, dims: _Dims, choice: KVChoice, schedule: list[int], available: int | None
) -> list[Component]:
    """kv, kv_growth, and with a paged store kv_spill (a pool smaller than the context) and
    quest_meta; sets the plan's pool, selection and spill directory."""
    context, per_token = plan.context, dims.per_token
    spill_pages = 0
    if choice.paged:
        P = choice.page_tokens
        max_pages = choice.pool_pages()
        if max_pages is not None:
            pool_how = f"pool kv_pool_tokens={choice.pool_tokens:,}"
        else:
            tokens = auto_pool_tokens(available, per_token)
            if tokens is not None:
                max_pages = max(_ceil(tokens, P), AUTO_MIN_PAGES)
            pool_how = (
                "auto pool, unbounded (available memory unknown)"
                if tokens is None
                else f"auto pool {max_pages * P:,} tokens of {available:,} B available"
            )
        pages, old_pages = _paged_pages(schedule, P, max_pages, context)
        rows, old_rows = pages * P, old_pages * P
        plan.pool_pages = max_pages
        how = f"paged, {P}-token pages, {pages} slots per layer; {pool_how}"
        total_pages = _ceil(context, P)
        if max_pages is not None and total_pages > max_pages:
            spill_pages = context // P  # every sealed page may be written once
        plan.selection_pages = _selection_pages(plan, dims, choice, total_pages)
    else:
        rows, old_rows = _contiguous_rows(schedule, context)
        how = f"contiguous, {rows} rows (steps of {CONTIGUOUS_STEP})"
    out = [
        Component(
            "kv",
            rows * per_token,
            "ram",
            f"{dims.n_attn} attention layers x {dims.hkv} kv heads x {dims.hd} x 2 (K,V) x "
            f"{dims.kvb} B = {per_token:,} B/token; {how}",
        ),
        Component(
            "kv_growth", old_rows * per_token, "ram", "old buffer alive during the last growth"
        ),
    ]
    if spill_pages:
        plan.spill_dir = choice.spill_dir or spill_root()
        out.append(
            Component(
                "kv_spill",
                spill_pages * choice.page_tokens * per_token,
                "disk",
                f"up to {spill_pages:,} sealed pages x {dims.n_attn} layers x "
                f"{choice.page_tokens * dims.layer_token:,} B in {plan.spill_dir}",
            )
        )
    if choice.paged and not dims.qsa:
        sealed = context // choice.page_tokens
        out.append(
            Component(
                "quest_meta",
                sealed * dims.n_attn * dims.hkv * dims.hd * 2 * META_DTYPE.size,
                "ram",
                f"{sealed} sealed pages x {dims.n_attn} layers x {dims.hkv} heads x {dims.hd} x "
                f"(min,max) {META_DTYPE}",
            )
        )
    return out


def _selection_pages(plan: MemoryPlan, dims: _Dims, choice: KVChoice, total_pages: int) -> int:
    """Pages a sparse decode step needs resident at once (0: it reads every page). Quest:
    forced pages plus the top-k, one set shared by the KV heads (PagedKV(shared=False) would
    need each head's own); QSA: the indexer's blocks lie in whole pages, so at most one page
    per selected block plus the tail's, and the open page is written beside them."""
    P = choice.page_tokens
    if dims.qsa:
        n_blocks = dims.indexer_budget // dims.ratio
        return min(total_pages, n_blocks + 2) if plan.context // dims.ratio > n_blocks else 0
    budget, sinks, recent = (_ceil(n, P) for n in (choice.budget, choice.sinks, choice.recent))
    sparse_from = 4 * budget * P if choice.mode == "auto" else 0
    if plan.context < sparse_from:
        return 0
    _, n_forced = forced_pages(total_pages, sinks, recent)
    n_sel = min(total_pages, max(budget, n_forced))
    return n_sel if n_sel < total_pages else 0


def _state_components(
    cfg: Any, dims: _Dims, schedule: list[int], context: int, chunk: int, options: dict
) -> list[Component]:
    """recurrent (Gated DeltaNet), indexer + indexer_growth + qsa_scratch (QSA), ple_state,
    mtp_reserve: what a sequence holds besides its KV."""
    out = []
    act = dims.act
    if dims.n_lin:
        hv, dk, dv = _linear_dims(cfg, dims.ranks)
        conv_dim = _conv_dim(cfg, dims.ranks)
        k = cfg.linear_conv_kernel_dim
        rec = dims.n_lin * hv * dk * dv * 4
        conv = dims.n_lin * (k - 1) * conv_dim * act
        out.append(
            Component(
                "recurrent",
                rec + conv,
                "ram",
                f"{dims.n_lin} Gated DeltaNet layers x {hv} heads x {dk} x {dv} fp32 = {rec:,} B "
                f"+ conv {dims.n_lin} x {k - 1} x {conv_dim} x {act} B = {conv:,} B",
            )
        )
    raw_rows = pooled_rows = 0
    if dims.qsa:
        idx_dim, n_attn = dims.idx_dim, dims.n_attn
        raw_rows, raw_old = _contiguous_rows(schedule, context)
        blocks = _block_schedule(schedule, dims.ratio)
        pooled_rows, pooled_old = _contiguous_rows(blocks, context // dims.ratio)
        raw = n_attn * raw_rows * idx_dim * act
        pooled = n_attn * pooled_rows * idx_dim * act
        growth = max(raw_old, pooled_old) * idx_dim * act  # one layer's buffer at a time
        out.append(
            Component(
                "indexer",
                raw + pooled,
                "ram",
                f"raw keys {n_attn} x {raw_rows} x {idx_dim} x {act} B = {raw:,} B; pooled "
                f"{n_attn} x {pooled_rows} x {idx_dim} x {act} B = {pooled:,} B",
            )
        )
        out.append(
            Component("indexer_growth", growth, "ram", "old key buffer alive during a growth")
        )
        out.append(_qsa_scratch(cfg, context, min(chunk, context), act, dims.kvb))
    ple_ids = getattr(cfg, "ple_layer_ids", ())
    if ple_ids:
        width = cfg.hc_count * cfg.hidden_size
        conv_len = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
        ple = len(ple_ids) * (conv_len * width * 4 + (cfg.ngram_size - 1) * 8)
        out.append(Component("ple_state", ple, "ram", f"{conv_len} conv rows x {width} fp32 + ids"))
    n_mtp = int(getattr(cfg, "mtp_num_hidden_layers", 0) or 0)
    mtp_on = options.get("mtp")
    mtp_on = n_mtp > 0 if mtp_on is None else bool(mtp_on) and n_mtp > 0
    if mtp_on:
        # its own contiguous KV; the head is whole on every rank
        mtp_kv = n_mtp * dims.layer_token * dims.ranks * _contiguous_rows(schedule)[0]
        mtp_idx = n_mtp * (raw_rows + pooled_rows) * dims.idx_dim * act if dims.qsa else 0
        out.append(
            Component("mtp_reserve", mtp_kv + mtp_idx, "ram", f"{n_mtp} MTP layer(s): own KV")
        )
    return out


def _scratch(
    cfg: Any, dims: _Dims, context: int, chunk: int, fused: bool | None, plan: MemoryPlan
) -> Component:
    """One prefill chunk's widest activations, its attention scores and the logits; for a
    `plan.lagged` plan RELEASE_LAG times the activations and scores."""
    if fused is None:
        fused = mx.default_device() != mx.cpu
    t = min(chunk, context)
    hq, hd = dims.hq, dims.hd
    widths = [
        cfg.hidden_size * getattr(cfg, "hc_count", 1),
        2 * getattr(cfg, "intermediate_size", 0),
        hq * hd * 2,
    ]
    if dims.n_lin:
        hv, _, dv = _linear_dims(cfg, dims.ranks)
        widths.append(_conv_dim(cfg, dims.ranks) + 2 * hv * dv)
    if getattr(cfg, "num_experts", 0):
        widths.append(2 * cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    activ = t * (cfg.hidden_size + max(widths)) * 4 * 2  # input and output of the widest op
    if dims.n_lin:  # a Gated DeltaNet block's chunked form holds more (models/gated_delta.py)
        hv, _, dv = _linear_dims(cfg, dims.ranks)
        activ = max(activ, t * PREFILL_ROWS_LIVE * hv * dv * 4)
    # QSA layers attend densely only while the context is within the budget (+ a tail)
    attn_ctx = min(context, dims.indexer_budget + dims.ratio + t) if dims.qsa else context
    one_shot = 0 if fused else min(t * hq * attn_ctx * 4, ONE_SHOT_BYTES)
    if attn_ctx - t <= BLOCK_TOKENS or t * hq * attn_ctx * 4 <= ONE_SHOT_BYTES:
        one_shot = 0 if fused else t * hq * attn_ctx * 4
        walk = 0
    else:  # the blocked walk (every backend: its scores are plain ops)
        walk = SCORE_BLOCKS_LIVE * t * hq * walk_block(hq, t) * 4
    scores = max(one_shot, walk)
    how_scores = "blocked walk" if walk else "fused" if fused else "one-shot"
    logits = cfg.vocab_size * 4
    factor = RELEASE_LAG if plan.lagged else 1.0
    held = int(factor * (activ + scores))
    lagging = f", x{factor} for buffers released late (CUDA)" if plan.lagged else ""
    if plan.settled:
        lagging = ", a settled prefill (each layer released before the next)"
    return Component(
        "scratch",
        held + logits,
        "ram",
        f"{t}-token chunk activations {activ:,} B + attention scores {scores:,} B "
        f"({how_scores}){lagging} + logits {logits:,} B",
    )


def _linear_dims(cfg: Any, ranks: int) -> tuple[int, int, int]:
    """(value heads on one rank, key dim, value dim) of a Gated DeltaNet layer."""
    hv = cfg.linear_num_value_heads // ranks
    return hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim


def _conv_dim(cfg: Any, ranks: int) -> int:
    """Channels of a Gated DeltaNet layer's conv on one rank (q, k and v)."""
    hv, dk, dv = _linear_dims(cfg, ranks)
    return 2 * (cfg.linear_num_key_heads // ranks) * dk + hv * dv


class RankShare:
    """What `shard` asks of a group (rank and size), for planning one rank's share."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _block_schedule(schedule: list[int], ratio: int) -> list[int]:
    """Pooled blocks each append of `schedule` completes (the pooled buffer's appends)."""
    out, length = [], 0
    for n in schedule:
        done = (length + n) // ratio - length // ratio
        length += n
        if done:
            out.append(done)
    return out


def _qsa_scratch(cfg: Any, context: int, chunk: int, act: int, kvb: int) -> Component:
    """The larger of a decode step's and a prefill query group's QSA selection scratch."""
    from .models.qsa import group_queries, query_bytes

    ratio = cfg.indexer_compress_ratio
    n_blocks = cfg.indexer_budget // ratio
    blocks = context // ratio
    if blocks <= n_blocks:
        return Component("qsa_scratch", 0, "ram", "dense: the context is within the budget")
    width = n_blocks * ratio + ratio - 1
    per_query = query_bytes(
        cfg.num_key_value_heads, cfg.head_dim, width, cfg.indexer_n_heads, blocks, kvb
    )
    group = group_queries(chunk, per_query)
    # the group's output rows [Hq, G, D] in the activation dtype sit beside its scratch
    out_rows = group * cfg.num_attention_heads * cfg.head_dim * act
    return Component(
        "qsa_scratch",
        group * per_query + out_rows,
        "ram",
        f"{group} queries x {per_query:,} B (K/V of {width} gathered rows, "
        f"{cfg.indexer_n_heads} + selection rows of {blocks:,} block scores fp32) + output "
        f"{out_rows:,} B",
    )


def _family_of(net: Any) -> str:
    name = type(net).__name__.lower()
    return "qwen4_exp" if "qwen4" in name else "qwen3_5" if "qwen35" in name else "dense"


def _weight_bytes(net: Any, config: dict, dtype: str | None) -> tuple[int, int]:
    """(resident parameter bytes, memory-mapped n-gram table bytes)."""
    from mlx.utils import tree_flatten

    if dtype is not None:
        quant = text_config(config).get("quantization") or config.get("quantization")
        if isinstance(quant, dict) and "bits" in quant:
            import mlx.nn as nn

            gs, bits = int(quant.get("group_size", 64)), int(quant["bits"])

            def predicate(_path: str, module: Any) -> bool:
                w = getattr(module, "weight", None)
                return hasattr(module, "to_quantized") and w is not None and w.shape[-1] % gs == 0

            nn.quantize(net, group_size=gs, bits=bits, class_predicate=predicate)
    total = 0
    for _, p in tree_flatten(net.parameters()):
        if dtype is not None and p.dtype in (mx.float32, mx.float16, mx.bfloat16):
            total += p.size * _BYTES[dtype]
        else:
            total += p.nbytes
    table = 0
    for _, module in net.named_modules():
        emb = getattr(module, "ple_embedding", None)
        if emb is None:
            continue
        attached = getattr(emb, "table", None)
        if attached is not None and getattr(attached, "shards", None):
            table += sum(int(getattr(s, "nbytes", 0)) for s in attached.shards)
        else:
            table += int(emb.padded_rows) * int(emb.head_dim) * _BYTES[dtype or "bfloat16"]
    return total, table


# ----- admission and printing -------------------------------------------------------------------
def free_disk(directory: Path) -> int | None:
    """Free bytes on the file system that holds `directory` (or its nearest parent)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def prepare_spill_dir(plan: MemoryPlan) -> None:
    """Create the spill directory of a plan that spills (a run is about to write there), so
    one that cannot be made is refused by name before any work, and `admit` measures the free
    space of its own disk. Not for plans that only inform (`qwen38 info`): it writes."""
    if not plan.disk or plan.spill_dir is None:
        return
    try:
        plan.spill_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AdmissionError(
            f"kv_spill_dir {plan.spill_dir}: cannot be created ({e.strerror or e}); a "
            f"{plan.context:,}-token context with this KV pool spills up to {plan.disk:,} "
            "bytes there"
        ) from None
    if not os.access(plan.spill_dir, os.W_OK | os.X_OK):
        raise AdmissionError(f"kv_spill_dir {plan.spill_dir}: is not writable by this user")


def admit(
    plan: MemoryPlan,
    available: int | None = None,
    include_weights: bool = True,
    disk_available: int | None = None,
    disk_held: int = 0,
) -> None:
    """Raise AdmissionError when the plan cannot run: resident bytes over `available`
    (default: what the OS reports), the spill file over the free space of its directory
    (default: measured, plus `disk_held`: what the run's own live state already holds
    there, reused or freed before it spills), or a KV pool smaller than one sparse decode
    step's selection."""
    if plan.pool_pages is not None and plan.selection_pages > plan.pool_pages:
        P = plan.page_tokens
        raise AdmissionError(
            f"a KV pool of {plan.pool_pages} pages ({plan.pool_pages * P:,} tokens) per "
            f"layer is smaller than what a sparse decode step may need resident at once: "
            f"{plan.selection_pages} pages (the selected pages, the sinks and the recent "
            f"window); use kv_pool_tokens >= {plan.selection_pages * P:,} or a "
            "smaller kv_topk"
        )
    if plan.disk:
        free = disk_available
        if free is None and plan.spill_dir is not None:
            free = free_disk(plan.spill_dir)
            free = None if free is None else free + disk_held
        if free is not None and plan.disk > free:
            raise AdmissionError(
                f"a {plan.context:,}-token context spills up to {plan.disk:,} bytes of KV to "
                f"{plan.spill_dir}, which has {free:,} free, short by {plan.disk - free:,} "
                "bytes; free disk space, set kv_spill_dir to a larger disk, or raise "
                "kv_pool_tokens"
            )
    if available is None:
        available = available_memory()
        if available is None:
            return
    need = plan.required(include_weights)
    if need > available:
        biggest = sorted(
            (
                c
                for c in plan.components
                if c.where == "ram" and (include_weights or c.name != "weights")
            ),
            key=lambda c: -c.nbytes,
        )[:3]
        parts = ", ".join(f"{c.name} {c.nbytes:,}" for c in biggest)
        raise AdmissionError(
            f"a {plan.context:,}-token context needs {need:,} bytes, has {available:,}, short by "
            f"{need - available:,} bytes (largest: {parts}); {_pool_advice(plan, need, available)}"
        )


def settled_if_tight(
    plan: MemoryPlan,
    available: int | None,
    replan: Callable[..., MemoryPlan],
    include_weights: bool = True,
) -> MemoryPlan:
    """`plan`, or where its lagged prefill scratch (RELEASE_LAG) does not fit `available`,
    `replan(release_lag=False)`: the plan of a settled prefill (settle.py: one layer's
    scratch at a time, slower), which `admit` then accepts or refuses with its own shortfall."""
    if available is None or not plan.lagged or plan.required(include_weights) <= available:
        return plan
    return replan(release_lag=False)


def _pool_advice(plan: MemoryPlan, need: int, available: int) -> str:
    """What to change: for a paged plan, a kv_pool_tokens that fits (the pool and the buffer
    its last growth replaces take at most 5/3 of the pool: kv.pool.grown_capacity, so this
    pool fits whatever the growth steps), else the general options."""
    general = "use a shorter context, a smaller KV pool (kv_pool_tokens, with kv_paged) or a "
    general += "smaller model"
    if plan.kv is None or not plan.kv.paged or not plan.kv_token_bytes:
        return general
    P = plan.page_tokens
    rest = need - plan["kv"] - plan["kv_growth"]
    pages = max(available - rest, 0) * 3 // 5 // (plan.kv_token_bytes * P)
    if pages < max(plan.selection_pages, 1):
        return "no KV pool fits beside the rest of the plan; " + general
    return f"kv_pool_tokens={pages * P:,} fits (the rest of the KV spills to disk), or " + general


def plan_verdict(plan: MemoryPlan, available: int | None = None) -> str:
    """ "fits", or why not (the refusal `admit` would raise), weights included."""
    try:
        admit(plan, available)
    except AdmissionError as e:
        return f"does not fit: {e}"
    return "fits"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def format_plan(
    plan: MemoryPlan, available: int | None = None, disk_available: int | None = None
) -> str:
    """The plan as a table: every component in bytes (and human units), then the totals,
    and when `available` / the spill directory's free space are known, whether it fits."""
    lines = [f"memory plan: {plan.family}, {plan.context:,} tokens, {plan.dtype}"]
    if plan.ranks > 1:
        lines[0] += f", per rank of {plan.ranks} (each rank needs this much)"
    width = max(len(c.name) for c in plan.components)
    for c in plan.components:
        lines.append(
            f"  {c.name:<{width}}  {c.nbytes:>18,} bytes  {_human(c.nbytes):>10}  {c.where:<4}  "
            f"{c.detail}"
        )
    lines.append(f"  {'total RAM':<{width}}  {plan.ram:>18,} bytes  {_human(plan.ram):>10}")
    if available is not None:
        verdict = "fits" if plan.ram <= available else f"short by {plan.ram - available:,} bytes"
        lines.append(
            f"  {'available':<{width}}  {available:>18,} bytes  {_human(available):>10}  {verdict}"
        )
    if plan.disk:
        lines.append(f"  {'total disk':<{width}}  {plan.disk:>18,} bytes  {_human(plan.disk):>10}")
        free = disk_available
        if free is None and plan.spill_dir is not None:
            free = free_disk(plan.spill_dir)
        if free is not None:
            verdict = "fits" if plan.disk <= free else f"short by {plan.disk - free:,} bytes"
            lines.append(
                f"  {'free disk':<{width}}  {free:>18,} bytes  {_human(free):>10}  {verdict}  "
                f"({plan.spill_dir})"
            )
    if plan.pool_pages is not None and plan.selection_pages > plan.pool_pages:
        lines.append(
            f"  the KV pool ({plan.pool_pages} pages per layer) is below a sparse decode "
            f"step's selection ({plan.selection_pages} pages): refused"
        )
    return "\n".join(lines)


def kv_bytes_per_token(config_or_model: Any, dtype: str = "bfloat16") -> int:
    """K+V bytes one token adds across the attention layers."""
    plan = memory_plan(config_or_model, CONTIGUOUS_STEP, dtype=dtype, mtp=False)
    return plan["kv"] // CONTIGUOUS_STEP


__all__ = [
    "Component",
    "MemoryPlan",
    "admit",
    "available_memory",
    "format_plan",
    "kv_bytes_per_token",
    "memory_plan",
    "plan_verdict",
]
