"""What `qwen38 info` reports about a model, read from its weights without computing."""

from __future__ import annotations

from .config import model_family, text_config


def weights_summary(weights) -> dict:
    """Architecture, logical parameter count, stored bytes, dtypes and context of read weights."""
    params = 0
    stored = 0
    dtypes: dict[str, int] = {}
    for name, w in weights.tensors.items():
        stored += w.nbytes
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and module in weights.quantization:
            continue
        if name.endswith(".weight") and module in weights.quantization:
            bits = weights.quantization[module][1]
            params += w.size * 32 // bits
            dtypes[f"q{bits}"] = dtypes.get(f"q{bits}", 0) + 1
        else:
            params += w.size
            dtypes[str(w.dtype).split(".")[-1]] = dtypes.get(str(w.dtype).split(".")[-1], 0) + 1
    cfg = text_config(weights.config)
    return {
        "architecture": cfg.get("model_type", weights.config.get("model_type")),
        "family": model_family(weights.config),
        "format": weights.format,
        "parameters": params,
        "bytes": stored,
        "dtypes": dtypes,
        "context": cfg.get("max_position_embeddings"),
        "layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "source": str(weights.source),
    }


def describe(name_or_path: str, context: int | None = None, ranks: int = 1, **kv_options) -> str:
    """What `qwen38 info` prints; with `context`, the memory plan for that many tokens with
    the KV options given (default: the contiguous store) and, when none are given, the
    paged store with the SSD tier beside it: pool, spill and whether each fits. `ranks`: the
    plan of one rank of the model split over that many (`load(group=)`)."""
    from .loading import read_weights
    from .loading.registry import resolve

    weights = read_weights(resolve(name_or_path))
    s = weights_summary(weights)
    lines = [
        f"model         {name_or_path}",
        f"source        {s['source']} ({s['format']})",
        f"architecture  {s['architecture']} ({s['family']} family), {s['layers']} layers, "
        f"hidden {s['hidden_size']}, vocab {s['vocab_size']}",
        f"parameters    {s['parameters']:,}",
        f"stored bytes  {s['bytes']:,}",
        "dtypes        " + ", ".join(f"{k} x{v}" for k, v in sorted(s["dtypes"].items())),
        f"context       {s['context']:,} tokens" if s["context"] else "context       unknown",
    ]
    if context is not None:
        import mlx.core as mx

        from .admission import (
            available_memory,
            format_plan,
            memory_plan,
            plan_verdict,
            settled_if_tight,
        )

        # as load() would run it: fp32 on CPU (quantized weights dequantized there)
        on_cpu = mx.default_device() == mx.cpu
        opts = {"dtype": "float32", "weights_dtype": "float32"} if on_cpu else {}
        available = available_memory()
        opts["ranks"] = ranks
        plan = memory_plan(weights.config, context, available=available, **opts, **kv_options)
        plan = settled_if_tight(
            plan,
            available,
            lambda **o: memory_plan(
                weights.config, context, available=available, **opts, **kv_options, **o
            ),
        )
        lines += ["", format_plan(plan, available), f"  verdict: {plan_verdict(plan, available)}"]
        window = s["context"]
        if window and context > window:  # the plan stands, but no request gets that long
            lines.append(
                f"  window: {context:,} tokens is over this model's {window:,}-token window by "
                f"{context - window:,}; a request that long is refused"
            )
        if not kv_options:
            tier = memory_plan(weights.config, context, available=available, kv_paged="on", **opts)
            lines += ["", *_tier_summary(tier, available)]
    return "\n".join(lines)


def _tier_summary(plan, available: int | None) -> list[str]:
    """The paged store with an auto pool and the SSD tier, in a few lines."""
    from .admission import _human, free_disk, plan_verdict

    P = plan.page_tokens
    pool = "unbounded" if plan.pool_pages is None else f"at most {plan.pool_pages * P:,} tokens"
    resident = f"{plan['kv']:,} bytes ({_human(plan['kv'])})"
    out = [
        "with the SSD tier (kv_paged=on, auto pool; set kv_pool_tokens / kv_spill_dir):",
        f"  pool   {pool} per layer; {resident} resident at {plan.context:,} tokens",
    ]
    if plan.disk:
        free = free_disk(plan.spill_dir)
        where = f"{plan.spill_dir}, {free:,} bytes free" if free is not None else plan.spill_dir
        out.append(f"  spill  up to {plan.disk:,} bytes ({_human(plan.disk)}) in {where}")
    else:
        out.append("  spill  none (the context fits the pool)")
    out.append(f"  RAM    {plan.ram:,} bytes in all; verdict: {plan_verdict(plan, available)}")
    return out
