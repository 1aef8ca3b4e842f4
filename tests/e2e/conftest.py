"""A real gateway on loopback for the e2e tests: `kvswitch engine` processes, the EPP, Envoy.

Everything is started through `kvswitch.supervisor` / `kvswitch.launcher.launch_gateway` (the code
`kvswitch up` runs) and ended by PID when the module's tests are done, even on failure.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.gateway import (
    Gateway,
    running_gateway,
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Four tiny echo engines on a fast clock, behind the EPP and Envoy."""
    with running_gateway(tmp_path_factory.mktemp("gateway"), replicas=4, profile="tiny",
                         time_scale=100.0, mode="echo", grace_period=1.0) as gw:
        yield gw


