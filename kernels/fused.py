"""Several kernel launches as one: each launch's kernel becomes a phase of one persistent
launch, the phases separated by grid barriers (kernels/grid_sync.py; issue 14).

Why: a Flash-Next step is bound by the host's ~10-15 us of MLX work a launch, and its
device time by each launch's fixed cost (a Gated DeltaNet layer's ~14 launches took ~143
us of device time for ~44 us of bytes: INTERNALS, session 35). A launch waits for the one
before only for its inputs; a grid barrier gives the same order inside one launch.

How: the launches are captured, not run (`capture()`: a module's own launch code runs
unchanged, its kernels hand their calls to the capture, which returns stand-in outputs).
A stand-in passed whole to a later launch (or a row-major stretch of it: `view`) becomes a
reference to that output; any other array is an input of the fused launch. `launch()` then
writes each captured kernel's body as a device function of its own namespace (its template
constants and its inputs' shapes as constants there, `blockIdx` / `gridDim` its own virtual
grid), and one kernel calls them in order: each phase's virtual blocks spread over the
persistent blocks (one block runs several in turn, a block barrier between them), a grid
barrier between phases. Every output of every phase is an output of the fused launch. The
arithmetic is the kernels' own, so the outputs are the separate launches' bits (`agrees`
checks it where the engine uses a composition).

Rules a composed kernel follows (the modules' step kernels do): one thread count for all;
no thread leaves its body before a block barrier that others still reach (a `return` leaves
the phase's function, not the launch); no output filled before the launch (init_value: MLX
would fill every output of the fused launch, a kernel each).
A stand-in must not be sliced, reshaped or computed on (its values are not real): only
handed to a later launch of the capture, whole or through `view`.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx

from . import grid_sync
from .jit import Kernel, capturing, cuda_kernel
from .switch import switched

C_TYPES = {
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.float32: "float",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.int64: "int64_t",
    mx.uint64: "uint64_t",
    mx.bool_: "bool",
}
# Persistent blocks an SM: all must be resident at once (the barrier waits for every one), so
# two blocks of 256 threads need at most 128 registers a thread. Two, so a phase's loads have
# more warps to hide their latency behind than one block's eight (not measured yet); a
# composition whose probe finds a wait giving up at two runs at one (ptxas: a Flash-Next
# layer's MoE side takes 152 registers, its mixer side 120, a gated residual's open 43).
BLOCKS_PER_SM = 2
_PER_SM: dict[str, int] = {}  # fused kernel name -> the blocks an SM its probe chose

INDEX = """
namespace qwen38_fused {
struct Index { unsigned x, y, z; };
}
"""


@dataclass
class Phase:
    kernel: Kernel
    call: dict
    outputs: list[mx.array]


@dataclass
class Capture:
    """Launches captured in order, and where each stand-in output came from."""

    phases: list[Phase] = field(default_factory=list)
    # id(stand-in) -> (phase, output, flat offset in it, shape, the stand-in: kept so its id
    # is not reused)
    made: dict[int, tuple[int, int, int, tuple, mx.array]] = field(default_factory=dict)

    def __call__(self, kernel: Kernel, call: dict) -> list[mx.array]:
        if call.get("init_value") is not None:
            raise ValueError(f"{kernel.spec['name']}: a fused phase cannot fill its outputs")
        shapes, dtypes = call["output_shapes"], call["output_dtypes"]
        outs = [mx.zeros(s, d) for s, d in zip(shapes, dtypes, strict=True)]
        index = len(self.phases)
        self.phases.append(Phase(kernel, call, outs))
        for k, out in enumerate(outs):
            self.made[id(out)] = (index, k, 0, tuple(out.shape), out)
        return outs

    def view(self, stand_in: mx.array, offset: int, shape: tuple[int, ...]) -> mx.array:
        """A stand-in for the prod(shape) values of `stand_in` from flat `offset` on, as an
        array of `shape` (a row-major stretch, e.g. some columns of a one-row output)."""
        phase, k, at, full, _ = self.made[id(stand_in)]
        if offset < 0 or offset + math.prod(shape) > math.prod(full):
            raise ValueError(f"a view of {shape} at {offset} of an output {full} leaves it")
        view = mx.zeros(shape, stand_in.dtype)
        self.made[id(view)] = (phase, k, at + offset, tuple(shape), view)
        return view


@contextmanager
def capture() -> Iterator[Capture]:
    """Kernel launches inside are captured (module docstring), not run."""
    taken = Capture()
    with capturing(taken):
        yield taken


def launch(taken: Capture, blocks: int | None = None) -> Fused:
    """Run the captured launches as one (`blocks` persistent blocks; default the probe's
    choice an SM, at most what the largest phase uses)."""
    spec, inputs, most, threads = compose(taken)
    kernel = _kernel(**spec)
    name = kernel.spec["name"]  # (jit's: with its text's digest, one per composition)
    if blocks is None:
        blocks = grid_sync.sm_count() * _PER_SM.get(name, BLOCKS_PER_SM)
    blocks = max(1, min(blocks, most))
    phases = taken.phases
    out_shapes = [s for p in phases for s in p.call["output_shapes"]] + [(2,)]
    out_dtypes = [d for p in phases for d in p.call["output_dtypes"]] + [mx.uint32]
    results = kernel(
        inputs=[*inputs, grid_sync.fresh_state()],
        grid=(blocks * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=out_shapes,
        output_dtypes=out_dtypes,
    )
    real: dict[int, mx.array] = {}
    at = 0
    for phase in phases:
        for out in phase.outputs:
            real[id(out)] = results[at]
            at += 1
    return Fused(taken, real, results[-1], name)


class Fused:
    """A fused launch's outputs: fused(stand_in) is the real array a stand-in stood for;
    `barrier` [arrivals, gave up]: a set [1] means the outputs are not valid."""

    def __init__(self, taken: Capture, real: dict[int, mx.array], barrier: mx.array, name: str):
        self.taken, self.real, self.barrier, self.name = taken, real, barrier, name

    def __call__(self, stand_in: mx.array) -> mx.array:
        phase, k, at, shape, _ = self.taken.made[id(stand_in)]
        whole = self.real[id(self.taken.phases[phase].outputs[k])]
        if at == 0 and shape == tuple(whole.shape):
            return whole
        return whole_view(whole, at, shape)


def compose(taken: Capture) -> tuple[dict, list[mx.array], int, int]:
    """(the fused kernel's spec, its inputs, the most virtual blocks of a phase, the thread
    count) of the captured launches; ValueError where they cannot be one launch."""
    phases = taken.phases
    if not phases:
        raise ValueError("nothing was captured")
    threads = {tuple(p.call["threadgroup"]) for p in phases}
    if len(threads) != 1 or next(iter(threads))[1:] != (1, 1):
        raise ValueError(f"fused phases need one 1-D thread count, got {sorted(threads)}")
    for phase in phases:  # only bodies get their own grid: a header must not read it
        if re.search(r"\b(blockIdx|gridDim)\b", phase.kernel.spec.get("header", "")):
            raise ValueError(f"{phase.kernel.spec['name']}: its header reads the grid")
    inputs, names, plan = [], [], []
    for i, phase in enumerate(phases):
        args = []
        for name, a in zip(phase.kernel.spec["input_names"], phase.call["inputs"], strict=True):
            source = taken.made.get(id(a))
            if source is None:
                inputs.append(a)
                names.append(f"f{i}_{name}")
                args.append((name, f"f{i}_{name}", tuple(a.shape), a.dtype))
            else:
                j, k, at, shape, _ = source
                out_name = phases[j].kernel.spec["output_names"][k]
                pointer = f"f{j}_{out_name}" + (f" + {at}" if at else "")
                args.append((name, pointer, shape, a.dtype))
        plan.append(args)
    virtual = [_blocks(p.call["grid"], p.call["threadgroup"]) for p in phases]
    most = max(math.prod(v) for v in virtual)
    spec = _fused_spec(phases, plan, names, virtual)
    return spec, inputs, most, next(iter(threads))[0]


def _blocks(grid, threadgroup) -> tuple[int, int, int]:
    return tuple(-(-g // t) for g, t in zip(grid, threadgroup, strict=True))


def template_constant(name: str, value) -> str:
    """A template argument as the C line MLX writes for it."""
    if isinstance(value, bool):
        return f"constexpr bool {name} = {str(value).lower()};"
    if isinstance(value, int):
        return f"constexpr int {name} = {value};"
    return f"using {name} = {C_TYPES[value]};"


def _shape_constants(name: str, shape: tuple, body: str) -> list[str]:
    """A phase input's shape, strides (row-contiguous: MLX hands kernels such copies) and
    rank as the constants MLX would have passed, where the body reads them."""
    out = []
    if f"{name}_shape" in body:
        out.append(f"__device__ constexpr int {name}_shape[] = {{{', '.join(map(str, shape))}}};")
    if f"{name}_strides" in body:
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        values = ", ".join(f"{s}LL" for s in strides)
        out.append(f"__device__ constexpr long long {name}_strides[] = {{{values}}};")
    if f"{name}_ndim" in body:
        out.append(f"constexpr int {name}_ndim = {len(shape)};")
    return out


def header_units(header: str) -> list[str]:
    """A (compacted) header's top-level pieces: each preprocessor line outside braces, and
    each declaration up to the brace or semicolon that closes it at depth 0, so that two
    kernels' headers built from the same helpers give equal pieces (defined once when
    fused). Braces inside string and character literals do not count."""
    units, current, depth = [], [], 0
    for line in header.splitlines(keepends=True):
        if not line.strip():
            continue
        if depth == 0 and not current and line.lstrip().startswith("#"):
            units.append(line)
            continue
        current.append(line)
        code = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', "", line)
        depth += code.count("{") - code.count("}")
        if depth == 0 and (code.rstrip().endswith(("}", ";"))):
            units.append("".join(current))
            current = []
    if current or depth:
        raise ValueError("a kernel header whose braces do not close")
    return units


def _fused_spec(phases: list[Phase], plan: list, names: list[str], virtual: list) -> dict:
    headers: list[str] = []  # top-level pieces, each once: headers share helpers
    for phase in phases:
        for unit in header_units(phase.kernel.spec.get("header", "")):
            if unit not in headers:
                headers.append(unit)
    functions, calls, outputs = [], [], []
    for i, (phase, args) in enumerate(zip(phases, plan, strict=True)):
        spec, call = phase.kernel.spec, phase.call
        body = re.sub(r"\bblockIdx\b", "qwen38_vb", spec["source"])
        body = re.sub(r"\bgridDim\b", "qwen38_vg", body)
        lines = [template_constant(n, v) for n, v in call.get("template", ())]
        params, passed = [], []
        for name, fused_name, shape, dtype in args:
            lines += _shape_constants(name, shape, body)
            params.append(f"const {C_TYPES[dtype]}* {name}")
            passed.append(fused_name)
        for name, dtype in zip(spec["output_names"], call["output_dtypes"], strict=True):
            params.append(f"{C_TYPES[dtype]}* {name}")
            passed.append(f"f{i}_{name}")
            outputs.append(f"f{i}_{name}")
        params += ["const qwen38_fused::Index qwen38_vb", "const qwen38_fused::Index qwen38_vg"]
        functions.append(
            f"namespace qwen38_f{i} {{\n"
            + "\n".join(lines)
            + f"\n__device__ void run({', '.join(params)}) {{\n{body}\n}}\n}}\n"
        )
        gx, gy, gz = virtual[i]
        grid = f"qwen38_fused::Index{{{gx}u, {gy}u, {gz}u}}"
        calls.append(
            f"for (long long v = blockIdx.x; v < {gx * gy * gz}LL; v += gridDim.x) {{\n"
            f"const qwen38_fused::Index vb{{unsigned(v % {gx}), unsigned(v / {gx} % {gy}), "
            f"unsigned(v / {gx * gy})}};\n"
            f"qwen38_f{i}::run({', '.join(passed)}, vb, {grid});\n"
            "__syncthreads();\n}\n"
        )
    source = (
        "unsigned qwen38_passed = 0;\n"
        + "qwen38_grid::sync(QWEN38_GRID_STATE(qwen38_state), qwen38_passed);\n".join(calls)
        + "qwen38_grid::finish(QWEN38_GRID_STATE(qwen38_state), qwen38_barrier);\n"
    )
    return {
        "name": f"qwen38_fused{len(phases)}",
        "input_names": [*names, "qwen38_state"],
        "output_names": [*outputs, "qwen38_barrier"],
        "header": grid_sync.GRID_BARRIER + INDEX + "".join(headers) + "".join(functions),
        "source": source,
        "shared_memory": max(p.kernel.spec.get("shared_memory", 0) for p in phases),
    }


@functools.lru_cache(maxsize=256)
def _cached_kernel(name, input_names, output_names, header, source, shared_memory):
    return cuda_kernel(
        name=name,
        input_names=list(input_names),
        output_names=list(output_names),
        header=header,
        source=source,
        shared_memory=shared_memory,
    )


def _kernel(**spec):
    """The fused kernel of this spec (one per text: the composition's shapes are in it)."""
    return _cached_kernel(
        spec["name"],
        tuple(spec["input_names"]),
        tuple(spec["output_names"]),
        spec["header"],
        spec["source"],
        spec["shared_memory"],
    )


def supported() -> bool:
    return grid_sync.supported()


_AGREED: dict = {}


def whole_view(a: mx.array, offset: int, shape: tuple[int, ...]) -> mx.array:
    """The prod(shape) values of `a` from flat `offset` on, as `shape` (what Capture.view
    stands for)."""
    return a.reshape(-1)[offset : offset + math.prod(shape)].reshape(shape)


def run(build: Callable) -> list[mx.array] | None:
    """build(view)'s launches as one fused launch: the real arrays of the outputs build
    returns, or None where build returned None (nothing ran: a capture launches nothing)."""
    fused = _fused_run(build, None)
    return None if fused is None else fused[0]


def _fused_run(build: Callable, blocks: int | None) -> tuple[list[mx.array], Fused] | None:
    with capture() as taken:
        stand_ins = build(taken.view)
    if stand_ins is None:
        return None
    real = launch(taken, blocks)
    return [real(s) for s in stand_ins], real


def agrees(key, build: Callable, blocks: int | None = None) -> bool:
    """Whether build(view)'s launches, captured and fused, give what they give run one by
    one, bit for bit, with no barrier wait giving up (decided once per `key`; a refusal
    warns). build returns its outputs (None: nothing to fuse here); `view(a, offset, shape)`
    is whole_view, or Capture.view while captured. QWEN38_FUSED_KERNEL: off (the default,
    until measured on a GPU) | auto | force (no probe)."""
    decided = switched("QWEN38_FUSED_KERNEL", supported, default="off")
    if decided:
        grid_sync.sm_count()  # read back here, outside the traces that launch
    if decided is not None:
        return decided
    if key in _AGREED:
        return _AGREED[key]
    try:
        want = build(whole_view)
        if want is None:
            _AGREED[key] = False
            return False
        # at BLOCKS_PER_SM an SM, then one where a wait gave up (not all resident)
        for per_sm in [blocks] if blocks else dict.fromkeys((BLOCKS_PER_SM, 1)):
            got, real = _fused_run(build, per_sm if blocks else grid_sync.sm_count() * per_sm)
            mx.eval(want, got, real.barrier)
            gave_up = int(real.barrier[1].item()) != 0
            if not gave_up:
                break
        same = all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))
        if not blocks and not gave_up:
            _PER_SM[real.name] = per_sm
    except Exception as e:  # noqa: BLE001 - any failure means: separate launches
        warnings.warn(f"fused launch unavailable ({e}); launches stay separate", stacklevel=2)
        _AGREED[key] = False
        return False
    if gave_up or not same:
        warnings.warn(
            f"fused launch refused (a barrier wait gave up: {gave_up}; outputs equal to the "
            f"separate launches: {same}); launches stay separate",
            stacklevel=2,
        )
    _AGREED[key] = not gave_up and same
    return _AGREED[key]


def _forget() -> None:
    _AGREED.clear()
    _PER_SM.clear()


agrees.cache_clear = _forget  # as the other kernels' probes are cleared
