"""Batched tiled transposes of expert weights between a model's layouts and the kernels' (CuTe DSL,
arch-neutral SIMT: SM90 and SM100). Pure data movement, every element copied exactly; for inp [E, B, A]
and out [E, A, B]:

    ``"plain"``         out[e, a, b] = inp[e, b, a]
    ``"deinterleave"``  out[e, d(a), b] = inp[e, b, a]      (A even)
    ``"interleave"``    out[e, a, b] = inp[e, d(b), a]      (B even)

with d(c) = (c % 2) * n + c // 2 (n: half the dim). "deinterleave" takes gpt-oss's ``gate_up_proj``
[E, H, 2I] (gate at even, up at odd columns) to the kernels' [E, 2I, H] (gate rows, then up rows);
"interleave" takes the fused backward's dW_gate / dW_up, the halves of one [E, 2I, H] buffer, to
[E, H, 2I] interleaved; "plain" takes a [E, I, H] ``down_proj`` to [E, H, I] and its gradient back.
torch's copy of such a view reads (or writes) 2-byte elements thousands of elements apart.

Grid (ceil(A / 64), ceil(B / 64), E), 256 threads: a CTA moves one 64 x 64 tile. Each thread loads two
16-byte chunks (8 consecutive a of one row b of inp) and writes their elements to a shared tile [a][b],
whose 16-byte chunks along b are swizzled by a / 8 (the scalar stores of a warp fall in distinct banks);
after one barrier it reads two 16-byte chunks (8 consecutive b of one a) and stores them to out's row.
A and B multiples of 8 (whole 16-byte chunks; a tile at an edge is masked by chunk); E * A * B < 2^31.
Dims are runtime ``Int32``: one compiled kernel per arch and mode.
"""

import torch

from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch, dsl
from mok_cute.dsl.host import MAX_NUMEL, current_stream, dptr, fake_ptr, fake_stream

MODES = ("plain", "deinterleave", "interleave")
_TILE = 64  # a CTA's tile is _TILE x _TILE elements
_VEC = 8  # bf16 elements per 16-byte chunk
_THREADS = 256
_ROW_CHUNKS = _TILE // _VEC  # 16-byte chunks per tile row
_PER_THREAD = _TILE * _ROW_CHUNKS // _THREADS  # chunks each thread loads (and stores)


