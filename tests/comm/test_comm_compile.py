"""Every communication kernel compiles for Hopper and Blackwell (CPU only), with
system-scope acquire/release in the PTX, no spills, and no fused multiply-add in the
fixed-order reductions. Host-side input validation raises before any launch."""
import types

import pytest
import torch

pytest.importorskip("cutlass")

from mok_cute.comm import protocol as P  # noqa: E402
from mok_cute.comm.combine import combine, compile_push_reduce, reverse_dispatch  # noqa: E402
from mok_cute.comm.dispatch import compile_pull, dispatch, reverse_combine  # noqa: E402
from mok_cute.comm.planner import compile_plan  # noqa: E402
from mok_cute.dsl.host import fake_ptr, fake_stream  # noqa: E402
from mok_cute.dsl.compile import compile_kernel  # noqa: E402
from mok_cute.schedule.plan import RankPlan  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402

ARCHS = ["sm_90a", "sm_100a"]


def assert_sys_ordering(rep, waits=True):
    assert rep.total_spill_bytes == 0, rep.spill_bytes
    assert rep.has("st.release.sys") and rep.has("fence.acq_rel.sys")
    if waits:
        assert rep.has("ld.acquire.sys") and rep.has("%globaltimer")
    assert not rep.has(".nc.")


@pytest.mark.parametrize("arch", ARCHS)
def test_pull_compiles(arch):
    _, rep = compile_pull(arch, inspect=True)
    assert_sys_ordering(rep)
    assert rep.has("ld.global.v4") and rep.has("st.global.v4")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("has_w,has_start", [(True, True), (True, False), (False, True), (False, False)])
def test_push_reduce_compiles(arch, has_w, has_start):
    _, rep = compile_push_reduce(arch, has_w, has_start, inspect=True)
    assert_sys_ordering(rep)
    assert not rep.has("fma.rn.f32")
    assert rep.has("add.rn.f32") and rep.has("mul.rn.f32") == has_w


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("E", [8, 384])
def test_plan_compiles(arch, E):
    _, rep = compile_plan(arch, E, inspect=True)
    assert_sys_ordering(rep)
    assert rep.has("match.any.sync")


@pytest.mark.parametrize("arch", ARCHS)
def test_wait_compiles(arch):
    _, rep = compile_kernel(P.wait_flags_host, Int64(0), Int32(0), Int32(1), Int32(0), Int64(0),
                            fake_ptr("i32"), fake_stream(), arch=arch, inspect=True)
    assert rep.total_spill_bytes == 0 and rep.has("ld.acquire.sys") and rep.has("%globaltimer")


def test_describe_status():
    assert P.describe_status([0, 0, 0, 0], 1.0) is None
    msg = P.describe_status([P.TIMEOUT, 3, P.READY, 7], 2.5)
    assert "peer rank 3" in msg and "2.5 s" in msg and "READY" in msg


