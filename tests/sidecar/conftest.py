"""The fake upstream (bench/fake_upstream.py) as a fixture; `start_sidecar` is the root conftest's."""

from collections.abc import Iterator

import pytest

from bench.fake_upstream import FakeUpstream


@pytest.fixture
def fake_upstream() -> Iterator[FakeUpstream]:
    with FakeUpstream() as upstream:
        yield upstream
