"""Tools of the triton backend (GPU scripts run as ``python3 -m tools.triton.<name>``): ``tune`` (the tuned tables
of ``backends/triton/configs/``), ``sm90`` (compile for sm_90 without a GPU), ``profile`` (Nsight Compute, per-kernel
breakdown), ``fp8_accum`` (FP8 accumulation), ``common`` (their shapes, weights, inputs and timer). They time
through ``benchmarks.timing`` and import nothing that touches a GPU at import time."""
