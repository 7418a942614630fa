"""Backend-only tools of the cuda backend: the glue kernels' GPU check (``glue_check``). The backend never imports
them; the extension's build is ``backends/cuda/build.py``."""
