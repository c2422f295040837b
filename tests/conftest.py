"""Shared fixtures: the tiny CosyVoice2 checkpoint, and real Redis / SeaweedFS S3 for the session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import fixture_facts
from voxbatch import testing_services as services


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The official-format CosyVoice2 fixture with reference outputs (tests/fixture_facts.py says where).

    Absent: the tests that need it skip locally and fail under CI=true, as a missing service does."""
    try:
        return fixture_facts.fixture_path()
    except fixture_facts.FixtureNotFound as e:
        services.missing(f"the CosyVoice2 fixture ({e})")


@pytest.fixture(scope="session")
def tiny_facts(tiny_model_dir) -> fixture_facts.FixtureFacts:
    """Dimensions, vocabulary, seeds and texts of that fixture, read from its own files."""
    return fixture_facts.facts()


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir) -> dict:
    """Every array of the fixture's reference.npz (made by the official implementation)."""
    import numpy as np

    with np.load(tiny_model_dir / "reference.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def ref(tiny_reference) -> dict:
    """Short name for `tiny_reference` in the parity tests."""
    return tiny_reference


@pytest.fixture
def one_torch_thread():
    """One intra-op thread, as the fixture's references were made (and the test machine is shared)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine has none)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = services.start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    s3 = services.start_seaweed(tmp_path_factory.mktemp("seaweed"))
    yield s3
    s3.stop()


@pytest.fixture
def s3_env(seaweed, redis_server) -> dict[str, str]:
    """Environment for voxbatch processes talking to the session's Redis and a fresh S3 bucket."""
    bucket = seaweed.new_bucket()
    return {
        "VOXBATCH_BROKER_URL": redis_server.url,
        "VOXBATCH_STORAGE_URL": f"s3://{bucket}/prefix",
        "VOXBATCH_S3_ENDPOINT": seaweed.endpoint,
        "AWS_ACCESS_KEY_ID": services.S3_KEY,
        "AWS_SECRET_ACCESS_KEY": services.S3_SECRET,
        "AWS_REGION": "us-east-1",
    }
