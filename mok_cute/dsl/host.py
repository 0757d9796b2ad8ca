"""Host-side argument checks and launch helpers shared by the kernel wrappers (no CUDA calls
in the checks, so they run, and raise, on CPU tensors too)."""

import math

import torch

MAX_NUMEL = 2**31 - 1  # Int32 element indices
FLOAT_INPUTS = (torch.bfloat16, torch.float32)


def check_float_input(x, name: str) -> None:
    """TypeError unless ``x`` is a bf16 or fp32 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUTS:
        raise TypeError(f"{name} must have dtype torch.bfloat16 or torch.float32, got {x.dtype}")


def check_rows16(x: torch.Tensor, name: str) -> None:
    """ValueError unless 2-D ``x`` is contiguous, 16-byte aligned, with 16-byte rows and fewer
    than 2^31 elements."""
    per16 = 16 // x.element_size()
    if x.shape[1] % per16:
        raise ValueError(f"{name}.shape[1] = {x.shape[1]} must be a multiple of {per16} (16-byte rows)")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major)")
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"{name}.numel() = {x.numel()} must be < 2^31")
    if x.data_ptr() % 16:
        raise ValueError(f"{name}.data_ptr() must be 16-byte aligned")


def tma_weight(w: torch.Tensor) -> bool:
    """Whether the GEMMs' TMA descriptors address the 3-D weight ``w`` [E, N, K] in place: unit
    last stride, the other strides multiples of 16 bytes and not overlapping, 16-byte aligned
    (e.g. gate and up as the two halves of one [E, 2I, H] fc1 tensor)."""
    if w.dim() != 3 or w.stride(-1) != 1:
        return False
    # a traced tensor has no pointer: under torch.compile the kernels' own host checks (inside the
    # layer's custom op, on the real tensors) raise for a misaligned one
    if not torch.compiler.is_compiling() and w.data_ptr() % 16:
        return False
    vec = 16 // w.element_size()
    return (w.stride(1) % vec == 0 and w.stride(0) % vec == 0 and w.stride(1) >= w.shape[2]
            and w.stride(0) >= w.shape[1] * w.stride(1))


def halves_of(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The contiguous [E, 2I, H] tensor whose halves along dim 1 ``gate`` and ``up`` [E, I, H] are, gate first (one
    fc1 tensor's gate and up, or their gradients), or None: the tensor they are views of where it is exactly that,
    else a view over both."""
    if gate.dim() != 3:
        return None
    e, inter, hid = gate.shape
    if (tuple(up.shape) != (e, inter, hid) or up.dtype != gate.dtype or up.device != gate.device
            or up.data_ptr() != gate.data_ptr() + inter * hid * gate.element_size()
            or not gate.stride() == up.stride() == (2 * inter * hid, hid, 1)):
        return None
    base = gate._base
    if (base is not None and tuple(base.shape) == (e, 2 * inter, hid) and base.data_ptr() == gate.data_ptr()
            and base.stride() == (2 * inter * hid, hid, 1)):
        return base
    return gate.as_strided((e, 2 * inter, hid), (2 * inter * hid, hid, 1))


def weight_operand(w: torch.Tensor) -> torch.Tensor:
    """``w`` itself when :func:`tma_weight`, else its contiguous copy."""
    return w if tma_weight(w) else w.contiguous()


def device_index(device=None) -> int:
    """Index of a CUDA device given as a torch.device, an index, or None (the current device)."""
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def current_stream(device=None):
    """The current torch stream of ``device`` (see :func:`device_index`) as a ``cuda.CUstream``
    for compiled kernels (the raw handle: no torch Stream object on the launch path)."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415

    return cuda.CUstream(torch._C._cuda_getCurrentRawStream(device_index(device)))


# ---------------------------------------------------------------- grouped GEMM wrappers
_FP8 = torch.float8_e4m3fn
_props: dict[int, object] = {}  # device index -> its properties


def offsets_i32(offsets: torch.Tensor) -> torch.Tensor:
    """Group offsets as the kernels read them: a contiguous int32 tensor (``offsets`` itself
    when it already is one)."""
    return (offsets if offsets.dtype == torch.int32 else offsets.to(torch.int32)).contiguous()


def device_props(device):
    """``torch.cuda.get_device_properties`` of a CUDA device (a torch.device or an index; cached)."""
    dev = device_index(device)
    if dev not in _props:
        _props[dev] = torch.cuda.get_device_properties(dev)
    return _props[dev]


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (a torch.device or an index; cached)."""
    return device_props(device).multi_processor_count


