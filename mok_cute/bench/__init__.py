"""The layer benchmark: ``python -m mok_cute.bench`` (:mod:`mok_cute.bench.cli`) times the mok_cute
layer against the torch layer a PyTorch user writes (:mod:`mok_cute.bench.torch_layer`) per model
shape (:mod:`mok_cute.bench.shapes`) and precision (:mod:`mok_cute.bench.run`), prints a table and
writes JSON / CSV results and PNG plots (:mod:`mok_cute.bench.report`); ``--peers`` adds other MoE
layers (:mod:`mok_cute.bench.peers`, imported only when asked for) with per-system accuracy against
an fp32 computation (:mod:`mok_cute.bench.accuracy`). API level: it uses only the public API
(``mok_cute.moe``, ``MoKConfig``, ``mok_cute.trace``, and :mod:`mok_cute.reference`'s SwiGLU);
importing it needs no GPU.
"""
