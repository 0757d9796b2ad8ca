"""tools.ncu_step on the CPU: the ncu command line it runs and the parsing of ncu's raw CSV page."""
import sys

from tools import ncu_step

CSV = '''==PROF== Connected to process 123
warm-up output of the child
"ID","Kernel Name","gpu__time_duration.sum","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed","sm__cycles_elapsed.avg.per_second"
"","","nsecond","%","cycle/usecond"
"0","kernel_cutlass_count_kernel_tensorptri32","3,520","0","1,755.2"
"1","kernel_cutlass_kernel_mok_cutekernelssm90fused_moeFusedMoeFwdSm90_object","2,429,100","71.25","1,620"
==PROF== Disconnected from process 123
'''


def test_command_profiles_the_child_between_profiler_start_and_stop():
    argv = ["--shape", "qwen3-30b-a3b", "--bwd", "--kernels", "Fused", "--metrics", "a.b", "c.d"]
    args = ncu_step.parse_args(argv)
    cmd = ncu_step.ncu_command(args, argv)
    assert cmd[:7] == ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page"]
    assert cmd[cmd.index("--metrics") + 1] == "a.b,c.d"
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:Fused"
    assert cmd[cmd.index(sys.executable):] == [sys.executable, "-m", "tools.ncu_step", "--child", *argv]
    assert "--kernel-name" not in ncu_step.ncu_command(ncu_step.parse_args([]), [])


def test_rows_read_the_raw_page_in_microseconds():
    metrics = ["gpu__time_duration.sum", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed"]
    rows = ncu_step.rows_of(CSV, metrics)
    assert [r["name"][:24] for r in rows] == ["kernel_cutlass_count_ker", "kernel_cutlass_kernel_mo"]
    assert rows[0]["gpu__time_duration.sum"] == 3.52 and rows[1]["gpu__time_duration.sum"] == 2429.1
    assert rows[1][metrics[1]] == 71.25 and rows[1][metrics[2]] is None
    clock = ncu_step.rows_of(CSV, ["sm__cycles_elapsed.avg.per_second"])
    assert abs(clock[1]["sm__cycles_elapsed.avg.per_second"] - 1.62) < 1e-9
    assert "| FusedMoeFwd | 1.62 |" in ncu_step.table(clock, ["sm__cycles_elapsed.avg.per_second"])
    text = ncu_step.table(rows, metrics)
    assert "| FusedMoeFwd | 2429.1 | 71.2 | - |" in text and "| us | tensor pipe % |" in text
    assert ncu_step.rows_of("no csv here\n", metrics) == []


def test_a_missing_ncu_is_named(capsys):
    assert ncu_step.main(["--ncu", "/nonexistent/ncu"]) == 2
    assert "no ncu executable '/nonexistent/ncu'" in capsys.readouterr().err
