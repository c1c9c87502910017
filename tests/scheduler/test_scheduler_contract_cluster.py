"""The scheduler contract suite (tests/scheduler/test_scheduler_contract.py) on a real
3-master Redis Cluster: planning, admission races between schedulers, claims and resumes,
with the rollout streams on their own slots and the control plane on one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.events.redis_cluster import RedisClusterProcs, cluster_fixture
from tests.events.test_log_contract_cluster import redis_factory  # noqa: F401 (overrides)
from tests.scheduler.test_scheduler_contract import *  # noqa: F403  (the suite, collected here)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    yield from cluster_fixture()
