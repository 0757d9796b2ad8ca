"""The compiled-kernel cache on disk (mok_cute.dsl.disk_cache, under compile.compile_cached), on the CPU with a
tiny kernel compiled for sm_90a into a temporary directory: a second lookup loads instead of compiling, every part
of the key makes a new entry, a damaged entry is rebuilt with a warning, two processes writing one entry leave one
whole entry, ``off`` writes nothing, and a loaded function is called like the compiled one (same class, same
call-path state, the same argument bytes). Launching a loaded kernel needs a GPU (see the module doc)."""
import contextlib
import ctypes
import json
import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402

from mok_cute.dsl import compile as kc  # noqa: E402
from mok_cute.dsl import disk_cache as dc  # noqa: E402
from mok_cute.dsl import env  # noqa: E402
from mok_cute.dsl.host import fake_stream  # noqa: E402
from mok_cute.dsl.launch import GraphLauncher  # noqa: E402

KEY = ("test_disk_cache.tiny", "sm_90a")


@cute.kernel
def _add_one(x: cute.Tensor, n: Int32):
    tid, _, _ = cute.arch.thread_idx()
    if tid < n:
        x[tid] = x[tid] + Int32(1)


@cute.jit
def launch(x: cute.Tensor, n: Int32, stream: cuda.CUstream):
    _add_one(x, n).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


def tiny(key=KEY, arch="sm_90a", inspect=False):
    """The tiny kernel through compile_cached (as every mok_cute kernel): ``(compiled, report)``."""
    fake = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    return kc.compile_cached(key, lambda: kc.compile_kernel(launch, fake, Int32(1), fake_stream(), arch=arch,
                                                            inspect=inspect))


def new_process():
    """Forget this process's in-memory compiled objects (what a new process starts with)."""
    kc._cache.clear()


def compiles() -> int:
    return kc.cache_stats()["kernel_compiles"]


