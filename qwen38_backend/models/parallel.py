"""Tensor and expert parallelism over `mx.distributed`: how a loaded module's weights are cut
between the ranks of a group.

Column-parallel projections (q/k/v, gate/up, the Gated DeltaNet input projections) keep their
`nn.Linear` type with their output rows cut, so `fuse()` still joins them afterwards; the
row-parallel projection that closes a block (o_proj, down_proj, out_proj) becomes MLX's
`ShardedToAllLinear`, whose input columns are cut and whose output is summed over the group.
Everything else (embedding, LM head, norms, routers, hyper-connections, PLE, indexer, the MTP
head) stays whole on every rank, so every rank computes the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear

from ..errors import ShardingError

Group = mx.distributed.Group


def ranks(group: Group | None) -> tuple[int, int]:
    """(rank, size) of `group`; (0, 1) without one."""
    return (0, 1) if group is None else (group.rank(), group.size())


def require_divisible(what: str, count: int, size: int) -> None:
    """Refuse a split that would give ranks unequal shares."""
    if count % size:
        raise ShardingError(
            f"{what} ({count}) cannot be split evenly over {size} ranks: use a world size that "
            f"divides {count}"
        )


def part_of(w: mx.array, axis: int, group: Group, cuts: Sequence[int] = ()) -> mx.array:
    """This rank's part of `w` along `axis`. `cuts` split a fused tensor into segments first
    (e.g. q | k | v), each segment cut evenly, so a rank keeps its heads of every segment."""
    rank, size = ranks(group)
    segments = mx.split(w, list(cuts), axis=axis) if cuts else [w]
    for seg in segments:
        require_divisible(
            f"a tensor of shape {tuple(w.shape)} along axis {axis}", seg.shape[axis], size
        )
    return mx.contiguous(
        mx.concatenate([mx.split(seg, size, axis=axis)[rank] for seg in segments], axis=axis)
    )


def split_outputs_of(linear: nn.Module, group: Group, cuts: Sequence[int] = ()) -> None:
    """Column parallel, in place: keep this rank's output rows (and bias)."""
    _, size = ranks(group)
    rows = linear.weight.shape[0]
    for start, end in zip((0, *cuts), (*cuts, rows), strict=True):
        require_divisible("output rows", end - start, size)
    # an int list is taken as cut points (mlx reads floats as fractions)
    shard_inplace(linear, "all-to-sharded", segments=list(cuts) or 1, group=group)


def summed_over(linear: nn.Module, group: Group) -> nn.Module:
    """Row parallel: a linear over this rank's input columns whose output is summed over the
    group (bias added once, after the sum)."""
    _, size = ranks(group)
    group_size = getattr(linear, "group_size", None)
    if group_size is not None:
        columns = linear.scales.shape[-1] * group_size
        require_divisible(
            f"quantization groups of {group_size} columns ({columns} columns)",
            columns // group_size,
            size,
        )
    else:
        require_divisible("input columns", linear.weight.shape[-1], size)
    return shard_linear(linear, "sharded-to-all", group=group)


def split_inputs_of(linear: nn.Module, group: Group) -> None:
    """Row parallel without the sum, in place (the caller sums several partial outputs in
    one all_sum)."""
    shard_inplace(linear, "sharded-to-all", group=group)


def all_sum(x: mx.array, group: Group | None) -> mx.array:
    return x if group is None or group.size() == 1 else mx.distributed.all_sum(x, group=group)


def shard_modules(module: nn.Module, group: Group, skip: Sequence[str] = ("mtp",)) -> None:
    """Call `shard(group)` on the outermost sub-modules that offer it (a module that shards
    itself decides for its children), skipping the named top-level subtrees."""
    for name, child in module.children().items():
        if name in skip:
            continue
        for item in child if isinstance(child, list) else [child]:
            if not isinstance(item, nn.Module):
                continue
            shard = getattr(item, "shard", None)
            if callable(shard):
                shard(group)
            else:
                shard_modules(item, group, skip=())
