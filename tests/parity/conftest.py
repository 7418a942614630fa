"""Parity with vLLM's own pure-torch code, read from its source distribution (``nox -s parity -- --vllm X``)."""

import pytest

from reference.semantics import SemanticsVersion
from tests.parity._vllm_src import tree, version


@pytest.fixture(scope="session")
def vllm_tree():
    return tree()


@pytest.fixture(scope="session")
def vllm_version(vllm_tree) -> str:
    return version(vllm_tree)


@pytest.fixture(scope="session")
def semantics(vllm_version) -> SemanticsVersion:
    """The reference's semantics version for this vLLM release (its major.minor); skips when none is specified."""
    try:
        return SemanticsVersion.parse(".".join(vllm_version.split(".")[:2]))
    except ValueError:
        pytest.skip(f"the reference specifies no semantics version for vLLM {vllm_version} "
                    f"(versions: {', '.join(v.value for v in SemanticsVersion)})")
