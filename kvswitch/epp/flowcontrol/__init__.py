"""Flow control: priority, fairness between tenants, and shedding under saturation."""

from __future__ import annotations

from kvswitch.epp.flowcontrol.core import (
    EXPIRED,
    QUEUE_FULL,
    SHED,
    Admission,
    FlowControlConfig,
    FlowQueues,
    SaturationConfig,
    Verdict,
    headroom,
    is_saturated,
)
from kvswitch.epp.flowcontrol.gate import FlowGate

__all__ = [
    "EXPIRED",
    "QUEUE_FULL",
    "SHED",
    "Admission",
    "FlowControlConfig",
    "FlowGate",
    "FlowQueues",
    "SaturationConfig",
    "Verdict",
    "headroom",
    "is_saturated",
]
