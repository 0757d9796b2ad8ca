"""Host-side argument checks and launch helpers shared by the kernel wrappers (no CUDA calls
in the checks, so they run, and raise, on CPU tensors too)."""

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


def current_stream(device):
    """The current torch stream of ``device`` as a ``cuda.CUstream`` for compiled kernels."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
