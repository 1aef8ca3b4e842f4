"""The request-path types stay value objects: equal and hashable by value, copied by replace."""

from __future__ import annotations

import dataclasses

from kvswitch.epp.contracts import InferenceRequest, ParsedBody, RequestOutcome


def test_request_types_compare_and_hash_by_value() -> None:
    body = ParsedBody(model="m", prompt_token_ids=(1, 2, 3), max_tokens=8)
    assert body == ParsedBody(model="m", prompt_token_ids=(1, 2, 3), max_tokens=8)
    assert hash(body) == hash(ParsedBody(model="m", prompt_token_ids=(1, 2, 3), max_tokens=8))
    outcome = RequestOutcome("10.0.0.1:8000", ok=True, grpc_status=0)
    assert {outcome, RequestOutcome("10.0.0.1:8000", ok=True, grpc_status=0)} == {outcome}
    request = InferenceRequest("r1", "grpc", "/p", body, headers={})
    assert request == InferenceRequest("r1", "grpc", "/p", body, headers={})
    assert request != InferenceRequest("r2", "grpc", "/p", body, headers={})


def test_replace_derives_a_changed_copy_and_leaves_the_original() -> None:
    request = InferenceRequest("r1", "grpc", "/p", ParsedBody(), fairness_id="a")
    changed = dataclasses.replace(request, objective="batch")
    assert (changed.objective, changed.fairness_id, changed.request_id) == ("batch", "a", "r1")
    assert request.objective is None