def fake_ws(T=4, H=16, k=2, E=4, EP=2):
    ws = types.SimpleNamespace(me=0, EP=EP, E=E, T=T, H=H, k=k, device=torch.device("cpu"),
                               num_ctas=8, recv_capacity=EP * T * k)
    i32 = torch.int32
    plan = RankPlan(0, E, EP, T, k, torch.zeros(EP, E, dtype=i32), torch.zeros(E // EP + 1, dtype=i32),
                    torch.zeros(EP * T * k, dtype=i32), torch.zeros(T, k, dtype=i32),
                    torch.zeros(T, k, dtype=i32))
    return ws, plan


def test_validation_before_launch():
    ws, plan = fake_ws()
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        dispatch(ws, x.float(), plan)
    with pytest.raises(ValueError):
        dispatch(ws, x[:3], plan)
    with pytest.raises(TypeError):
        dispatch(ws, x, "plan")
    with pytest.raises(ValueError):
        dispatch(ws, x, plan, num_ctas=0)
    bad = RankPlan(1, 4, 2, 4, 2, plan.counts, plan.offsets, plan.recv_src, plan.dest_rank, plan.dest_row)
    with pytest.raises(ValueError):
        dispatch(ws, x, bad)
    rows = torch.zeros(16, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        combine(ws, rows, torch.zeros(4, 2, dtype=torch.float64), plan)
    with pytest.raises(ValueError):
        combine(ws, rows, torch.zeros(4, 3), plan)
    with pytest.raises(ValueError):
        combine(ws, rows[:, :8], torch.zeros(4, 2), plan)
    with pytest.raises(ValueError):
        reverse_dispatch(ws, rows, plan, dx_shared=torch.zeros(4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("has_w,has_start", [(True, True), (False, False), (True, False), (False, True)])
def test_push_reduce_kernel_shape(has_w, has_start):
    """The launched kernel takes only int64/int32/bf16 pointers and scalars (weights as int32
    bits, no Constexpr parameters), fits 64 registers at 1024 threads, 16-byte vectors."""
    _, rep = compile_push_reduce("sm_90a", has_w, has_start, inspect=True)
    assert rep.registers and all("ptrf32" not in name for name in rep.registers)
    assert rep.max_registers <= 64 and rep.total_spill_bytes == 0
    assert rep.has(".reqntid 1024, 1, 1") and rep.has("st.global.v4")


def test_kernel_parameters_are_the_bundles_flattened():
    """The operand bundles reach the kernel as their fields in order, a None field absent: the
    pull's 18 parameters, the weighted pull's 20 (``w_rows`` and ``w`` present), the push's 22."""
    from mok_cute.comm.combine import compile_push_reduce
    from mok_cute.comm.dispatch import compile_pull_w

    def params(rep):
        entry = rep.ptx[rep.ptx.index(".entry"):]
        return entry[:entry.index(")")].count(".param")

    assert params(compile_pull("sm_90a", inspect=True)[1]) == 18
    assert params(compile_pull_w("sm_90a", inspect=True)[1]) == 20
    assert params(compile_push_reduce("sm_90a", True, True, inspect=True)[1]) == 22


def test_pull_kernel_registers():
    _, rep = compile_pull("sm_90a", inspect=True)
    assert rep.max_registers <= 64 and rep.has(".reqntid 1024, 1, 1")


def test_pull_kernel_closure_and_64bit_peer_address():
    """The pull kernel is built once by closure (like combine) and computes the peer source
    vector address in 64 bits: the byte offset is widened before the *16 (shl.b64), not a
    32-bit element index widened at the end."""
    from mok_cute.comm.dispatch import pull_launcher

    assert pull_launcher() is pull_launcher()
    c, rep = compile_pull("sm_90a", inspect=True)
    ptx = c.__ptx__
    body = ptx[:ptx.index("ld.global.v4")]
    assert "shl.b64" in body.splitlines()[-1] or "shl.b64" in "\n".join(body.splitlines()[-8:])
    assert rep.max_registers <= 64 and rep.total_spill_bytes == 0


# --- weighted pull: rows + router weights ---------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_pull_w_compiles(arch):
    """The weighted pull: same kernel rules as the bf16 pull (closure-built, int64/int32/bf16
    pointers only, 64-bit peer addresses, 1024 threads, no spills); one 16-byte load and store
    per vector, the weight is one more 4-byte peer load."""
    from mok_cute.comm.dispatch import compile_pull_w, pull_w_launcher

    assert pull_w_launcher() is pull_w_launcher()
    c, rep = compile_pull_w(arch, inspect=True)
    assert_sys_ordering(rep)
    assert rep.max_registers <= 64 and rep.has(".reqntid 1024, 1, 1")
    assert rep.registers and all("pull_w_kernel" in n and "ptrf32" not in n and "ptrf8" not in n
                                 for n in rep.registers)
    ptx = c.__ptx__
    assert ptx.count("st.global.v4.b32") == 1 and ptx.count("ld.global.v4.b32") == 1
    assert ptx.count("ld.global.b32") == 3  # the route, the offsets' M and the peer's router weight
    assert "shl.b64" in ptx  # the peer byte offset (t*V + v)*16 in 64 bits


def test_mxfp8_row_bytes():
    from mok_cute.comm.workspace import mxfp8_row_bytes

    assert mxfp8_row_bytes(7168) == 7168 + 224 and mxfp8_row_bytes(4096) == 4096 + 128
    assert mxfp8_row_bytes(64) == 64 + 16 and mxfp8_row_bytes(256) == 256 + 16
    for H in (32, 64, 256, 512, 4096, 7168):
        assert mxfp8_row_bytes(H) % 16 == 0 and mxfp8_row_bytes(H) <= 2 * H  # fits src


def test_dispatch_payload_validation():
    ws, plan = fake_ws(H=64)
    q = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    s = torch.zeros(4, 2, dtype=torch.uint8)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="payload"):
        dispatch(ws, x, plan, payload="fp8")
    with pytest.raises(TypeError, match="uint8"):
        dispatch(ws, x, plan, payload="mxfp8")
    with pytest.raises(TypeError, match="pair"):
        dispatch(ws, (q, s, s), plan, payload="mxfp8")
    with pytest.raises(TypeError, match="x_q"):
        dispatch(ws, (q.view(torch.uint8), s), plan, payload="mxfp8")
    with pytest.raises(ValueError, match="x_s"):
        dispatch(ws, (q, s[:, :1]), plan, payload="mxfp8")
    with pytest.raises(TypeError, match="x_s"):
        dispatch(ws, (q, s.to(torch.int32)), plan, payload="mxfp8")
    with pytest.raises(TypeError, match="topk_w"):
        dispatch(ws, (q, s), plan, payload="mxfp8", topk_w=torch.zeros(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="topk_w"):
        dispatch(ws, x, plan, topk_w=torch.zeros(4, 3))
    ws.local_base, ws.offsets = 1 << 20, {"src": 256}
    staged = torch.zeros(4, 64 + 16, dtype=torch.uint8)  # right shape, not the src section
    with pytest.raises(ValueError, match="acquire_src"):
        dispatch(ws, staged, plan, payload="mxfp8")
    with pytest.raises(ValueError, match="x"):
        dispatch(ws, staged[:, :64], plan, payload="mxfp8")
    ws16, plan16 = fake_ws(H=16)
    with pytest.raises(ValueError, match="H % 32"):
        dispatch(ws16, (q[:, :16], s[:, :0]), plan16, payload="mxfp8")


# --- bulk-copy transport (transport="bulk") --------------------------------------------------

def assert_bulk(rep, ptx):
    """cp.async.bulk peer/global -> shared on an mbarrier, shared -> global in bulk groups,
    every store completed (wait_group 0) and proxy-fenced before the release flag; the ring
    and the mbarriers live in dynamic shared memory."""
    assert rep.total_spill_bytes == 0, rep.spill_bytes
    assert rep.has("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes")
    assert rep.has("cp.async.bulk.global.shared::cta.bulk_group")
    assert rep.has("cp.async.bulk.commit_group") and rep.has("cp.async.bulk.wait_group.read")
    assert rep.has("mbarrier.init.shared") and rep.has("mbarrier.arrive.expect_tx")
    assert rep.has("mbarrier.try_wait.parity") and rep.has("fence.mbarrier_init")
    assert rep.has("__dynamic_shmem__")
    i = ptx.index("cp.async.bulk.wait_group \t0") if "cp.async.bulk.wait_group \t0" in ptx \
        else ptx.index("cp.async.bulk.wait_group 0")
    assert "fence.proxy.async.global" in ptx[i:i + 200]
    assert ptx.index("st.release.sys", i) > i
    assert rep.max_registers <= 64 and rep.has(".reqntid 1024, 1, 1")
    assert rep.registers and all("ptrf32" not in name for name in rep.registers)


@pytest.mark.parametrize("arch", ARCHS)
def test_pull_bulk_compiles(arch):
    from mok_cute.comm.dispatch import compile_pull_bulk, pull_bulk_launcher

    assert pull_bulk_launcher() is pull_bulk_launcher()
    c, rep = compile_pull_bulk(arch, inspect=True)
    assert_sys_ordering(rep)
    assert_bulk(rep, c.__ptx__)
    assert not rep.has("ld.global.v4")  # rows move only by bulk copies
    assert all("pull_bulk_kernel" in name for name in rep.registers)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("has_w,has_start", [(True, True), (False, True), (True, False),
                                             (False, False)])
def test_push_reduce_bulk_compiles(arch, has_w, has_start):
    from mok_cute.comm.combine import compile_push_reduce_bulk

    c, rep = compile_push_reduce_bulk(arch, has_w, has_start, inspect=True)
    assert_sys_ordering(rep)
    assert_bulk(rep, c.__ptx__)
    # the fixed-order reduce is the plain transport's code: same mul.rn/add.rn, no FMA
    assert not rep.has("fma.rn.f32")
    assert rep.has("add.rn.f32") and rep.has("mul.rn.f32") == has_w
    assert all("push_reduce_bulk_kernel" in name for name in rep.registers)


def test_bulk_chunk_geometry():
    """Bulk copies need 16-byte multiples and 16-byte aligned addresses: every row is V*16
    bytes, chunks are BULK_CHUNK (a multiple of 16) apart, and the ring fits BULK_SMEM."""
    from mok_cute.comm import rows as R

    ring = R.BULK_CHUNK * R.BULK_STAGES + 8 * R.BULK_STAGES  # ring + one mbarrier per stage
    assert R.BULK_CHUNK % 16 == 0 and R.BULK_SMEM >= ring
    assert R.BULK_SMEM <= 227 * 1024
    for H in (64, 256, 512, 4096, 7168, 16384):
        rb = H * 2
        sizes = [min(R.BULK_CHUNK, rb - off) for off in range(0, rb, R.BULK_CHUNK)]
        assert all(s % 16 == 0 and 0 < s <= R.BULK_CHUNK for s in sizes) and sum(sizes) == rb


def test_transport_validation():
    """The transport is a validated parameter, the config's values exactly."""
    from mok_cute import config
    from mok_cute.comm.rows import TRANSPORTS, check_transport

    assert TRANSPORTS == config.TRANSPORTS == ("plain", "bulk")
    assert check_transport("plain") == "plain" and check_transport("bulk") == "bulk"
    for bad in ("bulk_pull", "Bulk", "tma?", None):
        with pytest.raises(ValueError, match="transport"):
            check_transport(bad)
    ws, plan = fake_ws()
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="transport"):
        dispatch(ws, x, plan, transport="bulk_pull")
    with pytest.raises(ValueError, match="transport"):
        combine(ws, torch.zeros(16, 16, dtype=torch.bfloat16), torch.zeros(4, 2), plan, transport="tma")


def test_plain_transport_unchanged():
    """The default kernels carry no bulk copies and no shared memory (the verified path)."""
    for _, rep in (compile_pull("sm_90a", inspect=True),
                   compile_push_reduce("sm_90a", True, True, inspect=True)):
        assert not rep.has("cp.async.bulk") and not rep.has("mbarrier")
        assert not rep.has("__dynamic_shmem__")


@pytest.mark.parametrize("transport,pull_key,push_key", [
    (None, "comm.pull", "comm.push_reduce"),
    ("plain", "comm.pull", "comm.push_reduce"),
    ("bulk", "comm.pull_bulk", "comm.push_reduce_bulk")])
def test_transport_picks_kernel(monkeypatch, transport, pull_key, push_key):
    """The ``transport`` parameter (default "plain") picks the compiled kernel per call (host
    side, before any launch), for the bf16 and the MXFP8 pull alike; the weighted dispatch always
    takes the weighted pull. The environment has no say: a stale ``MOK_COMM_TRANSPORT`` is ignored."""
    import mok_cute.comm.combine as C
    import mok_cute.comm.dispatch as D

    class Picked(Exception):
        pass

    def fake_cached(key, build):
        raise Picked(key[0])

    monkeypatch.setenv("MOK_COMM_TRANSPORT", "plain" if transport == "bulk" else "bulk")
    kw = {} if transport is None else {"transport": transport}
    monkeypatch.setattr(D, "compile_cached", fake_cached)
    monkeypatch.setattr(C, "compile_cached", fake_cached)
    ws, plan = fake_ws(H=64)
    ws.arch, ws.dummy = "sm_90a", torch.zeros(16, dtype=torch.int32)
    ws.next_epoch = lambda kind: 1
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    q, sc = torch.zeros(4, 64, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.uint8)
    ws.acquire_src = lambda rb: torch.zeros(4, rb, dtype=torch.uint8)
    ws.stage_src = lambda rows: None
    ws.view = lambda name, dtype, shape: torch.zeros(shape, dtype=dtype)
    with pytest.raises(Picked, match=f"^{pull_key}$"):
        dispatch(ws, x, plan, **kw)
    with pytest.raises(Picked, match=f"^{pull_key}$"):
        dispatch(ws, (q, sc), plan, payload="mxfp8", **kw)
    with pytest.raises(Picked, match="^comm.pull_w$"):
        dispatch(ws, x, plan, topk_w=torch.zeros(4, 2), **kw)
    with pytest.raises(Picked, match="^comm.pull_w$"):
        dispatch(ws, (q, sc), plan, payload="mxfp8", topk_w=torch.zeros(4, 2), **kw)
    with pytest.raises(Picked, match=f"^{pull_key}$"):
        reverse_combine(ws, x, plan, **kw)
    with pytest.raises(Picked, match=f"^{push_key}$"):
        combine(ws, torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(4, 2), plan, **kw)
    with pytest.raises(Picked, match=f"^{push_key}$"):
        reverse_dispatch(ws, torch.zeros(16, 64, dtype=torch.bfloat16), plan, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_pull_issues_every_load_before_a_store(arch):
    """The pull (kernel ``pull_kernel``): UNROLL (8) 16-byte peer loads per trip, all before its
    stores; system-scope ordering; no spills."""
    from mok_cute.comm.dispatch import pull_launcher
    from mok_cute.comm.rows import UNROLL

    assert pull_launcher() is pull_launcher() and UNROLL == 8
    _, rep = compile_pull(arch, inspect=True)
    assert_sys_ordering(rep)
    assert rep.total_spill_bytes == 0
    assert rep.registers and all("pull_kernel" in name for name in rep.registers)
    moves = [ln.split()[0] for ln in rep.ptx.splitlines() if "ld.global.v4" in ln or "st.global.v4" in ln]
    assert moves == ["ld.global.v4.b32"] * UNROLL + ["st.global.v4.b32"] * UNROLL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("has_w,has_start", [(True, True), (False, False)])
def test_push_reduce_pushes_unrolled(arch, has_w, has_start):
    """The push half keeps UNROLL (8) 16-byte loads in flight before its peer stores; the same
    fixed-order reduce (mul.rn / add.rn, no FMA)."""
    from mok_cute.comm.rows import UNROLL

    _, rep = compile_push_reduce(arch, has_w, has_start, inspect=True)
    assert_sys_ordering(rep)
    assert rep.total_spill_bytes == 0
    assert rep.registers and all("push_reduce_kernel" in name for name in rep.registers)
    assert not rep.has("fma.rn.f32") and rep.has("add.rn.f32")
    moves = [ln.split()[0] for ln in rep.ptx.splitlines() if "ld.global.v4" in ln or "st.global.v4" in ln]
    assert moves[:2 * UNROLL] == ["ld.global.v4.b32"] * UNROLL + ["st.global.v4.b32"] * UNROLL


def test_no_comm_module_reads_the_environment():
    """Decisions live in code and parameters: no comm / schedule module reads os.environ."""
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[2] / "mok_cute"
    for folder in ("comm", "schedule"):
        for path in sorted((pkg / folder).glob("*.py")):
            assert "environ" not in path.read_text(), path