def _check_tensor(name, t, ndim, dtypes):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def _check_devices(**tensors):
    """All tensors (None: absent, skipped) on one CUDA device (checked after shapes so CPU
    tests reach shape errors)."""
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise ValueError(f"{name} is on {t.device} but {first[0]} is on {first[1]}")


def _check_limit(limit):
    """``limit``: None (no clamp), a finite float > 0, or an activation with ``limit``, ``alpha`` and
    ``up_offset`` attributes (a :class:`~mok_cute.reference.SwiGLU`, which validated alpha and up_offset
    itself): its limit checked likewise."""
    if all(hasattr(limit, a) for a in ("limit", "alpha", "up_offset")):
        limit = limit.limit
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise TypeError(f"limit must be a float or None, got {type(limit).__name__}")
        if not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"limit must be finite and > 0, got {limit}")


def _check_out(name, t, shape, device):
    if t is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    _check_tensor(name, t, len(shape), (torch.bfloat16,))
    if tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous with shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _check_offsets(offsets):
    _check_tensor("offsets", offsets, 1, (torch.int32, torch.int64))
    if offsets.numel() < 2:
        raise ValueError(f"offsets must hold E+1 >= 2 entries, got {offsets.numel()}")
    return offsets.numel() - 1


def _check_token_operand(name, t, m, mx=False):
    """Wgrad operand [M, N] (bf16, or float8_e4m3fn with ``mx``): unit column stride, row
    stride >= N, row stride and N multiples of 16 bytes, 16-byte aligned (a column slice such
    as ``dgu[:, :I]`` is read in place)."""
    _check_tensor(name, t, 2, (_FP8,) if mx else (torch.bfloat16,))
    if t.shape[0] != m:
        raise ValueError(f"{name} must have {m} rows (as a), got {t.shape[0]}")
    vec = 16 // t.element_size()
    if t.shape[1] % vec or t.shape[1] == 0:
        raise ValueError(f"{name}: columns={t.shape[1]} must be a positive multiple of {vec}")
    if t.stride(1) != 1 or t.stride(0) % vec or t.stride(0) < t.shape[1] or t.data_ptr() % 16:
        raise ValueError(f"{name} must be row-major with unit column stride, a row stride that is a multiple "
                         f"of {vec} and 16-byte alignment, got strides {t.stride()}")


def check_wgrad_operands(a, b, offsets, n_mult: int, mx: bool = False):
    """Validate the weight gradient's a [M, Na], b [M, Nb] (:func:`_check_token_operand`) and
    offsets; Nb a multiple of ``n_mult``, M < 2^31. Returns ``(M, Na, Nb, E)``."""
    m, na = a.shape
    _check_token_operand("a", a, m, mx)
    _check_token_operand("b", b, m, mx)
    e = _check_offsets(offsets)
    nb = b.shape[1]
    if nb % n_mult:
        raise ValueError(f"b: Nb={nb} must be a multiple of {n_mult}")
    if m >= 2 ** 31:
        raise ValueError(f"a: M={m} rows must be < 2^31")
    return m, na, nb, e


def wgrad_out(out, shape, device):
    """The weight gradient's output: a new [E, Na, Nb] bf16 tensor, or ``out`` checked
    contiguous of that shape."""
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    _check_tensor("out", out, 3, (torch.bfloat16,))
    if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with shape {tuple(shape)}, got {tuple(out.shape)}")
    return out


# ---------------------------------------------------------------- raw-pointer kernels (comm, plan)
def check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    """TypeError/ValueError unless ``t`` is a contiguous ``dtype`` tensor of ``shape`` on
    ``device`` (a ``None`` entry in ``shape`` accepts any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address")


def dptr(t: torch.Tensor, dtype=None, align: int = 16):
    """Runtime ``cute.Pointer`` to a device tensor's data (dtype from the tensor by default)."""
    import cutlass  # noqa: PLC0415 (the DSL only when a kernel is called)
    import cutlass.cute as cute  # noqa: PLC0415
    from cutlass.cute.runtime import make_ptr  # noqa: PLC0415

    m = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32,
         torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}
    return make_ptr(dtype or m[t.dtype], t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def fake_stream():
    """Compile-time placeholder stream (no GPU needed)."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415

    return cuda.CUstream(0)


def fake_ptr(kind: str):
    """Compile-time placeholder pointer ('bf16', 'f32', 'i32', 'i64')."""
    import cutlass  # noqa: PLC0415 (the DSL only when a kernel is called)
    import cutlass.cute as cute  # noqa: PLC0415
    from cutlass.cute.runtime import make_ptr  # noqa: PLC0415

    dt = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32, "i32": cutlass.Int32,
          "i64": cutlass.Int64}[kind]
    return make_ptr(dt, 0, cute.AddressSpace.gmem, assumed_align=16)
