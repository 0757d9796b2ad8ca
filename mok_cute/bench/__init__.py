"""The layer benchmark: ``python -m mok_cute.bench`` (:mod:`mok_cute.bench.cli`) times the mok_cute
layer against the torch layer a PyTorch user writes (:mod:`mok_cute.bench.torch_layer`) per model
shape (:mod:`mok_cute.bench.shapes`) and precision (:mod:`mok_cute.bench.run`), prints a table and
writes JSON / CSV results and PNG plots (:mod:`mok_cute.bench.report`). API level: it uses only the
public API (``mok_cute.moe``, ``MoKConfig``, ``mok_cute.trace``); importing it needs no GPU.
"""
