"""Header names of the endpoint-picker protocol (GAIE v1.0.0) and llm-d request headers."""

from __future__ import annotations

# Where the EPP tells the proxy to send a request (header and `envoy.lb` metadata key).
DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
# The replica that served a request, as the gateway reports it.
SERVED_ENDPOINT = "x-gateway-destination-endpoint-served"
DESTINATION_METADATA_NAMESPACE = "envoy.lb"
# The EPP replica that routed a request, beside its destination under `envoy.lb` metadata: a
# gateway with several EPPs sends each one the access-log entries of the requests it routed.
EPP_REPLICA = "x-kvswitch-epp-replica"
# The subset of endpoints the proxy allows (metadata namespace and header).
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION_SUBSET = "x-gateway-destination-endpoint-subset"
# Why flow control or scheduling dropped a request.
DROPPED_REASON = "x-llm-d-request-dropped-reason"

OBJECTIVE = "x-llm-d-inference-objective"
FAIRNESS_ID = "x-llm-d-inference-fairness-id"
SLO_TTFT_MS = "x-llm-d-slo-ttft-ms"
SLO_TPOT_MS = "x-llm-d-slo-tpot-ms"
DEFAULT_FAIRNESS_ID = "default-flow"

# Older gateway-api-inference-extension names, accepted as aliases of the ones above.
ALIASES: dict[str, str] = {
    "x-gateway-inference-objective": OBJECTIVE,
    "x-gateway-inference-fairness-id": FAIRNESS_ID,
    "x-gateway-slo-ttft-ms": SLO_TTFT_MS,
    "x-gateway-slo-tpot-ms": SLO_TPOT_MS,
}

# The request id kvswitch assigns and propagates (Envoy's own header).
REQUEST_ID = "x-request-id"

# The model a request is for, as gateway-api-inference-extension's body-based routing writes it.
# gRPC requests carry no model in their body: kvswitch's frontend sends this with its Generate
# and Embed calls, and the EPP labels gRPC requests' metrics with it.
MODEL_NAME = "x-gateway-model-name"

# The session-affinity-scorer's default header (upstream's name).
SESSION_TOKEN = "x-session-token"

# Trailing metadata the kvswitch engine adds to Generate/Embed responses so the EPP can account
# usage from response trailers without reading the body:
# "prompt_tokens=12;completion_tokens=64;cached_tokens=0".
USAGE_TRAILER = "x-kvswitch-usage"

# Dynamic metadata kvswitch's Envoy bootstrap sets on every request it routes through the EPP
# (a client cannot forge it) and forwards to ext_proc: {"access_logged": true} says this gateway
# streams its access log to the EPP, so a request whose ext_proc stream closes before its
# response ends is finished by its log entry (kvswitch.epp.access_log).
GATEWAY_METADATA_NAMESPACE = "kvswitch"
ACCESS_LOGGED = "access_logged"

# SubscribeKvEvents call metadata with which a subscriber (an EPP of several) asks the kvswitch
# engine for the prompts of the requests it queues, on its load pushes: each one a
# `KvBlocksStored` whose `ownership` is QUEUED_OWNERSHIP (blocks not stored yet).
QUEUED_PROMPTS = "x-kvswitch-queued-prompts"
QUEUED_OWNERSHIP = "kvswitch-queued"
# ... and, on a later push, a request it announced that left before its prefill ended: a
# `KvBlocksStored` with no blocks whose `ownership` is WITHDRAWN_OWNERSHIP, `session_id` its id.
WITHDRAWN_OWNERSHIP = "kvswitch-withdrawn"