def entries(root: Path) -> list[Path]:
    return list(dc._entries(root))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory (MOK_CUTE_CACHE_DIR, restored after), empty in-memory caches and counters."""
    root = tmp_path / "cache"
    monkeypatch.setenv(env.CACHE_DIR, str(root))
    monkeypatch.setattr(kc, "_cache", {})
    monkeypatch.setattr(kc, "_stats", dict.fromkeys(kc._stats, 0))
    monkeypatch.setattr(dc, "_stats", dict.fromkeys(dc._stats, 0))
    monkeypatch.setattr(dc, "_state", dict.fromkeys(dc._state, False))
    monkeypatch.setattr(dc, "_warned", set())
    return root


# ---------------------------------------------------------------- hit and miss
def test_miss_compiles_and_stores_then_hit_loads(cache):
    first, _ = tiny()
    assert compiles() == 1 and dc.stats()["stores"] == 1 and dc.stats()["misses"] == 1
    (entry,) = entries(cache)
    assert sorted(p.name for p in entry.iterdir()) == sorted([dc.META, dc.OBJECT])
    new_process()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = tiny()
    assert compiles() == 1, "the second lookup compiled"
    assert dc.stats()["hits"] == 1
    assert type(again) is type(first) and again is not first
    assert tiny()[0] is again  # then from memory, as before


def test_inspect_report_comes_back_from_disk(cache):
    _, rep = tiny(inspect=True)
    new_process()
    _, loaded = tiny(inspect=True)
    assert compiles() == 1
    assert loaded == rep and loaded.registers and ".entry" in loaded.ptx


def test_compile_outside_compile_cached_bypasses_the_disk(cache):
    fake = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    kc.compile_kernel(launch, fake, Int32(1), fake_stream(), arch="sm_90a")
    assert compiles() == 1 and not cache.exists()


def test_each_compile_kernel_call_of_a_build_is_its_own_entry(cache):
    fake = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)

    def two():
        return [kc.compile_kernel(launch, fake, Int32(1), fake_stream(), arch=a)[0] for a in ("sm_90a", "sm_100a")]
    kc.compile_cached(("two",), two)
    new_process()
    kc.compile_cached(("two",), two)
    assert compiles() == 2 and dc.stats()["hits"] == 2 and len(entries(cache)) == 2


# ---------------------------------------------------------------- the key
@pytest.mark.parametrize("change", ["source", "dsl_version", "dsl_settings", "host_cpu", "arch", "compile_key",
                                    "inspect"])
def test_every_part_of_the_key_makes_a_new_entry(cache, monkeypatch, change):
    tiny()
    new_process()
    variant = {"arch": dict(arch="sm_100a"), "compile_key": dict(key=KEY + ("other",)),
               "inspect": dict(inspect=True)}.get(change, {})
    with monkeypatch.context() as m:
        if change in ("source", "dsl_version", "dsl_settings", "host_cpu"):
            m.setattr(dc, {"source": "source_hash"}.get(change, change), lambda: "changed")
        tiny(**variant)
        assert compiles() == 2, f"a changed {change} loaded the old entry"
        assert len(entries(cache)) == 2
    new_process()
    tiny()  # back to the first key: its entry is still there
    assert compiles() == 2


def test_source_hash_covers_kernel_code_not_layers(tmp_path):
    pkg = tmp_path / "pkg"
    for rel in ("kernels/k.py", "dsl/d.py", "layers/l.py", "ops.py", "trace.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("x = 1\n")
    h = dc.source_hash.__wrapped__  # uncached

    def edited(rel, text="x = 2\n"):
        old = (pkg / rel).read_text()
        (pkg / rel).write_text(text)
        try:
            return h(pkg)
        finally:
            (pkg / rel).write_text(old)
    base = h(pkg)
    assert edited("kernels/k.py") != base and edited("dsl/d.py") != base and edited("trace.py") != base
    assert edited("layers/l.py") == base and edited("ops.py") == base
    (pkg / "kernels" / "__pycache__").mkdir()
    (pkg / "kernels" / "__pycache__" / "k.py").write_text("y")
    (pkg / "kernels" / "new.py").write_text("")
    assert h(pkg) != base  # a new file counts, __pycache__ does not
    (pkg / "kernels" / "new.py").unlink()
    assert h(pkg) == base


def test_a_key_that_cannot_persist_stays_in_memory(cache):
    with pytest.warns(UserWarning, match="memory address"):
        tiny(key=("tiny", object()))
    assert compiles() == 1 and not entries(cache) and dc.stats()["unkeyed"] == 1


def test_a_key_that_cannot_be_made_compiles(cache, monkeypatch):
    def broken():
        raise ImportError("no DSL settings")
    monkeypatch.setattr(dc, "dsl_settings", broken)
    with pytest.warns(UserWarning, match="no disk cache key"):
        tiny()
    assert compiles() == 1 and not entries(cache)


def test_key_parts_are_json_and_name_the_kernel(cache):
    parts = dc.entry_key(KEY, 0, launch, "sm_90a", False, {})
    assert json.loads(json.dumps(parts)) == parts
    assert parts["function"].endswith(".launch") and parts["outside_source"]  # this file is outside mok_cute
    assert dc.digest(parts) != dc.digest(dict(parts, call=1))


# ---------------------------------------------------------------- damage
def _truncate(entry):
    obj = entry / dc.OBJECT
    obj.write_bytes(obj.read_bytes()[: obj.stat().st_size // 2])


def _other_key(entry):
    meta = json.loads((entry / dc.META).read_text())
    meta["key"]["call"] = 7
    (entry / dc.META).write_text(json.dumps(meta))


DAMAGE = {
    "truncated object": _truncate,
    "flipped byte": lambda e: (e / dc.OBJECT).write_bytes(b"\0" + (e / dc.OBJECT).read_bytes()[1:]),
    "garbage meta": lambda e: (e / dc.META).write_text("{not json"),
    "no meta": lambda e: (e / dc.META).unlink(),
    "no object": lambda e: (e / dc.OBJECT).unlink(),
    "meta of another key": _other_key,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_rebuilt_with_a_warning(cache, damage):
    tiny()
    (entry,) = entries(cache)
    DAMAGE[damage](entry)
    new_process()
    with pytest.warns(UserWarning, match="unusable"):
        tiny()
    assert compiles() == 2 and dc.stats()["rebuilt"] == 1
    (entry,) = entries(cache)
    dc.read_entry(entry, json.loads((entry / dc.META).read_text())["key"])  # whole again
    new_process()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny()
    assert compiles() == 2


def test_a_failed_load_warns_once_and_compiles(cache, monkeypatch):
    """What only a GPU can show (the loaded module's CUDA library load) failing: a run never breaks."""
    tiny()

    def broken(path, meta):
        raise RuntimeError("cudaLibraryLoadData failed")
    monkeypatch.setattr(dc, "load", broken)
    new_process()
    with pytest.warns(UserWarning, match="could not load") as caught:
        tiny()
        new_process()
        tiny()
    assert len(caught) == 1 and compiles() == 3 and dc.stats()["load_failures"] == 1


def test_an_unwritable_directory_warns_once(tmp_path, cache, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "file" / "cache"))
    with pytest.warns(UserWarning, match="cannot write") as caught:
        tiny()
        new_process()
        tiny()
    assert len(caught) == 1 and compiles() == 2


