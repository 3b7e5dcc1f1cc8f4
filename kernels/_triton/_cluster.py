"""Thread-block clusters for tl kernels (sm_90+): a launch whose programs run in clusters of C CTAs,
and the few PTX operations its programs share state with, in shared memory and without L2.

Triton's tl kernels compile one CTA a program (num_ctas=1): `cluster_launch` launches such a kernel
with a cluster dimension of C along grid axis 0 and `extra_shared` bytes of dynamic shared memory
past what Triton allocated. Program ids are CTA ids (ctaid.x), so cluster i holds programs
i*C .. i*C + C - 1 and a program's rank in its cluster is pid % C. The extra bytes (the "cluster
buffer") sit at the top of the dynamic shared memory, [size - extra_shared, size): Triton's own
buffers lie below, in [0, metadata.shared), and never meet it.

Operations (inline PTX; every thread of the program runs each, none is pure):
- `arrive(RELEASE)` / `wait()`: barrier.cluster's two halves. A wait returns once every non-exited
  thread of the cluster has arrived at the barrier's current phase; a release arrive orders the
  thread's earlier writes (shared::cluster stores included) before any read after an acquire wait.
  A program must not arrive twice without a wait in between; it may exit after an arrive.
- `put(off, mask, x)`: x's elements stored into this CTA's buffer at byte offsets `off` from the
  buffer's end (negative), where mask (int32) is nonzero.
- `take(off, mask, rank)`: CTA `rank`'s buffer read at those offsets (0.0 where mask is 0).

Two things of Triton's (3.6) this relies on: the compiled kernel's packed launch metadata (num_warps,
num_ctas, shared), which its launcher reads at every launch, and the dynamic shared memory's one
extern symbol, `global_smem`. tests/test_attention.py::test_gpu_clustered_decode_gives_the_training_bits
checks both on a GPU (a Triton upgrade must pass it).

A CTA's shared memory exists while it runs: a CTA reads another's buffer only after a wait on a
phase that CTA arrived at (so it has started, and has written what is read: a release arrive after
its puts), and no CTA exits before a wait on a phase every reader arrives at when done reading.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# both operations address the buffer by the dynamic shared memory's base (Triton's one extern
# symbol) plus its launched size, plus the (negative) offset $1
_BUFFER_END = ("mov.u32 b0, global_smem;\n\tmov.u32 b1, %dynamic_smem_size;\n\tadd.u32 b0, b0, b1;\n\t"
               "add.u32 b0, b0, $1;\n\t")
_PUT = tl.constexpr("{\n\t.reg .u32 b0, b1;\n\t.reg .pred q;\n\tsetp.ne.s32 q, $2, 0;\n\t" + _BUFFER_END
                    + "@q st.shared.f32 [b0], $3;\n\tmov.u32 $0, 0;\n\t}")
_TAKE = tl.constexpr("{\n\t.reg .u32 b0, b1;\n\t.reg .pred q;\n\tsetp.ne.s32 q, $2, 0;\n\t" + _BUFFER_END
                     + "mapa.shared::cluster.u32 b0, b0, $3;\n\tmov.f32 $0, 0f00000000;\n\t"
                     "@q ld.shared::cluster.f32 $0, [b0];\n\t}")


@triton.jit
def arrive(token, RELEASE: tl.constexpr):
    """barrier.cluster.arrive (.release, or .relaxed: no ordering). token: any int32 scalar (the asm
    needs an operand); returns 0."""
    if RELEASE:
        out = tl.inline_asm_elementwise("barrier.cluster.arrive.release;\n\tmov.u32 $0, 0;", "=r,r", [token],
                                        dtype=tl.int32, is_pure=False, pack=1)
    else:
        out = tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed;\n\tmov.u32 $0, 0;", "=r,r", [token],
                                        dtype=tl.int32, is_pure=False, pack=1)
    return out


@triton.jit
def wait(token):
    """barrier.cluster.wait.acquire: returns once every non-exited thread of the cluster arrived at
    the current phase. token: any int32 scalar; returns 0."""
    return tl.inline_asm_elementwise("barrier.cluster.wait.acquire;\n\tmov.u32 $0, 0;", "=r,r", [token],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def put(off, mask, x):
    """x (fp32) stored into this CTA's cluster buffer at byte offsets `off` (int32, negative: from
    the buffer's end) where mask (int32) is nonzero. Returns zeros of x's shape."""
    return tl.inline_asm_elementwise(_PUT, "=r,r,r,f", [off, mask, x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def take(off, mask, rank):
    """CTA `rank`'s cluster buffer (fp32; this CTA's own at its rank) at byte offsets `off` (int32,
    negative: from the buffer's end), 0.0 where mask (int32) is 0."""
    return tl.inline_asm_elementwise(_TAKE, "=f,r,r,r", [off, mask, rank], dtype=tl.float32, is_pure=False, pack=1)


def supported(device: torch.device) -> bool:
    """Whether `device` runs clusters (sm_90 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def cluster_launch(kernel, grid: tuple[int, ...], cluster: int, extra_shared: int, *args, **kwargs) -> bool:
    """Launch tl kernel `kernel` over grid[0] * cluster programs on axis 0 (grid[0] clusters of
    `cluster` CTAs) with `extra_shared` bytes of cluster buffer, if every cluster of the grid can
    be resident at once (cuOccupancyMaxActiveClusters); returns whether it launched (else the caller
    takes another path: a cluster's CTAs start together, so a second wave would not deadlock, but
    it would take the time of a second wave). The kernel must take `cluster` as a constexpr, so that
    the compiled kernel this patches (its launch metadata: cluster dimension, shared memory) is its
    own. Each call looks the compiled kernel up (warmup: a launch's host work, not the GPU's)."""
    from triton.runtime import driver

    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    meta = compiled.metadata
    shared = meta.shared + extra_shared
    if meta.num_ctas != 1 or meta.num_warps * 32 != 128:  # cuOccupancyMaxActiveClusters' blocks: 128 threads
        raise ValueError(f"cluster_launch: {kernel.fn.__name__} compiled with num_ctas={meta.num_ctas}, "
                         f"num_warps={meta.num_warps}; it takes num_ctas=1 and num_warps=4")
    packed = (meta.num_warps, cluster, shared)
    if compiled.packed_metadata != packed:
        compiled.run  # noqa: B018 (loads the binary: the handle the occupancy query needs)
        if shared > torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin:
            _FITS[(compiled, cluster)] = 0
        else:
            _FITS[(compiled, cluster)] = driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, shared,
                                                                                         cluster)
        compiled.packed_metadata = packed
    if _FITS[(compiled, cluster)] < grid[0]:
        return False
    kernel[grid](*args, **kwargs)
    return True


_FITS: dict[tuple[object, int], int] = {}  # (compiled kernel, cluster) -> its clusters resident at once
