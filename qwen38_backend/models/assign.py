"""Assign read weights to a built module: sanitize names, check shapes, quantize, cast."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import WeightsError

# Tensors weights may carry that no module owns (the vision tower, rotary caches).
_FLOAT_TYPES = (mx.float32, mx.float16, mx.bfloat16)


def default_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """fp32 on CPU (MLX's x86 half kernels are slow); the weights' float dtype on GPU."""
    if mx.default_device() == mx.cpu:
        return mx.float32
    for w in weights.values():
        if w.dtype in (mx.bfloat16, mx.float16):
            return w.dtype
    return mx.float32


def parse_dtype(dtype: str | mx.Dtype | None, weights: dict[str, mx.array]) -> mx.Dtype:
    if dtype is None:
        return default_dtype(weights)
    if isinstance(dtype, mx.Dtype):
        return dtype
    names = {
        "float32": mx.float32,
        "fp32": mx.float32,
        "float16": mx.float16,
        "fp16": mx.float16,
        "bfloat16": mx.bfloat16,
        "bf16": mx.bfloat16,
    }
    if dtype not in names:
        from ..errors import InvalidOptionError

        raise InvalidOptionError(f"dtype {dtype!r} is not one of {', '.join(names)}")
    return names[dtype]


def should_dequantize(weights: dict[str, mx.array], quantization: dict, dtype: mx.Dtype) -> bool:
    """On CPU, MLX's x86 quantized matmul is ~100x slower than a BLAS gemv over the same
    weights dequantized, so dequantize there when the result fits easily in RAM (< 1/4)."""
    if not quantization or mx.default_device() != mx.cpu:
        return False
    expanded = sum(
        w.size * (32 // quantization[n[: -len(".weight")]][1]) * dtype.size
        if n.endswith(".weight") and n[: -len(".weight")] in quantization
        else w.nbytes
        for n, w in weights.items()
    )
    return expanded < physical_memory() // 4


def physical_memory() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def dequantize_all(
    weights: dict[str, mx.array],
    quantization: dict[str, tuple[int, int]],
    dtype: mx.Dtype,
    bare: frozenset[str] = frozenset(),
) -> dict[str, mx.array]:
    """Replace every (weight, scales, biases) triplet by its dequantized float weight.

    bare: the quantized names that are a parameter themselves (fused experts' `gate_up_proj`),
    whose float tensor takes the name without `.weight`."""
    out = dict(weights)
    for module, (group_size, bits) in quantization.items():
        packed = out.pop(f"{module}.weight")
        scales = out.pop(f"{module}.scales").astype(dtype)
        biases = out.pop(f"{module}.biases").astype(dtype)
        name = module if module in bare else f"{module}.weight"
        out[name] = mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits).astype(
            dtype
        )
    return out


def quantized_owners(
    net: nn.Module, quantization: dict[str, tuple[int, int]]
) -> dict[str, tuple[str, bool]]:
    """Each quantized name as the weights spell it -> (the path of the module in `net` that
    `nn.quantize` must convert, whether the name is a parameter of that module).

    The weights' names go through the family's `canonical_names` first (a multimodal
    `model.language_model.` prefix); a fused expert stack (`mlp.experts.gate_up_proj` with
    weight / scales / biases) is a parameter of its experts module, not a module."""
    canonical = getattr(net, "canonical_names", None)
    modules = dict(net.named_modules())
    owners = {}
    for name in quantization:
        renamed = canonical({f"{name}.weight": None}) if canonical else {f"{name}.weight": None}
        if not renamed:  # a tied lm_head the family drops
            continue
        path = next(iter(renamed))[: -len(".weight")]
        parent, _, leaf = path.rpartition(".")
        if path not in modules and parent in modules and leaf in modules[parent]:
            owners[name] = (parent, True)
        else:
            owners[name] = (path, False)
    return owners


def assign_weights(
    net: nn.Module,
    weights: dict[str, mx.array],
    quantization: dict[str, tuple[int, int]],
    dtype: mx.Dtype,
    dequantize: bool | None = None,
    group: mx.distributed.Group | None = None,
) -> None:
    """Sanitize names, check them and their shapes against the module, quantize the named
    modules, cast, assign.

    Consumes `weights` (the dict is emptied): each tensor is cast and evaluated on its own and
    its source dropped, so peak memory stays near the loaded model's size, not source + copy.
    dequantize: None picks `should_dequantize` (CPU and small enough); True / False force it.
    group: split the model over these ranks (`net.shard`) while the tensors are still lazy,
    so a rank reads each tensor once and keeps only its part.
    """
    if dequantize is None:
        dequantize = should_dequantize(weights, quantization, dtype)
    sharded = group is not None and group.size() > 1
    source = weights
    owners = quantized_owners(net, quantization)
    if dequantize and quantization:
        bare = frozenset(n for n, (_, param) in owners.items() if param)
        weights, quantization = dequantize_all(weights, quantization, dtype, bare), {}
    weights = net.sanitize(dict(weights))
    if quantization:
        _quantize(net, _by_module(owners, quantization))
    expected = dict(tree_flatten(net.parameters()))
    _check(expected, weights)
    source.clear()
    loaded = []
    for name in list(weights):
        w = weights.pop(name)
        if w.dtype in _FLOAT_TYPES and w.dtype != dtype:
            w = w.astype(dtype)
        if sharded is False:
            mx.eval(w)
        loaded.append((name, w))
    net.update(tree_unflatten(loaded))
    if sharded:
        net.shard(group)
        for _, p in tree_flatten(net.parameters()):
            mx.eval(p)  # one tensor at a time: its whole source is freed after the cut


def _by_module(
    owners: dict[str, tuple[str, bool]], quantization: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    """(group_size, bits) per module path; a module's quantized parameters must agree."""
    out: dict[str, tuple[int, int]] = {}
    for name, (path, _) in owners.items():
        spec = quantization[name]
        if out.setdefault(path, spec) != spec:
            raise WeightsError(
                f"{path}: its quantized tensors disagree on (group_size, bits): "
                f"{out[path]} and {spec} ({name})"
            )
    return out


def _quantize(net: nn.Module, quantization: dict[str, tuple[int, int]]) -> None:
    def predicate(path: str, module: nn.Module):
        spec = quantization.get(path)
        if spec is None or not hasattr(module, "to_quantized"):
            return False
        return {"group_size": spec[0], "bits": spec[1]}

    nn.quantize(net, class_predicate=predicate)


def _check(expected: dict[str, mx.array], found: dict[str, mx.array]) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [
        f"{n}: expected {tuple(expected[n].shape)}, found {tuple(found[n].shape)}"
        for n in sorted(set(expected) & set(found))
        if tuple(expected[n].shape) != tuple(found[n].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_short(unexpected)}")
    if wrong:
        problems.append(f"mis-shaped tensors ({len(wrong)}): {_short(wrong)}")
    if problems:
        raise WeightsError("the weights do not match the model: " + "; ".join(problems))


def _short(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
