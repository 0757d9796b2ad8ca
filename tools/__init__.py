"""Tools for kernel authors, each run as a module from the repository root (``python -m tools.<name>``):
the device checks (``gpu_check``, ``checks/``), benchmarks (``bench_expert_mlp``, ``bench_layer_ep``,
``bench_comm``, ``bench_dispatch``, ``compare_trees``, ``mem_peak``, ``profile_fwd``), the PTX manifest
(``ptx_manifest``) and the Blackwell compile table (``blackwell_readiness``). The user's benchmark is
``python -m mok_cute.bench``; the trace viewer ``python -m mok_cute.trace``.
"""
