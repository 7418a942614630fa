"""Backend-only tools of the cuda backend: the extra benchmark variants (``bench_variants``, read by
``python -m benchmarks``) and the glue kernels' GPU check (``glue_check``). The backend never imports them; the
extension's build is ``backends/cuda/build.py``."""
