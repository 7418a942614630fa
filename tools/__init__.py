"""The laboratory: tuners, profilers, probes and checks of the backends (``tools/<backend>/``), the GPU-session
scripts (``tools/gpu/``) and the one-off diagnosis scripts (``tools/diag/``).

Tools sit on top of the layers (DESIGN.md, Layout): they may import anything below (specs, reference, backends,
benchmarks, conformance); nothing imports them. Run them from the repository root, e.g.
``python -m tools.triton.tune --help``.
"""
