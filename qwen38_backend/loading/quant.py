"""MLX affine quantization: which modules are quantized, with which (group_size, bits)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from ..errors import ConfigError, WeightsError

_PREFIXES = ("", "model.", "language_model.", "model.language_model.", "language_model.model.")


def quant_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The MLX affine quantization block of a config.json, or None when not quantized.

    Accepts `quantization` (mlx-lm) or `quantization_config` with `group_size` and `bits`;
    a `quantization_config` of another method (fp8, awq, ...) without those keys is ignored.
    """
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if q is None:
            continue
        if not isinstance(q, dict):
            raise ConfigError(f"config.json: {key!r} must be an object, found {q!r}")
        if "group_size" not in q and "bits" not in q:
            continue
        mode = q.get("mode", "affine")
        if mode != "affine":
            raise ConfigError(f"config.json: {key}.mode {mode!r} is not supported (only affine)")
        _check_pair(q, key)
        return q
    return None


def _check_pair(q: Mapping[str, Any], where: str) -> tuple[int, int]:
    try:
        gs, bits = int(q["group_size"]), int(q["bits"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"config.json: {where} needs integer group_size and bits: {q!r}") from e
    if bits not in (2, 3, 4, 5, 6, 8) or gs <= 0:
        raise ConfigError(f"config.json: {where}: unsupported group_size={gs} bits={bits}")
    return gs, bits


def _override(q: Mapping[str, Any], module: str) -> Any:
    """Per-module entry keyed by module path (tolerating model./language_model. prefixes)."""
    bare = module
    for p in sorted(_PREFIXES, key=len, reverse=True):
        if p and module.startswith(p):
            bare = module[len(p) :]
            break
    for p in _PREFIXES:
        if p + bare in q:
            return q[p + bare]
    return None


def infer_bits(weight: mx.array, scales: mx.array, group_size: int) -> int:
    """Bits per element implied by packed-weight and scales shapes."""
    in_features = scales.shape[-1] * group_size
    return weight.shape[-1] * 32 // in_features if in_features else 0


def check_shapes(module: str, weight: mx.array, scales: mx.array, group_size: int, bits: int):
    """Raise WeightsError unless weight cols * 32 / bits == scales cols * group_size."""
    if weight.dtype != mx.uint32:
        raise WeightsError(
            f"{module}.weight: quantized weight must be uint32, found {weight.dtype}"
        )
    if weight.shape[:-1] != scales.shape[:-1] or (
        weight.shape[-1] * 32 != scales.shape[-1] * group_size * bits
    ):
        raise WeightsError(
            f"{module}: quantization mismatch: weight {tuple(weight.shape)} and scales "
            f"{tuple(scales.shape)} do not fit group_size={group_size} bits={bits} "
            f"(expected weight cols * 32 / bits == scales cols * group_size)"
        )


def collect(
    weights: Mapping[str, mx.array], config: Mapping[str, Any]
) -> dict[str, tuple[int, int]]:
    """Map every module with `.scales` to its (group_size, bits), checked against shapes."""
    modules = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    if not modules:
        return {}
    q = quant_config(config)
    if q is None:
        raise WeightsError(
            f"{len(modules)} modules have .scales tensors (e.g. {modules[0]!r}) but config.json "
            "has no 'quantization' {group_size, bits} block"
        )
    default = _check_pair(q, "quantization")
    result: dict[str, tuple[int, int]] = {}
    for m in modules:
        gs, bits = _module_pair(q, m, default)
        w, s = weights.get(m + ".weight"), weights[m + ".scales"]
        if w is None:
            raise WeightsError(f"{m}: has .scales but no .weight tensor")
        if m + ".biases" not in weights:
            raise WeightsError(f"{m}: affine-quantized module has .scales but no .biases tensor")
        check_shapes(m, w, s, gs, bits)
        result[m] = (gs, bits)
    return result


def _module_pair(q: Mapping[str, Any], module: str, default: tuple[int, int]) -> tuple[int, int]:
    entry = _override(q, module)
    if entry is None or entry is True:
        return default
    if entry is False:
        raise WeightsError(
            f"{module}: config.json marks it unquantized (false) but it has a .scales tensor"
        )
    if isinstance(entry, dict):
        gs, bits = default
        return _check_pair({"group_size": gs, "bits": bits, **entry}, module)
    raise ConfigError(f"config.json: quantization entry for {module!r} is invalid: {entry!r}")
