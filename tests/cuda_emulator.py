"""Run a kernel module's CUDA sources on the CPU: its `cuda_kernel` replaced by a factory
whose kernels compile (g++) with a small emulation of CUDA's thread model and run there, so
a kernel's indexing, reductions and selection are checked against the op path on a machine
without a GPU, through the module's own launch code (grid, template, outputs).

The emulation: blocks run one after another, each block's threads as fibers (ucontext) on
one OS thread; `__syncthreads`, `__shfl_xor_sync` and `__shfl_up_sync` are barriers over the
block / warp (a thread that returns leaves them; threads waiting at different ones abort the
run), so `atomicAdd` is a plain add; `__shared__` variables are statics (one block at a time);
half types round to nearest even as CUDA converts. Device math is the C library's (no fast-math
approximations), so results may differ from a GPU's in the last bits: tests compare with
tolerances. Not emulated: dynamic shared memory, async copies, tensor-core instructions.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from qwen38_backend.kernels import decode_attention, jit, rows_matmul
from qwen38_backend.kernels.fused import C_TYPES, template_constant

GRID_NAMESPACE = "namespace qwen38_grid {"  # what kernels/grid_sync.py's barrier is defined in

HEADER = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#include <ucontext.h>

// EMU_TLS: thread_local where the blocks run at once (a kernel with a grid barrier: each
// block on its own OS thread, so its shared memory and fibers are its own), else nothing
#ifndef EMU_TLS
#define EMU_TLS
#endif

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static EMU_TLS
#define __align__(n) __attribute__((aligned(n)))

struct dim3_ { unsigned x = 0, y = 0, z = 0; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = 0x7fc0; return; }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    bits = static_cast<uint16_t>(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
struct __half {
  _Float16 v;
  __half() = default;
  __half(float f) : v(static_cast<_Float16>(f)) {}
  operator float() const { return static_cast<float>(v); }
};

struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half2 { __half x, y; };
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {float(h.x), float(h.y)}; }
inline float2 __half22float2(__half2 h) { return {float(h.x), float(h.y)}; }
// CUDA's min / max take mixed integer types
template <typename A, typename B> inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? a : b;
}
template <typename A, typename B> inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// A block's threads are fibers on this one OS thread: each runs until it waits at a barrier
// (1: the block's, 2: its warp's) or ends; a barrier opens once every live thread of the
// block / warp waits there.
struct EmuFiber {
  ucontext_t ctx;
  dim3_ idx;
  int wait = 0;
  bool done = false;
};
static EMU_TLS std::vector<EmuFiber> emu_fibers;
static EMU_TLS std::vector<uint64_t> emu_slots;
static EMU_TLS int emu_current = 0;
static EMU_TLS ucontext_t emu_main;
static std::function<void()> emu_body;
dim3_ blockDim, gridDim;
EMU_TLS dim3_ blockIdx;

inline const dim3_& emu_thread_idx() { return emu_fibers[emu_current].idx; }
#define threadIdx emu_thread_idx()

inline void emu_wait(int kind) {
  EmuFiber& f = emu_fibers[emu_current];
  f.wait = kind;
  swapcontext(&f.ctx, &emu_main);
}
inline void __syncthreads() { emu_wait(1); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_wait(2); }
// every lane of the warp posts its value, then reads thread `from`'s (a warp barrier each)
template <typename V> V emu_shuffle(V v, int from) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  emu_slots[emu_current] = bits;
  emu_wait(2);
  const uint64_t other = emu_slots[from];
  emu_wait(2);
  V r;
  std::memcpy(&r, &other, sizeof(V));
  return r;
}
template <typename V> V __shfl_xor_sync(unsigned, V v, int offset) {
  const int t = emu_current;
  return emu_shuffle(v, (t & ~31) | ((t & 31) ^ offset));
}
// lane t reads lane t - delta's value (its own below delta), as CUDA's shuffle up
template <typename V> V __shfl_up_sync(unsigned, V v, unsigned delta) {
  const int t = emu_current;
  return emu_shuffle(v, (t & 31) >= int(delta) ? t - int(delta) : t);
}
// fibers switch only at barriers, but the blocks of a grid-barrier kernel are OS threads
static std::mutex emu_atomic;
template <typename V> V atomicAdd(V* at, V v) {
  std::lock_guard<std::mutex> hold(emu_atomic);
  const V old = *at;
  *at = old + v;
  return old;
}
template <typename V> V atomicExch(V* at, V v) {
  std::lock_guard<std::mutex> hold(emu_atomic);
  const V old = *at;
  *at = v;
  return old;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// A real sleep, not a yield: on a loaded machine a yield returns at once, and a waiting block
// would use up its polls while the block it waits for is still computing.
inline void __nanosleep(unsigned) { std::this_thread::sleep_for(std::chrono::microseconds(1)); }
template <typename V> inline V __ldcg(const V* at) { return *at; }

static void emu_entry() {
  emu_body();
  emu_fibers[emu_current].done = true;
  swapcontext(&emu_fibers[emu_current].ctx, &emu_main);
}

static void emu_run_block(int n, std::vector<std::vector<char>>& stacks) {
  for (int t = 0; t < n; ++t) {
    EmuFiber& f = emu_fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[t].data();
    f.ctx.uc_stack.ss_size = stacks[t].size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, emu_entry, 0);
    f.idx = {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
    f.wait = 0;
    f.done = false;
  }
  for (;;) {
    bool progress = false, live = false;
    for (int t = 0; t < n; ++t) {
      if (emu_fibers[t].done || emu_fibers[t].wait) continue;
      emu_current = t;
      swapcontext(&emu_main, &emu_fibers[t].ctx);
      progress = true;
    }
    bool block_open = true;
    for (int t = 0; t < n; ++t) {
      if (emu_fibers[t].done) continue;
      live = true;
      block_open = block_open && emu_fibers[t].wait == 1;
    }
    if (!live) return;
    if (block_open) {
      for (auto& f : emu_fibers) f.wait = 0;
      continue;
    }
    for (int w = 0; w < n; w += 32) {
      bool open = false, all = true;
      for (int t = w; t < n && t < w + 32; ++t) {
        if (emu_fibers[t].done) continue;
        open = true;
        all = all && emu_fibers[t].wait == 2;
      }
      if (open && all) {
        for (int t = w; t < n && t < w + 32; ++t) emu_fibers[t].wait = 0;
        progress = true;
      }
    }
    if (!progress) {
      std::fprintf(stderr, "emulated kernel: threads wait at different barriers\n");
      std::abort();
    }
  }
}

static EMU_TLS std::vector<std::vector<char>> emu_stacks;  // kept from block to block

static void emu_block(dim3_ at, int n) {
  blockIdx = at;
  emu_fibers.assign(n, EmuFiber{});
  emu_slots.assign(n, 0);
  if (int(emu_stacks.size()) != n) emu_stacks.assign(n, std::vector<char>(64 * 1024));
  emu_run_block(n, emu_stacks);
}

// One block after another, or (EMU_GRID: a kernel that waits for the whole grid) every block
// at once, each on its own OS thread
template <typename F> void emu_launch(F body, dim3_ grid, dim3_ block) {
  gridDim = grid;
  blockDim = block;
  const int n = block.x * block.y * block.z;
  emu_body = body;
  std::vector<std::thread> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
#ifdef EMU_GRID
        blocks.emplace_back(emu_block, dim3_{x, y, z}, n);
#else
        emu_block(dim3_{x, y, z}, n);
#endif
      }
  for (auto& b : blocks) b.join();
}
"""

