"""Every fuzz target, briefly (`KVSWITCH_FUZZ_EXAMPLES`, default 150 inputs each), plus the
inputs that once broke a target, kept as regression cases."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz.targets import CONFIG, TARGETS, Target

EXAMPLES = int(os.environ.get("KVSWITCH_FUZZ_EXAMPLES", "150"))


@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_fuzz(target: Target) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(target.inputs)
    def run(value: object) -> None:
        target.check(value)

    run()


def test_a_yaml_escape_past_unicode_is_a_config_error() -> None:
    # Found by the epp-config target: pyyaml raised a bare ValueError for it.
    CONFIG.check('apiVersion: x\nkind: Other\nschedulingProfiles:\n- "\\U10010000": null\n')
