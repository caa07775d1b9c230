"""Session fixtures that start the real servers once: the prepared SmolLM2 checkpoints and a vLLM server.

Each server binds a free loopback port, has a bounded start-up wait, shows its log when it fails to start,
and is stopped (its whole process group) at the end of the session.
"""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forge.errors import ForgeError
from tests.support.policy_server import started_policy_server
from tests.support.sidecar import SidecarFactory
from trainer.model import PreparedModel, prepare
from trainer.serve import PolicyServer, default_checkpoint, free_port


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
    """A real vLLM (CPU build) server with SmolLM2-135M-Instruct, as `forge serve` starts it (fp32 on a CPU).

    For development only: ``FORGE_TEST_POLICY_PORT`` names a `forge serve --max-model-len 16384` already running on
    that loopback port (several checkouts' test runs then share one server instead of 5 GB each); CI never sets it.
    """
    if port := os.environ.get("FORGE_TEST_POLICY_PORT"):
        yield PolicyServer(model=default_checkpoint(), port=int(port), max_model_len=16384)
        return
    # harness prompts run long
    with started_policy_server(tmp_path_factory.mktemp("vllm"), max_model_len=16384) as server:
        yield server


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[SidecarFactory]:
    """Starts real sidecars (tests/support/sidecar.py) and stops them at the end of the test."""
    factory = SidecarFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture
def vllm(policy_server: PolicyServer) -> Iterator[httpx.Client]:
    """A plain HTTP client on the policy server (raw JSON, so no SDK hides or adds fields)."""
    with httpx.Client(base_url=policy_server.base_url, timeout=120.0) as client:
        yield client


class S3Server:
    """moto's S3-API server on a loopback port; stop() and start() keep its buckets (moto's state is per process)."""

    bucket = "forge-test"

    def __init__(self) -> None:
        self.port = free_port()
        self.server: Any = None
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    import boto3

    server = S3Server()
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    server.start()
    # moto keeps its buckets per process, across servers: start every test from an empty S3.
    httpx.post(f"{server.endpoint}/moto-api/reset", timeout=10).raise_for_status()
    boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=server.bucket)
    yield server
    server.stop()