# cp.async and its groups as plain copies (a copy that has landed at once is one a wait
# would see): the headers that issue them in PTX, replaced by their meaning
ASYNC = {
    decode_attention.ASYNC_COPIES: """
namespace qwen38_dattn {
inline void cp_async16(void* smem, const void* gmem) { std::memcpy(smem, gmem, 16); }
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
}
""",
    rows_matmul.COPY_CHUNK: """
namespace qwen38_rows {
template <int B> inline void copy_async(void* smem, const void* gmem) {
  std::memcpy(smem, gmem, B);
}
}
""",
}
# the attention kernels' helpers: the zero-filling copy as a copy or zeros; the tensor-core
# ones (ldmatrix, mma) are not emulated and stop the run if called
ASYNC[decode_attention._ATTENTION_HELPERS] = """
namespace qwen38_dattn {
inline void cp_async16_or_zero(void* smem, const void* gmem, bool live) {
  if (live) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
inline void ldsm_x4(unsigned (&)[4], const void*) { std::abort(); }
inline void ldsm_x4_trans(unsigned (&)[4], const void*) { std::abort(); }
template <typename T> struct Mma {
  static void run(float (&)[4], const unsigned (&)[4], unsigned, unsigned) { std::abort(); }
  static unsigned pack(float, float) { std::abort(); }
  static float rest(float) { std::abort(); }
};
}
"""
DYNAMIC_SHARED = re.compile(r"extern __shared__ (__align__\(\d+\) )?unsigned char (\w+)\[\];")