def test_a_kernel_that_cannot_be_exported_is_compiled_each_time(cache, monkeypatch):
    def refuse(compiled, prefix):
        raise ValueError("signature cannot be pickled")
    monkeypatch.setattr(dc, "export", refuse)
    with pytest.warns(UserWarning, match="cannot be exported") as caught:
        tiny()
        new_process()
        tiny()
    assert len(caught) == 1 and compiles() == 2 and not entries(cache)


def test_a_second_writer_keeps_the_first_entry(tmp_path):
    d = tmp_path / "v1" / "ab" / "abcd"
    meta = {"format": dc.FORMAT, "key": {}, "object": dc._file(b"first")}
    assert dc.write_entry(d, meta, b"first", None) is True
    assert dc.write_entry(d, dict(meta, object=dc._file(b"second")), b"second", None) is False
    assert (d / dc.OBJECT).read_bytes() == b"first"
    assert sorted(p.name for p in d.parent.iterdir()) == ["abcd"]  # the loser's temporary copy is gone


# ---------------------------------------------------------------- two processes
PHASES = {"lock": True, "rename_only": False}  # rename_only: no flock, both compile, the rename decides


def _writer(barrier, results):
    """Child process: each phase, compile the tiny kernel under a phase key at the same moment as the other."""
    for phase, lock in PHASES.items():
        if not lock:
            dc._entry_lock = lambda d: contextlib.nullcontext()
        barrier.wait()
        before = kc.cache_stats()
        compiled, _ = tiny(key=KEY + (phase,))
        after = kc.cache_stats()
        results.put((phase, type(compiled).__name__, {k: after[k] - before[k] for k in ("disk_stores", "kernel_compiles")}))


def test_two_processes_writing_one_entry(cache):
    ctx = multiprocessing.get_context("spawn")  # not fork: this process runs the DSL's threads
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(2 * len(PHASES))]
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    for phase in PHASES:
        mine = [(name, counts) for ph, name, counts in got if ph == phase]
        assert [name for name, _ in mine] == ["CudaDialectJitCompiledFunction"] * 2, phase
        assert sum(c["disk_stores"] for _, c in mine) == 1, phase  # one entry written, the other writer's dropped
        if PHASES[phase]:  # the other process waited for the lock, then loaded
            assert sum(c["kernel_compiles"] for _, c in mine) == 1
    assert len(entries(cache)) == len(PHASES)
    assert not [p for p in (cache / dc.ROOT).rglob(".*") if p.is_dir()]  # no temporary copy left
    for phase in PHASES:
        tiny(key=KEY + (phase,))  # this process loads what the others wrote
    assert compiles() == 0 and dc.stats()["hits"] == len(PHASES)


