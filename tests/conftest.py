"""Session fixtures that start the real servers once: the prepared SmolLM2 checkpoints and a vLLM server.

Each server binds a free loopback port, has a bounded start-up wait, shows its log when it fails to start,
and is stopped (its whole process group) at the end of the session.
"""

from collections.abc import Iterator

import httpx
import pytest

from forge.errors import ForgeError
from trainer.model import PreparedModel, prepare
from trainer.serve import PolicyServer, free_port

VLLM_START_TIMEOUT_S = 300.0


@pytest.fixture(scope="session")
def prepared_model() -> PreparedModel:
    """The bf16/fp32 checkpoints (`make test` prepares them first; this is then only a check)."""
    try:
        return prepare(log=lambda *_: None)
    except ForgeError as error:
        pytest.fail(f"cannot prepare the model: {error}")


@pytest.fixture(scope="session")
def tokenizer(prepared_model: PreparedModel):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepared_model.serve_dir, local_files_only=True)


@pytest.fixture(scope="session")
def policy_server(prepared_model: PreparedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServer]:
    """A real vLLM (CPU build) server with SmolLM2-135M-Instruct, as `forge serve` starts it."""
    server = PolicyServer(
        model=prepared_model.serve_dir, port=free_port(), max_model_len=4096,
        run_dir=tmp_path_factory.mktemp("vllm"), start_timeout=VLLM_START_TIMEOUT_S,
    )  # fmt: skip
    try:
        server.start()
    except ForgeError as error:
        pytest.fail(f"the vLLM server did not start: {error}")
    yield server
    server.stop()


@pytest.fixture
def vllm(policy_server: PolicyServer) -> Iterator[httpx.Client]:
    """A plain HTTP client on the policy server (raw JSON, so no SDK hides or adds fields)."""
    with httpx.Client(base_url=policy_server.base_url, timeout=120.0) as client:
        yield client