def _build(arch: str, mode: str):
    """The kernel and its launch for ``mode``, compiled for ``arch`` with symbolic dims."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415 (the DSL is imported lazily, on first compile)

    cutlass, cute = dsl()
    Int32 = cutlass.Int32

    @cute.jit
    def _chunk(tid: Int32, j: cutlass.Constexpr[int]):
        """Thread ``tid``'s ``j``-th 16-byte chunk of a tile: (tile row, chunk of that row)."""
        q = tid + j * _THREADS
        return q // _ROW_CHUNKS, q % _ROW_CHUNKS

    @cute.jit
    def _row(r: Int32, dim: Int32, interleaved: cutlass.Constexpr[bool]) -> Int32:
        """Row ``r`` of a matrix, or (``interleaved``) d(r) = (r % 2) * dim / 2 + r // 2: its place among the
        halves."""
        if cutlass.const_expr(interleaved):
            r = (r % 2) * (dim // 2) + r // 2
        return r

    @cute.kernel
    def kernel(inp: cute.Tensor, out: cute.Tensor, a_dim: Int32, b_dim: Int32):
        tid, _, _ = cute.arch.thread_idx()
        ta, tb, e = cute.arch.block_idx()
        a0, b0 = ta * _TILE, tb * _TILE
        ca, cb = a_dim // _VEC, b_dim // _VEC  # chunks per row of inp, of out
        tile = cutlass.memory.SmemAllocator().allocate_tensor(  # row a, chunk (b / 8) ^ (a / 8), element b % 8
            cutlass.BFloat16, cute.make_layout((_TILE * _ROW_CHUNKS, _VEC), stride=(_VEC, 1)), byte_alignment=16)
        buf = cute.make_rmem_tensor((_VEC, _PER_THREAD), cutlass.BFloat16)
        for j in cutlass.range_constexpr(_PER_THREAD):  # every load in flight before the shared stores
            bb, v = _chunk(tid, j)
            if b0 + bb < b_dim and a0 + v * _VEC < a_dim:
                row = _row(b0 + bb, b_dim, mode == "interleave")
                buf[None, j].store(inp[(e * b_dim + row) * ca + a0 // _VEC + v, None].load())
        for j in cutlass.range_constexpr(_PER_THREAD):
            bb, v = _chunk(tid, j)
            for i in cutlass.range_constexpr(_VEC):  # tile row a = 8 v + i: its chunk swizzle is v
                tile[(v * _VEC + i) * _ROW_CHUNKS + ((bb // _VEC) ^ v), bb % _VEC] = buf[i, j]
        cute.arch.barrier()
        for j in cutlass.range_constexpr(_PER_THREAD):
            aa, w = _chunk(tid, j)
            if a0 + aa < a_dim and b0 + w * _VEC < b_dim:
                row = _row(a0 + aa, a_dim, mode == "deinterleave")
                out[(e * a_dim + row) * cb + b0 // _VEC + w, None].store(
                    tile[aa * _ROW_CHUNKS + (w ^ (aa // _VEC)), None].load())

    @cute.jit
    def launch(inp_p: cute.Pointer, out_p: cute.Pointer, e: Int32, a_dim: Int32, b_dim: Int32,
               stream: cuda.CUstream):
        # inp and out as 16-byte chunks: inp row (e, b)'s chunk c at (e * B + b) * A / 8 + c, out's likewise
        inp = cute.make_tensor(inp_p, cute.make_layout((e * b_dim * (a_dim // _VEC), _VEC), stride=(_VEC, 1)))
        out = cute.make_tensor(out_p, cute.make_layout((e * a_dim * (b_dim // _VEC), _VEC), stride=(_VEC, 1)))
        kernel(inp, out, a_dim, b_dim).launch(
            grid=[(a_dim + _TILE - 1) // _TILE, (b_dim + _TILE - 1) // _TILE, e], block=[_THREADS, 1, 1],
            stream=stream)

    return compile_kernel(launch, fake_ptr("bf16"), fake_ptr("bf16"), *(Int32(1),) * 3, fake_stream(),
                          arch=arch, inspect=True)


def compiled_relayout(arch: str, mode: str):
    """The cached ``(compiled, CompileReport)`` of :func:`relayout`'s kernel for ``mode`` and an arch in
    ``compile.ARCHS``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return compile_cached(("relayout", arch, mode), lambda: _build(arch, mode))


def reference_relayout(inp: torch.Tensor, mode: str) -> torch.Tensor:
    """:func:`relayout`'s result in torch ops (a new contiguous tensor)."""
    e, b, a = inp.shape
    if mode == "plain":
        return inp.transpose(1, 2).contiguous()
    if mode == "deinterleave":  # inp[e, b, 2i + g] -> out[e, g n + i, b]
        return inp.reshape(e, b, a // 2, 2).permute(0, 3, 2, 1).reshape(e, a, b)
    # interleave: inp[e, g n + i, a] -> out[e, a, 2i + g]
    return inp.reshape(e, 2, b // 2, a).permute(0, 3, 2, 1).reshape(e, a, b)


def _inp_error(inp) -> Exception | None:
    """What is wrong with ``inp`` as :func:`relayout`'s input (a TypeError / ValueError naming it), or None."""
    if not isinstance(inp, torch.Tensor) or inp.dtype != torch.bfloat16 or inp.dim() != 3:
        return TypeError(f"inp must be a 3-D torch.bfloat16 tensor, got "
                         f"{getattr(inp, 'dtype', type(inp).__name__)} {tuple(getattr(inp, 'shape', ()))}")
    if inp.shape[2] % _VEC or inp.shape[1] % _VEC:
        return ValueError(f"inp [E, B, A] = {tuple(inp.shape)}: A and B must be multiples of {_VEC}")
    if not inp.is_contiguous() or inp.data_ptr() % 16:
        return ValueError(f"inp must be contiguous and 16-byte aligned, got strides {inp.stride()}")
    if inp.numel() > MAX_NUMEL:
        return ValueError(f"inp must have < 2^31 elements, got {inp.numel()}")
    return None


def relayout_fits(inp: torch.Tensor) -> bool:
    """Whether :func:`relayout` takes ``inp`` (on any device): 3-D bf16, contiguous, 16-byte aligned, its last
    two dims multiples of 8, fewer than 2^31 elements."""
    return _inp_error(inp) is None


def _check(inp, mode, out):
    """TypeError / ValueError naming the argument, before any launch (CPU tensors too)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    err = _inp_error(inp)
    if err is not None:
        raise err
    e, b, a = inp.shape
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16:
            raise TypeError(f"out must be a torch.bfloat16 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
        if tuple(out.shape) != (e, a, b) or not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError(f"out must be contiguous, 16-byte aligned, with shape {(e, a, b)}, got "
                             f"{tuple(out.shape)}")
        if out.device != inp.device:
            raise ValueError(f"out must be on inp's device {inp.device}, got {out.device}")


def relayout(inp: torch.Tensor, mode: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [E, A, B] bf16 from ``inp`` [E, B, A] bf16 by ``mode`` (the module doc: a transpose of each
    expert's matrix, with gate / up interleaving undone or made on one side), bitwise a copy.

    inp contiguous, 16-byte aligned, A and B multiples of 8 (the interleaved dim even), fewer than 2^31
    elements; ``out`` (optional) contiguous, 16-byte aligned, on inp's device. CUDA: one launch on the current
    stream, no host sync (graph capturable). CPU tensors: :func:`reference_relayout`. Raises TypeError /
    ValueError naming the argument before any launch."""
    _check(inp, mode, out)
    e, b, a = inp.shape
    if not inp.is_cuda:
        want = reference_relayout(inp, mode)
        return want if out is None else out.copy_(want)
    if out is None:
        out = torch.empty((e, a, b), dtype=inp.dtype, device=inp.device)
    if inp.numel():
        dev, arch = device_arch(inp.device)
        fn, _ = compiled_relayout(arch, mode)
        with torch.cuda.device(dev):
            fn(dptr(inp), dptr(out), e, a, b, current_stream(dev))
    return out
