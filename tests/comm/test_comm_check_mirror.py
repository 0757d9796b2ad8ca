"""tools/checks/comm.py's reference side on CPU: its correctness rows run with torch mirrors of
the comm ops (one rank, EP = 1, the single-process mode) and must all pass, bitwise; a mirror
that moves one wrong byte must fail the matching row. Guards the device check's own logic
(MXFP8 byte gathers, router-weight rows, short row names) before a GPU run."""
import pytest
import torch

pytest.importorskip("cutlass")

import tools.checks.comm as C  # noqa: E402
from tools.checks.common import Ctx  # noqa: E402
from mok_cute.schedule.plan import plan_routing  # noqa: E402


class _WS:
    def __init__(self, T, H, k, E):
        self.T, self.H, self.k, self.E, self.EP, self.me = T, H, k, E, 1, 0
        self.recv_capacity, self.device, self.epoch = T * k, torch.device("cpu"), {"pull": 0}

    def describe(self):
        return {}

    def check_status(self):
        pass


def _install_mirrors(monkeypatch, corrupt=None):
    """Torch mirrors of plan / dispatch (bf16, mxfp8, topk_w) / combine / reverse paths."""
    def plan_dev(ws, idx):
        v = plan_routing([idx.cpu()], ws.E, 1).rank_view(0)
        rs = torch.full((ws.recv_capacity,), 7, dtype=torch.int32)  # junk past M
        rs[:v.recv_src.numel()] = v.recv_src
        v.recv_src = rs
        return v

    def pull(ws, x, plan):
        m = int(plan.offsets[-1])
        out = torch.empty((ws.recv_capacity,) + tuple(x.shape[1:]), dtype=x.dtype)
        out[:m] = x[plan.recv_src[:m].long() // ws.k]
        return out

    def dispatch(ws, x, plan, payload="bf16", topk_w=None, num_ctas=None, transport="plain"):
        if payload == "mxfp8":
            res = (pull(ws, x[0], plan), pull(ws, x[1], plan))
        else:
            res = (pull(ws, x, plan),)
        if corrupt == payload and int(plan.offsets[-1]):
            res[-1].view(torch.uint8)[0, 0] ^= 1
        if topk_w is not None:
            m = int(plan.offsets[-1])
            w = torch.zeros(ws.recv_capacity)
            w[:m] = topk_w.reshape(-1)[plan.recv_src[:m].long()]
            res += (w,)
        return res if len(res) > 1 else res[0]

    def reduce(ws, rows, plan, w, start):
        m = int(plan.offsets[-1])
        slots = torch.zeros(ws.T * ws.k, ws.H, dtype=torch.bfloat16)
        slots[plan.recv_src[:m].long()] = rows[:m]
        return C._ref_reduce(slots.view(ws.T, ws.k, -1), plan.dest_rank >= 0, w, start)

    monkeypatch.setattr(C, "get_workspace", lambda T, H, k, E, **kw: _WS(T, H, k, E))
    monkeypatch.setattr(C, "plan_routing_device", plan_dev)
    monkeypatch.setattr(C, "dispatch", dispatch)
    monkeypatch.setattr(C, "reverse_combine", lambda ws, dy, plan, num_ctas=None, transport="plain":
                        pull(ws, dy, plan))
    monkeypatch.setattr(C, "combine", lambda ws, eo, w, plan, sh=None, num_ctas=None, transport="plain":
                        reduce(ws, eo, plan, w, sh))
    monkeypatch.setattr(C, "reverse_dispatch", lambda ws, dxe, plan, sh=None, num_ctas=None, transport="plain":
                        reduce(ws, dxe, plan, None, sh))


CASES = [("random", 32, 64, 4, 8), ("hot", 16, 64, 4, 4), ("rank0_empty", 16, 64, 2, 4),
         ("random", 1, 64, 2, 2)]


@pytest.mark.parametrize("case", CASES)
def test_check_rows_pass_with_mirrors(monkeypatch, case):
    _install_mirrors(monkeypatch)
    rows = C._correctness(Ctx(0, 1, torch.device("cpu"), "cpu"), *case)
    names = [r.name for r in rows]
    assert all(r.ok and r.bitwise for r in rows), [(r.name, r.note) for r in rows if not r.ok]
    assert len(set(n[:44] for n in names)) == len(names)  # distinct in the 44-char table
    for part in ("mx data", "mx scales", "mx+w w", "disp+w w_rows", "5 reps"):
        assert any(part in n for n in names), part


@pytest.mark.parametrize("payload,row", [("mxfp8", "mx scales"), ("bf16", "] dispatch")])
def test_check_rows_catch_a_wrong_byte(monkeypatch, payload, row):
    _install_mirrors(monkeypatch, corrupt=payload)
    rows = C._correctness(Ctx(0, 1, torch.device("cpu"), "cpu"), *CASES[0])
    bad = [r for r in rows if row in r.name]
    assert bad and not any(r.ok for r in bad) and "rows differ" in bad[0].note
