"""The pytest-benchmark performance suite of the fused-MoE backends (``nox -s benchmark``; docs/BENCHMARKS.md).

Modules:
    shapes    the canonical benchmark shapes (perf-anchors.md), their CPU scale-downs, the router-gate shapes, and
              the environment knobs that select a subset
    timing    device-time measurement (CUDA graphs or CUDA events, rotating input sets, median of many rounds),
              the timer pytest-benchmark stores, the ceilings (copy bandwidth, matmul throughput) measured once
    roofline  FLOPs, bytes and the floor of each case
    report    the side-by-side table (ratios to the best backend and to the floor), results JSON / markdown
    plot      ``python -m benchmarks.plot results/benchmark-<gpu>.json``: the roofline plot (PNG)
"""
