"""The policy's launch fields of the fused kernels (:class:`~mok_cute.policy.KernelPolicy`'s
``grid_ctas`` and ``raster_band``): the check a layer call makes before any launch, and the values
each launch takes.

``grid_ctas`` is the grid of every fused persistent kernel of the call (forward and backward, comm
CTAs included); it must leave at least one GEMM CTA beside each pass's comm CTAs and may not exceed
the CTAs the call's kernels may place (the device's SMs; at EP > 1 the rank's share,
``CommWorkspace.grid_ctas``, which is smaller for virtual ranks sharing one GPU). ``raster_band`` is
the fused forward's GEMM1 band of m-tiles per expert, at most the ring's slots. A value out of range
raises ValueError naming the field and the range (never clamped).
"""
from __future__ import annotations

from mok_cute.layers.common import ring_chunks


def check(config, topk_idx, ep: int, sms: int) -> None:
    """ValueError for a ``grid_ctas`` or ``raster_band`` of ``config``'s policy the call cannot run:
    ``topk_idx`` [T, k] (the ring's slots), ``ep`` (the comm CTAs' default), ``sms`` the CTAs the
    device can hold at once (one per SM)."""
    policy = config.kernel_policy
    grid = policy.grid_ctas
    if grid is not None:
        comm = max(config.comm_ctas_fwd(ep), config.comm_ctas_bwd())
        if not comm < grid <= sms:
            raise ValueError(f"grid_ctas = {grid} must be in [{comm + 1}, {sms}]: more than the comm CTAs of each "
                             f"pass (comm_sms_fwd {config.comm_ctas_fwd(ep)}, comm_sms_bwd {config.comm_ctas_bwd()}) "
                             f"and at most the device's {sms} SMs")
    band = policy.raster_band
    if band is not None:
        slots = ring_chunks(config, topk_idx)
        if band > slots:
            raise ValueError(f"raster_band = {band} must be at most the ring's {slots} slots (ceil(minibatch_tokens "
                             f"{policy.ring_tokens()} * k {topk_idx.shape[1]} / 128)): raise minibatch_tokens or "
                             "lower the band")


def grid(config, share: int | None = None) -> int | None:
    """The grid of a fused launch under ``config`` (None: the defaults): the policy's ``grid_ctas``,
    else ``share`` (EP > 1: the rank's ``ws.grid_ctas``; None: one CTA per SM). ValueError when the
    policy's grid exceeds ``share`` (virtual ranks share one GPU's SMs)."""
    g = None if config is None else config.kernel_policy.grid_ctas
    if g is None:
        return share
    if share is not None and g > share:
        raise ValueError(f"grid_ctas = {g} exceeds this rank's share of the GPU's SMs ({share}: virtual ranks share "
                         "one GPU)")
    return g


def band(config) -> int | None:
    """The fused forward's raster band under ``config`` (None: the kernel's default)."""
    return None if config is None else config.kernel_policy.raster_band
