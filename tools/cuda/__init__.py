"""Tools of the cuda backend: the glue kernels' GPU check (``python -m tools.cuda.glue_check``). The extension's
build is runtime code of the backend (``backends/cuda/build.py``)."""