# MLX's device ops the kernels name (binary_ops.cuh, unary_ops.cuh), included where a
# kernel's header includes those: the operation in fp32, rounded to T on return, as CUDA's
# half types compute
MLX_OPS = r"""
namespace mlx::core::cu {
struct Add { template <typename T> T operator()(T a, T b) { return T(float(a) + float(b)); } };
struct Multiply {
  template <typename T> T operator()(T a, T b) { return T(float(a) * float(b)); }
};
struct Divide {
  template <typename T> T operator()(T a, T b) { return T(float(a) / float(b)); }
};
struct Sigmoid {
  template <typename T> T operator()(T x) { return T(1.0f / (1.0f + std::exp(-float(x)))); }
};
}  // namespace mlx::core::cu

"""
MLX_INCLUDE = '#include "mlx/'

# how an array of each dtype crosses to numpy and back (half types as their raw bits)
_RAW = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16}
_BUILT: dict[str, ctypes.CDLL] = {}
_DIR = Path(tempfile.mkdtemp(prefix="qwen38_cuda_emulator_"))


def _library(source: str) -> ctypes.CDLL:
    key = hashlib.sha1(source.encode()).hexdigest()[:16]
    if key not in _BUILT:
        path = _DIR / f"k{key}.cpp"
        path.write_text(source)
        out = _DIR / f"k{key}.so"
        run = subprocess.run(
            ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas"]
            + [str(path), "-o", str(out)],
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            raise RuntimeError(f"emulated kernel did not compile:\n{run.stderr[:4000]}")
        _BUILT[key] = ctypes.CDLL(str(out))
    return _BUILT[key]


class EmulatedKernel:
    """A stand-in for mx.fast.cuda_kernel's result that runs the source on the CPU."""

    def __init__(self, *, name, input_names, output_names, source, header="", shared_memory=0, **_):
        self.name, self.inputs, self.outputs = name, input_names, output_names
        # what jit.Kernel keeps (compacted, as jit passes it to MLX): a capture
        # (kernels/fused.py) composes from it
        self.spec = dict(
            name=name,
            input_names=input_names,
            output_names=output_names,
            source=jit.compact(source),
            header=jit.compact(header),
            shared_memory=shared_memory,
        )
        for issued, landed in ASYNC.items():
            header = header.replace(issued, landed)
        # dynamic shared memory: a static buffer of the launch's size
        self.source = DYNAMIC_SHARED.sub(
            rf"static EMU_TLS __align__(16) unsigned char \2[{max(shared_memory, 16)}];", source
        )
        # (a fused kernel's phases, with their shared memory, are in its header)
        self.header = DYNAMIC_SHARED.sub(
            rf"static EMU_TLS __align__(16) unsigned char \2[{max(shared_memory, 16)}];", header
        )

    def __call__(
        self,
        *,
        inputs,
        grid,
        threadgroup,
        output_shapes,
        output_dtypes,
        template=(),
        init_value=None,
        **_,
    ) -> list[mx.array]:
        capture = jit._CAPTURE.get()
        if capture is not None:  # captured, as jit.Kernel's launches are
            call = dict(
                inputs=inputs,
                grid=grid,
                threadgroup=threadgroup,
                output_shapes=output_shapes,
                output_dtypes=output_dtypes,
                template=template,
                init_value=init_value,
            )
            return capture(self, call)
        arrays = [mx.contiguous(a) for a in inputs]  # MLX copies to row-contiguous too
        params, args, keep = [], [], []
        for name, a in zip(self.inputs, arrays, strict=True):
            params.append(f"const {C_TYPES[a.dtype]}* {name}")
            data = np.array(a.view(_RAW.get(a.dtype, a.dtype)) if a.ndim else a.reshape(1))
            keep.append(data)
            args.append(f"(const {C_TYPES[a.dtype]}*)p[{len(keep) - 1}]")
            if f"{name}_shape" in self.source:
                shape = np.array(a.shape or (1,), dtype=np.int32)
                keep.append(shape)
                params.append(f"const int* {name}_shape")
                args.append(f"(const int*)p[{len(keep) - 1}]")
            if f"{name}_strides" in self.source:  # (of the contiguous copy passed)
                strides = np.cumprod((1, *a.shape[:0:-1]))[::-1].astype(np.int64)
                keep.append(np.ascontiguousarray(strides))
                params.append(f"const int64_t* {name}_strides")
                args.append(f"(const int64_t*)p[{len(keep) - 1}]")
        outs = []
        for name, shape, dtype in zip(self.outputs, output_shapes, output_dtypes, strict=True):
            # unwritten elements read as NaN (floats) or all ones (integers), unless the
            # launch fills its outputs first (init_value), as MLX then does
            raw = _np_dtype(_RAW.get(dtype, dtype))
            out = np.full(int(np.prod(shape)) * dtype.size, 0xFF, np.uint8).view(raw)
            out = out.reshape(shape)
            if init_value is not None:
                out = np.array(mx.full(shape, init_value, dtype).view(_RAW.get(dtype, dtype)))
            outs.append((out, dtype))
            keep.append(out)
            params.append(f"{C_TYPES[dtype]}* {name}")
            args.append(f"({C_TYPES[dtype]}*)p[{len(keep) - 1}]")
        constants = "\n".join(template_constant(n, v) for n, v in template)
        # a kernel that waits for the whole grid runs its blocks at once (see HEADER)
        grid_mode = GRID_NAMESPACE in self.header
        source = "\n".join(
            [
                "#define EMU_GRID\n#define EMU_TLS thread_local" if grid_mode else "",
                HEADER,
                MLX_OPS if MLX_INCLUDE in self.header else "",
                "\n".join(ln for ln in self.header.splitlines() if MLX_INCLUDE not in ln),
                f"void kernel_body({', '.join(params)}) {{",
                constants,
                self.source,
                "}",
                'extern "C" void run(void** p, unsigned gx, unsigned gy, unsigned gz,',
                "                    unsigned bx, unsigned by, unsigned bz) {",
                f"  emu_launch([&] {{ kernel_body({', '.join(args)}); }},",
                "             dim3_{gx, gy, gz}, dim3_{bx, by, bz});",
                "}",
            ]
        )
        lib = _library(source)
        pointers = (ctypes.c_void_p * len(keep))(*[k.ctypes.data for k in keep])
        blocks = [g // t for g, t in zip(grid, threadgroup, strict=True)]
        lib.run(pointers, *[ctypes.c_uint(v) for v in (*blocks, *threadgroup)])
        return [
            mx.array(out).view(dtype) if dtype in _RAW else mx.array(out) for out, dtype in outs
        ]


def _np_dtype(dtype: mx.Dtype) -> np.dtype:
    return np.dtype(str(dtype).split(".")[-1])


def clear_caches(module) -> None:
    """Forget `module`'s cached kernels and probe results."""
    for value in vars(module).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def emulate(monkeypatch, module) -> None:
    """Make `module`'s kernels run on the CPU emulation (its cuda_kernel, its supported()
    true, its caches cleared; the caller clears them again afterwards)."""
    monkeypatch.setattr(module, "cuda_kernel", EmulatedKernel)
    monkeypatch.setattr(module, "supported", lambda *_, **__: True)
    clear_caches(module)