# ---------------------------------------------------------------- off
def test_off_writes_nothing(tmp_path, cache, monkeypatch):
    for value in ("off", "OFF", "0"):
        monkeypatch.setenv(env.CACHE_DIR, value)
        assert env.cache_dir() is None and dc.directory() is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    tiny()
    new_process()
    tiny()
    assert compiles() == 2 and dc.stats() == dict.fromkeys(dc.stats(), 0)
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists() and not cache.exists()


def test_cache_dir_default_and_paths(tmp_path, monkeypatch):
    """On by default (unset, empty, ``on``: the user's cache directory); a path as given."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for unset in (None, "", "  ", "on", "ON"):
        if unset is None:
            monkeypatch.delenv(env.CACHE_DIR, raising=False)
        else:
            monkeypatch.setenv(env.CACHE_DIR, unset)
        assert env.cache_dir() == str(tmp_path / "xdg" / "mok_cute")
    monkeypatch.setenv(env.CACHE_DIR, "on")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert env.cache_dir() == str(tmp_path / "home" / ".cache" / "mok_cute")
    monkeypatch.setenv(env.CACHE_DIR, "~/kernels")
    assert env.cache_dir() == str(tmp_path / "home" / "kernels")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(env.CACHE_DIR, "rel")
    assert env.cache_dir() == str(tmp_path / "rel")


# ---------------------------------------------------------------- the loaded function is called as the compiled one
_CALL_STATE = ("signature", "_pointer_address_arg_specs", "_compiled_with_none", "_has_pointer_address_arg_specs",
               "_jit_arg_adapter_scope", "_full_arg_check")


def call_path(fn) -> dict:
    """Everything the DSL's call path (``fn(*args)``: argument marshalling, then the host function) reads
    from a compiled function, but its host symbol's name (the loaded one's carries the export prefix)."""
    ea, meta = fn.execution_args, fn.execution_args._meta
    return {"class": type(fn), **{n: str(getattr(ea, n)) for n in _CALL_STATE},
            "meta": (meta.all_names, meta.annotated_types, meta.numeric_flags, meta.arg_count),
            "total_added_arguments": fn.total_added_arguments, "kernel_extra_args": fn.kernel_extra_args,
            "kernel_info": dict(fn.kernel_info), "has_gpu_module": fn.has_gpu_module,
            "pyir_spec": fn._pyir_spec}


def test_loaded_function_has_the_compiled_call_path(cache):
    compiled, _ = tiny()
    new_process()
    loaded, _ = tiny()
    assert compiles() == 1 and loaded.load_from_binary and not compiled.load_from_binary
    assert call_path(loaded) == call_path(compiled)
    assert all(f is not None for f in loaded._get_cuda_init_and_load())  # its CUDA library loaders are there
    assert GraphLauncher(loaded).compiled is loaded


def test_loaded_function_packs_the_same_argument_bytes(cache):
    compiled, _ = tiny()
    new_process()
    loaded, _ = tiny()
    x = from_dlpack(torch.arange(8, dtype=torch.int32), assumed_align=4).mark_layout_dynamic(leading_dim=0)
    sizes = (12, 4, 8)  # the tensor's {data, i32 shape}, the Int32, the stream handle

    def packed(fn):
        ptrs, _ = fn.generate_execution_args(x, Int32(5), cuda.CUstream(0))
        assert len(ptrs) == len(sizes)
        return [ctypes.string_at(p.value if isinstance(p, ctypes.c_void_p) else p, n) for p, n in zip(ptrs, sizes)]
    assert packed(loaded) == packed(compiled)


def test_a_real_kernel_loads_with_the_compiled_call_path(cache):
    """A communication kernel (NamedTuple bundles of pointers, an optional None field) round-trips too."""
    from mok_cute.comm.dispatch import compile_pull

    compiled = kc.compile_cached(("comm.pull", "sm_90a"), lambda: compile_pull("sm_90a")[0])
    new_process()
    loaded = kc.compile_cached(("comm.pull", "sm_90a"), lambda: compile_pull("sm_90a")[0])
    assert compiles() == 1 and dc.stats()["hits"] == 1
    assert call_path(loaded) == call_path(compiled)

