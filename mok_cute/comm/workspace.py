"""Symmetric-memory workspace of the expert-parallel communication kernels.

One symmetric allocation per (group, T, H, k, E, dtype, capacity, timeout), made once
(collective: every rank of the group must call :func:`get_workspace` with the same
arguments) and reused by every step. Sections, each 256-byte aligned, same offsets on
every rank (peer address = ``peer_bases[q] + offset``):

  flags   int32 [NUM_CHANNELS, EP]  epoch flags (see :mod:`mok_cute.comm.protocol`)
  counts  int32 [EP, E]             per-source per-expert route counts (plan exchange)
  recv    int32 [EP*T*k]            packed source indices pushed by the sources (plan)
  src     bf16  [T, H]              pull source: x (dispatch) or dy (reverse combine)
  dy      bf16  [T, H]              pull source of the fused backward's dy rows (x stays in src)
  slots   bf16  [T*k, H]            push target: combine / reverse-dispatch rows
  w       fp32  [T, k]              pull source of the router weights (dispatch with topk_w)

The ``src`` section (T*H*2 bytes) also holds an MXFP8 dispatch's rows: per token
``H`` e4m3 bytes then ``H/32`` E8M0 scale bytes, padded to ``row_bytes = H + pad16(H/32)``
(:func:`mxfp8_row_bytes`; T*7392 bytes at H 7168, T*4224 at H 4096), within T*H*2 for H >= 32.

Local (not symmetric): ``status`` int32[4] (error code, peer, channel, epoch),
``counters[kind]`` int32[4] per kernel kind ('pull', 'push'; separate
allocations, each kernel's counters at offset 0), ``dummy`` int32[16] of zeros (passed for
an absent optional input; never aliases another argument), ``peer_bases`` int64 [EP].
Epochs are host-side counters bumped identically on every rank by each operation, so
ranks must issue the same sequence of operations on a workspace.

Virtual ranks (:mod:`mok_cute.comm.virtual`, R ranks of one process on one GPU): the same
sections in one plain device allocation per rank; ``peer_bases`` holds the R allocations.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mok_cute.comm import protocol as P
from mok_cute.comm.virtual import VirtualGroup
from mok_cute.dsl.compile import arch_of_device, compile_cached, compile_kernel, dsl
from mok_cute.dsl.host import current_stream, dptr, fake_ptr, fake_stream

_ALIGN = 256
_cache: dict = {}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN



class CommWorkspace:
    """Symmetric buffers, flags and status of one EP group for fixed (T, H, k, E): a
    torch.distributed group's (symmetric memory; the constructor, collective), or one rank's of
    a virtual group (:meth:`virtual`). The two differ only in the allocation and the exchange of
    the peer addresses.

    ``recv_capacity``: rows of the expert-grouped buffers (default EP*T*k, the worst case).
    ``timeout_s``: bound of every device-side wait. ``num_ctas``: default comm CTAs (4..32).
    """

    def __init__(self, group, T: int, H: int, k: int, E: int, dtype=torch.bfloat16,
                 recv_capacity: int | None = None, timeout_s: float = 10.0, num_ctas: int = 32):
        import torch.distributed._symmetric_memory as symm_mem

        self._layout(group, dist.get_rank(group), dist.get_world_size(group),
                     torch.device("cuda", torch.cuda.current_device()), T, H, k, E, dtype, recv_capacity,
                     timeout_s, num_ctas)
        self.buf = symm_mem.empty(self.sym_bytes, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.buf, group.group_name)
        self.buf.zero_()
        self._attach(self._peer_addresses())
        torch.cuda.synchronize(self.device)
        dist.barrier(group)  # flags are zero everywhere before any peer signals

    @classmethod
    def virtual(cls, group, T: int, H: int, k: int, E: int, dtype=torch.bfloat16,
                recv_capacity: int | None = None, timeout_s: float = 10.0,
                num_ctas: int = 32) -> list["CommWorkspace"]:
        """The workspaces of the ranks of ``group`` (a :class:`~mok_cute.comm.virtual.VirtualGroup`),
        in rank order: rank r's symmetric buffer is a plain zeroed allocation on ``group.device``,
        and every rank's ``peer_bases`` holds the R buffers' addresses (peers are addressed as on
        symmetric memory). Built by one thread for all ranks; on a CUDA device its current stream
        is synchronized before returning, so the zeros precede any rank's kernels."""
        wss = []
        for r in range(group.size()):
            ws = cls.__new__(cls)
            ws._layout(group, r, group.size(), group.device, T, H, k, E, dtype, recv_capacity, timeout_s,
                       num_ctas)
            ws.buf = torch.zeros(ws.sym_bytes, dtype=torch.uint8, device=ws.device)
            ws.handle, ws.sym_offsets = None, [0] * group.size()
            wss.append(ws)
        addrs = [ws.buf.data_ptr() for ws in wss]
        share = None
        if group.device.type == "cuda":  # the ranks' persistent kernels share the SMs (co-resident)
            from mok_cute.dsl.host import sm_count

            share = max(1, sm_count(group.device) // group.size())
        for ws in wss:
            ws._attach(addrs)
            ws.grid_ctas = share
        if group.device.type == "cuda":
            torch.cuda.current_stream(group.device).synchronize()
        return wss

    def _layout(self, group, me: int, ep: int, device: torch.device, T: int, H: int, k: int, E: int,
                dtype, recv_capacity: int | None, timeout_s: float, num_ctas: int) -> None:
        """Check the arguments and lay out the symmetric sections (``offsets``, ``sym_bytes``) of
        rank ``me`` of ``ep`` on ``device``."""
        self.group, self.me, self.EP = group, me, ep
        if E % self.EP:
            raise ValueError(f"E ({E}) must be a multiple of the group size ({self.EP})")
        if H % 8:
            raise ValueError(f"H ({H}) must be a multiple of 8 (16-byte rows)")
        if dtype != torch.bfloat16:
            raise TypeError(f"only bf16 payloads are supported, got {dtype}")
        if T * k * H >= 2**31:
            raise ValueError("T*k*H must be < 2**31")
        check_num_ctas(num_ctas)
        self.T, self.H, self.k, self.E, self.dtype = T, H, k, E, dtype
        self.recv_capacity = recv_capacity if recv_capacity is not None else self.EP * T * k
        if self.recv_capacity * H >= 2**31:
            raise ValueError("recv_capacity*H must be < 2**31")
        self.timeout_s, self.num_ctas = float(timeout_s), num_ctas
        self.device = device
        self.arch = arch_of_device(self.device)
        sizes = {"flags": P.NUM_CHANNELS * self.EP * 4, "counts": self.EP * E * 4,
                 "recv": self.EP * T * k * 4, "src": T * H * 2, "slots": T * k * H * 2,
                 "w": T * k * 4, "dy": T * H * 2}
        self.offsets, off = {}, 0
        for name, n in sizes.items():
            self.offsets[name] = off
            off += _align(n)
        self.sym_bytes = off

    def _attach(self, peer_addrs: list[int]) -> None:
        """The local state around the zeroed symmetric buffer ``self.buf``, given every rank's
        buffer address ``peer_addrs``: the peer table, status, counters, dummy, epochs."""
        self.peer_addrs = peer_addrs
        self.peer_bases = torch.tensor(self.peer_addrs, dtype=torch.int64, device=self.device)
        self.status = torch.zeros(P.STATUS_WORDS, dtype=torch.int32, device=self.device)
        self.counters = {kind: torch.zeros(P.NUM_COUNTERS, dtype=torch.int32, device=self.device)
                         for kind in ("pull", "push")}
        self.dummy = torch.zeros(16, dtype=torch.int32, device=self.device)
        self.epoch = {"plan": 0, "pull": 0, "push": 0}
        self.poisoned: str | None = None
        self.grid_ctas: int | None = None  # a whole-GPU kernel's grid for this rank (None: every SM)

    def _peer_addresses(self) -> list[int]:
        """Address of every rank's workspace tensor, valid in this process.

        ``handle.buffer_ptrs[q]`` is the base of rank q's symmetric *allocation*; with
        torch's pooled symmetric allocator a tensor can sit at an offset inside it
        (``handle.offset``), and that offset need not be the same on every rank. Each
        rank measures ``data_ptr - buffer_ptrs[me]`` and the offsets are exchanged."""
        ptrs = [int(p) for p in self.handle.buffer_ptrs]
        mine = self.buf.data_ptr() - ptrs[self.me]
        t = torch.tensor([mine], dtype=torch.int64, device=self.device)
        offs = torch.empty(self.EP, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(offs, t, group=self.group)
        self.sym_offsets = [int(o) for o in offs.tolist()]
        size = getattr(self.handle, "buffer_size", None)
        for q, o in enumerate(self.sym_offsets):
            if o < 0 or (size is not None and o + self.sym_bytes > int(size)):
                raise RuntimeError(f"symmetric workspace of rank {q} at offset {o} does not fit "
                                   f"its allocation ({size} bytes, need {self.sym_bytes})")
        addrs = [p + o for p, o in zip(ptrs, self.sym_offsets)]
        if addrs[self.me] != self.buf.data_ptr():
            raise RuntimeError("symmetric workspace: local address mismatch")
        return addrs

    def describe(self) -> dict:
        """Addresses and sizes, for debugging (ints; a virtual workspace has no handle: its
        buffer pointers are the peer addresses)."""
        h = self.handle
        ptrs = self.peer_addrs if h is None else h.buffer_ptrs
        return {"rank": self.me, "data_ptr": hex(self.buf.data_ptr()),
                "buffer_ptrs": [hex(int(p)) for p in ptrs],
                "handle_offset": getattr(h, "offset", None), "sym_offsets": self.sym_offsets,
                "buffer_size": getattr(h, "buffer_size", None), "sym_bytes": self.sym_bytes,
                "sections": dict(self.offsets), "peer_addrs": [hex(a) for a in self.peer_addrs]}

    def view(self, name: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """Local view of a symmetric section."""
        n = 1
        for s in shape:
            n *= s
        off = self.offsets[name]
        return self.buf[off:off + n * dtype.itemsize].view(dtype).view(shape)

    @property
    def local_base(self) -> int:
        return self.peer_addrs[self.me]

    def nbytes(self) -> int:
        """Device bytes held: symmetric buffer plus local status/counters/pointer table."""
        return (self.sym_bytes + self.status.nbytes + sum(c.nbytes for c in self.counters.values())
                + self.dummy.nbytes + self.peer_bases.nbytes)

    def next_epoch(self, kind: str) -> int:
        """Bump and return the epoch of ``kind`` ('plan', 'pull' or 'push')."""
        if self.poisoned:
            raise RuntimeError(f"workspace unusable after an earlier error: {self.poisoned}")
        self.epoch[kind] += 1
        return self.epoch[kind]

    def wait_flags(self, channel: int, target: int) -> None:
        """Enqueue a device wait until every rank set ``flags[channel] >= target`` here."""
        _, cute = dsl()
        from cutlass import Int32, Int64

        fn = compile_cached(("comm.wait", self.arch), lambda: compile_kernel(
            P.wait_flags_host, Int64(0), Int32(0), Int32(1), Int32(0), Int64(0),
            fake_ptr("i32"), fake_stream(), arch=self.arch)[0])
        fn(Int64(self.local_base + self.offsets["flags"]), Int32(channel), Int32(self.EP),
           Int32(target), Int64(self.timeout_ns), dptr(self.status), current_stream())

    def acquire_src(self, row_bytes: int | None = None) -> torch.Tensor:
        """The local pull-source buffer, once every peer finished the previous pull from it
        (device-side wait on the stream): [T, H] bf16, or with ``row_bytes`` a uint8
        [T, row_bytes] view (MXFP8 rows, :func:`mxfp8_row_bytes`). Write x or dy here, then
        pull. The router-weight section may be written after this wait too."""
        if self.poisoned:
            raise RuntimeError(f"workspace unusable after an earlier error: {self.poisoned}")
        self.wait_flags(P.DONE, self.epoch["pull"])
        if row_bytes is None:
            return self.view("src", torch.bfloat16, (self.T, self.H))
        if row_bytes % 16 or row_bytes > 2 * self.H:
            raise ValueError(f"row_bytes ({row_bytes}) must be a multiple of 16 and <= 2*H")
        return self.view("src", torch.uint8, (self.T, row_bytes))

    def stage_src(self, x: torch.Tensor) -> None:
        """Put ``x`` [T, H] bf16 in the source buffer. If ``x`` already is that buffer, it
        must come from :meth:`acquire_src` for this step (no copy then)."""
        if x.data_ptr() != self.local_base + self.offsets["src"]:
            self.acquire_src().copy_(x)

    def kernel_args(self, tensors: tuple, sections: tuple[str, ...]) -> tuple:
        """A fused kernel's EP arguments for one launch (:class:`~mok_cute.comm.peer_rows.PeerRows`
        order): the peer table, ``tensors`` (torch, wrapped), this rank and the group size, the
        offsets of ``sections``, and the launch's new pull and push epochs (bumped here: once per
        launch)."""
        from cutlass import Int32, Int64

        from mok_cute.dsl.launch import _Desc

        return (_Desc(self.peer_bases), *(_Desc(t) for t in tensors), Int32(self.me), Int32(self.EP),
                *(Int64(self.offsets[s]) for s in sections), Int32(self.next_epoch("pull")),
                Int32(self.next_epoch("push")))

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def check_status(self) -> None:
        """Synchronize the current stream and raise RuntimeError if a comm kernel failed
        (peer timeout naming the peer, bad expert id, capacity overflow)."""
        torch.cuda.current_stream().synchronize()
        msg = P.describe_status(self.status.tolist(), self.timeout_s)
        if msg:
            self.poisoned = msg
            raise RuntimeError(msg)


def mxfp8_row_bytes(H: int) -> int:
    """Bytes of one MXFP8 token row in the pull source: H e4m3 bytes + H/32 E8M0 scale bytes,
    the scales padded to a multiple of 16 bytes."""
    return H + (H // 32 + 15) // 16 * 16


def check_num_ctas(n: int) -> None:
    if not isinstance(n, int) or not 1 <= n <= 132:
        raise ValueError(f"num_ctas must be an int in [1, 132] (4..32 recommended), got {n!r}")


def get_workspace(group=None, *, T: int, H: int, k: int, E: int, dtype=torch.bfloat16,
                  recv_capacity: int | None = None, timeout_s: float = 10.0,
                  num_ctas: int = 32) -> CommWorkspace:
    """The cached :class:`CommWorkspace` for these arguments (collective on first use). With a
    :class:`~mok_cute.comm.virtual.VirtualGroup`: the calling virtual rank's workspace; the
    group's R workspaces are built together by the first rank to ask (:meth:`CommWorkspace.virtual`)
    and cached in the group."""
    args = (T, H, k, E, dtype, recv_capacity, float(timeout_s), num_ctas)
    if isinstance(group, VirtualGroup):
        return group.cached(("comm.workspace",) + args, lambda: CommWorkspace.virtual(group, *args))[group.rank()]
    group = group if group is not None else dist.group.WORLD
    key = (group.group_name,) + args
    ws = _cache.get(key)
    if ws is None:
        ws = _cache[key] = CommWorkspace(group, *args)
    return ws
