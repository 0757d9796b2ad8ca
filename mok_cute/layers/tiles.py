"""The :class:`~mok_cute.policy.KernelPolicy` GEMM tiles each arch's kernels run, and the check a
layer call makes once its paths are decided, before any launch (:func:`check`).

The table (:data:`CHOICES`; the first value of each field is the kernel's default, "-": only the
default, not selectable; stages listed per tile_n, "auto": as many as fit, the default):

=====  =========  ===========================  ======  ==========  ======  ===================================
arch   precision  GEMM                         tile_m  tile_n      tile_k  stages
=====  =========  ===========================  ======  ==========  ======  ===================================
sm90   bf16,      fused_forward                128     256, 128    64      256: 2-3 (auto 3); 128: 3-6 (auto 6)
       mxfp8      fused_backward               128     256, 128    64      256: 2-3 (auto 3); 128: 3-5 (auto 5)
                  gemm1, gemm2, dgrad1, wgrad  128     256, 128    64      256: 2-3 (auto 3); 128: 2-6 (auto 6)
                  dgrad2                       128     256, 128    64      256: 2-3 (auto 3); 128: 2-5 (auto 5)
sm90   fp8_block  gemm1 .. wgrad (unfused)     128     128         128     -
sm100  bf16       fused_forward, _backward     128,    256         64      -
                                               256
                  gemm1 .. wgrad               128     256         64      -
sm100  mxfp8      as bf16                                          128     -
=====  =========  ===========================  ======  ==========  ======  ===================================

Where the limits come from (SM90): tile_m 128 is two consumer warpgroups of 64 rows, tile_k 64
one 128-byte swizzle atom of BF16; tile_n 256 or 128 (the SwiGLU / dSwiGLU epilogues' halves and
the MXFP8 32-column blocks need tile_n / 2 a multiple of 32; 64 and 192 are untested); stages up
to what fits in shared memory beside the epilogue, and at least what the slot sums' 48 KiB
``cp.async`` buffer in the B stages needs (the fused kernels: 3 at tile_n 128). The SwiGLU helper
warps cover a 128-column half tile: with tile_n 128 those launches run without them. Every
non-default value is compiled for sm_90a with no spills by the CPU tests
(tests/kernels/sm90/test_policy_tiles.py).

A GEMM's own fields (``policy.fused_forward``, ``policy.gemm1``, ...) are checked against the
table whether or not the call runs that kernel (a policy valid for the arch and precision) and
reach the kernel where it runs; ``policy.tiles`` (the ``MoKConfig.tile_*`` knobs) applies to every
GEMM the call runs, each of which must take it. A GEMM a precision does not run there (the fused
kernels at fp8_block) takes no tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

from mok_cute.policy import GEMM_NAMES, GEMMS, BackwardPath, ForwardPath, GemmTiles, KernelPolicy


@dataclass(frozen=True)
class Choices:
    """What one kernel's mainloop takes: the values of each :class:`~mok_cute.policy.GemmTiles` field
    (the first: the kernel's default); ``stages``: per tile_n, the ring depths it takes (the last: as
    many as fit, the default, also taken when none is given); a tile_n absent: not selectable."""

    tile_m: tuple[int, ...]
    tile_n: tuple[int, ...]
    tile_k: tuple[int, ...]
    stages: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def stages_at(self, tile_n: int) -> tuple[int, ...]:
        """The ring depths taken at ``tile_n`` (empty: not selectable)."""
        return dict(self.stages).get(tile_n, ())

    def default(self) -> GemmTiles:
        """The kernel's own tiles (stages None: as many as fit)."""
        return GemmTiles(self.tile_m[0], self.tile_n[0], self.tile_k[0])


def _sm90(tn128_stages: int, tn128_min: int = 2) -> Choices:
    """An SM90 mainloop: tile_n 256 at 2-3 stages, 128 at ``tn128_min``-``tn128_stages`` (the fused
    kernels' slot-sum buffer needs 3)."""
    return Choices((128,), (256, 128), (64,), ((256, (2, 3)), (128, tuple(range(tn128_min, tn128_stages + 1)))))


_SM90_BF16 = {"fused_forward": _sm90(6, 3), "fused_backward": _sm90(5, 3), "gemm1": _sm90(6),
              "gemm2": _sm90(6), "dgrad2": _sm90(5), "dgrad1": _sm90(6), "wgrad": _sm90(6)}
_SM90_FP8 = {g: Choices((128,), (128,), (128,)) for g in ("gemm1", "gemm2", "dgrad2", "dgrad1", "wgrad")}


def _sm100(tile_k: int) -> dict:
    unfused = Choices((128,), (256,), (tile_k,))
    fused = Choices((128, 256), (256,), (tile_k,))
    return {"fused_forward": fused, "fused_backward": fused, **{g: unfused for g in GEMMS[2:]}}


#: arch -> precision -> GEMM (:data:`~mok_cute.policy.GEMMS`) -> what its kernel takes
CHOICES: dict[str, dict[str, dict[str, Choices]]] = {
    "sm90": {"bf16": _SM90_BF16, "mxfp8": _SM90_BF16, "fp8_block": _SM90_FP8},
    "sm100": {"bf16": _sm100(64), "mxfp8": _sm100(128)},
}


def running(forward: ForwardPath, backward: BackwardPath) -> tuple[str, ...]:
    """The GEMMs (:data:`~mok_cute.policy.GEMMS`) a call with these paths runs."""
    fwd = ("fused_forward",) if forward is ForwardPath.FUSED else ("gemm1", "gemm2")
    bwd = ("dgrad2", "dgrad1", "wgrad") if backward is BackwardPath.UNFUSED else ("fused_backward",)
    return fwd + bwd


def check(policy: KernelPolicy, arch: str, precision: str, forward: ForwardPath, backward: BackwardPath) -> None:
    """ValueError naming the first field of ``policy``'s tiles that the kernels of ``arch`` at
    ``precision`` cannot run, with the values allowed there (see the module doc): each GEMM's own
    fields, and ``policy.tiles`` on every GEMM the call's paths run. Runs on any machine."""
    table = CHOICES[arch][precision]
    runs = running(forward, backward)
    for gemm in GEMMS:
        if gemm not in table:
            continue
        own = getattr(policy, gemm).given()
        wild = {} if gemm not in runs else {k: v for k, v in policy.tiles.given().items() if k not in own}
        for name, v in {**own, **wild}.items():
            where = f"policy.{gemm}.{name}" if name in own else f"policy.tiles.{name}" + (
                "" if name == "stages" else f" (MoKConfig.{name})")
            allowed = _allowed(table[gemm], name, policy.gemm(gemm))
            if v not in allowed:
                shown = ", ".join(map(str, allowed)) if allowed else "none: leave it None (the kernel's own)"
                raise ValueError(f"mok_cute backend {arch!r}: {where} = {v!r} does not run on {GEMM_NAMES[gemm]} "
                                 f"at precision {precision!r} (allowed: {shown})")


def _allowed(choices: Choices, name: str, tiles: GemmTiles) -> tuple[int, ...]:
    """The values of field ``name`` the kernel of ``choices`` takes, given the other fields ``tiles``."""
    if name == "stages":
        return choices.stages_at(choices.tile_n[0] if tiles.tile_n is None else tiles.tile_n)
    return getattr(choices, name)
