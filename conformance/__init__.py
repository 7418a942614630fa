"""The shared conformance suite: every backend runs the same cases against the reference.

Run it with ``nox -s conformance`` or ``python -m pytest conformance --backend NAME``.
"""
