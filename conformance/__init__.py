"""The shared conformance suite: every backend runs the same cases against the reference.

Run it with ``nox -s conformance`` or ``python -m pytest conformance --backend NAME``.
"""

import os as _os

# Backends that validate routes on the host only on request (a device->host copy the hot path avoids; e.g.
# DeepGemmExperts.validate_routes) validate them under the suite, so a bad input raises a clear error here.
_os.environ.setdefault("MOE_VALIDATE_ROUTES", "1")
