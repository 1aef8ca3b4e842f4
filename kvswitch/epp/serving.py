"""What the EPP's two transports share: service names and paths, health statuses, reporting a
finished request to the router (exactly as the sans-IO stream says), the decision a failing
router stands for, and feeding access-log messages to the router.
"""

from __future__ import annotations

import logging

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from kvswitch.epp import access_log
from kvswitch.epp.access_log import AccessLogSink
from kvswitch.epp.contracts import Router, RoutingDecision
from kvswitch.epp.extproc import Action, NeedRouting, RequestFinished

logger = logging.getLogger(__name__)


EXT_PROC_SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
LIVENESS = "liveness"
READINESS = "readiness"
HEALTH_SERVICES = (LIVENESS, READINESS, EXT_PROC_SERVICE)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROCESS_PATH = f"/{EXT_PROC_SERVICE}/Process"
HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"
HEALTH_WATCH_PATH = "/grpc.health.v1.Health/Watch"
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
ROUTER_ERROR = RoutingDecision(status=503, reason="router-error")


def decided(need: NeedRouting, decision: RoutingDecision) -> RoutingDecision:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "request %s %s -> %s %s %s", need.request.request_id, need.request.path,
            decision.status, ",".join(decision.endpoints), decision.reason,
        )
    return decision


def report_finished(router: Router, actions: list[Action]) -> None:
    for action in actions:
        if type(action) is not RequestFinished:
            continue
        try:
            router.request_finished(action.request, action.outcome)
        except Exception:
            logger.exception("request_finished failed for %s", action.request.request_id)


def take_entries(sink: AccessLogSink, message: bytes) -> bool:
    """Feed one StreamAccessLogsMessage to `sink`; False if it does not parse."""
    try:
        ends = access_log.ended_requests(message)
    except DecodeError:
        return False
    for end in ends:
        try:
            sink.request_logged(end)
        except Exception:  # a bug costs that entry, not the gateway's log stream
            logger.exception("access-log entry of request %s failed", end.request_id)
    return True
