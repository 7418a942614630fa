"""Backend-only tools of the triton backend (GPU scripts run as ``python3 -m backends.triton.tools.<name>``); they
time through ``benchmarks.timing`` and import nothing that touches a GPU at import time."""
