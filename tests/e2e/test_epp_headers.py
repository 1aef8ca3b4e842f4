"""Envoy sends the EPP only the request headers it reads (`EPP_HEADERS`), plus those the EPP
config names: `kvswitch up` adds a session-affinity-scorer's own `headerName`."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvswitch.envoy import session_headers
from kvswitch.launcher import DEFAULT_EPP_CONFIG
from tests.support.gateway import cached_on, generate, prompt, running_gateway

SESSION_HEADER = "x-user-session"

# The default profile with a session-affinity scorer that outweighs everything else.
SESSION_CONFIG = {
    **DEFAULT_EPP_CONFIG,
    "plugins": [*DEFAULT_EPP_CONFIG["plugins"],
                {"name": "sessions", "type": "session-affinity-scorer",
                 "parameters": {"headerName": SESSION_HEADER}}],
    "schedulingProfiles": [{"name": "default", "plugins": [
        *DEFAULT_EPP_CONFIG["schedulingProfiles"][0]["plugins"],  # type: ignore[index]
        {"pluginRef": "sessions", "weight": 100},
    ]}],
}


def test_session_headers_are_read_from_the_config(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(
        "kind: EndpointPickerConfig\nplugins:\n"
        "- {name: a, type: session-affinity-scorer, parameters: {headerName: x-a}}\n"
        "- {name: b, type: session-affinity-scorer}\n"
        "- {name: c, type: queue-scorer, parameters: {headerName: x-not-a-session}}\n"
        "---\nkind: InferenceObjective\n")
    assert session_headers(path) == ("x-a",)


@pytest.mark.timeout(180)
def test_a_custom_session_header_reaches_the_epp(tmp_path: Path) -> None:
    with running_gateway(tmp_path, replicas=3, profile="tiny", time_scale=100.0, mode="echo",
                         grace_period=1.0, epp_config=SESSION_CONFIG) as gateway:
        session = [(SESSION_HEADER, "session-1")]
        # Different prefixes, which the load and prefix scorers alone would spread; the session
        # keeps them on the replica its first request went to.
        prompts = [prompt(500 + i) for i in range(6)]
        for ids in prompts:
            generate(gateway.stub, ids, metadata=session)
        holders = {tuple(cached_on(gateway.engines, ids)) for ids in prompts}
        assert len(holders) == 1 and len(next(iter(holders))) == 1, holders
