"""The demos' ranks, in these tests, come from the tests' rank server (torch imported once per
pytest process) instead of a spawned interpreter each: the same launcher every other test uses,
with ``dlion_kernels.launch.spawn``'s behaviour. The demo's own launcher is tested in
test_launch.py and by the torchrun test."""

import pytest
import rankserver

from dlion_kernels.demo import common


@pytest.fixture(scope="session", autouse=True)
def _ranks_from_the_rank_server():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "spawn", rankserver.run)
        yield
