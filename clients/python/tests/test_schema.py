"""The client's answer and request types against the server's OpenAPI document (`docs/discovery-openapi.json`, which
the server derives from the very types it serialises): a field the server adds, renames or stops sending fails
here, as does a request body key the server would refuse."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Dict, List, Mapping

import pytest

from egress_client import _models
from egress_client._models import CooldownInfo, LeasedProxy, LeaseState, ProxyCredentials, ProxyInfo

DOCUMENT = pathlib.Path(__file__).resolve().parents[3] / "docs" / "discovery-openapi.json"
SCHEMAS: Dict[str, Any] = json.loads(DOCUMENT.read_text())["components"]["schemas"]

#: The wire name of a field whose name is not its camelCase.
WIRE_NAMES = {"egress_ip": "egressIP"}

#: Each answer type, the schema it reads, and the properties it leaves to someone else (with why).
ANSWERS = [
    (LeasedProxy, "ProxyRef", set()),
    (ProxyCredentials, "ProxyCredentials", set()),
    # `replaced` is on renew answers only, and renew returns it as its result rather than keeping it.
    (LeaseState, "Lease", {"replaced"}),
    (ProxyInfo, "Proxy", set()),
    (CooldownInfo, "Cooldown", set()),
]


def wire_name(field: str) -> str:
    if field in WIRE_NAMES:
        return WIRE_NAMES[field]
    first, *rest = field.split("_")
    return first + "".join(part.capitalize() for part in rest)


def resolve(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    if "$ref" in schema:
        return SCHEMAS[schema["$ref"].rsplit("/", 1)[-1]]
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return resolve(schema["allOf"][0])
    return schema


def example(schema: Mapping[str, Any], required_only: bool) -> Any:
    """A value the schema allows: every property, or only the required ones."""
    schema = resolve(schema)
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        return {
            name: example(property, required_only)
            for name, property in properties.items()
            if name in required or not required_only
        }
    if kind == "array":
        return [example(schema["items"], required_only)]
    if kind == "integer":
        return max(1, int(schema.get("minimum", 1)))
    if kind == "number":
        return 0.5
    if kind == "boolean":
        return True
    if schema.get("format") == "date-time":
        return "2026-12-01T12:00:00Z"
    return "crawl"


def unread(value: Any, path: str = "") -> List[str]:
    """The fields of `value` (and of the dataclasses in it) that hold None."""
    found = []
    for field in dataclasses.fields(value):
        held = getattr(value, field.name)
        if held is None:
            found.append(path + field.name)
        elif dataclasses.is_dataclass(held):
            found += unread(held, f"{path}{field.name}.")
    return found


@pytest.mark.parametrize("model,name,elsewhere", ANSWERS, ids=[name for _, name, _ in ANSWERS])
def test_an_answer_type_has_exactly_the_schemas_properties_and_requires_what_it_requires(
    model: type, name: str, elsewhere: set
) -> None:
    schema = SCHEMAS[name]
    fields = {wire_name(field.name): field for field in dataclasses.fields(model)}
    assert set(fields) == set(schema["properties"]) - elsewhere, f"{model.__name__} against {name}"
    required = {
        wire: field
        for wire, field in fields.items()
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    }
    assert set(required) == set(schema.get("required", [])), f"{model.__name__}'s fields without a default"


#: The answers read on their own (the others are parts of these).
DECODED = [answer for answer in ANSWERS if hasattr(answer[0], "from_json")]


@pytest.mark.parametrize("model,name,elsewhere", DECODED, ids=[name for _, name, _ in DECODED])
def test_an_answer_type_reads_every_property_and_needs_only_the_required_ones(
    model: Any, name: str, elsewhere: set
) -> None:
    full = model.from_json(example(SCHEMAS[name], required_only=False))
    assert unread(full) == [], f"{model.__name__}.from_json left these None though the answer had them"
    model.from_json(example(SCHEMAS[name], required_only=True))


def test_the_lease_and_report_bodies_use_only_and_every_key_the_server_takes() -> None:
    lease = _models.lease_body(
        "https://example.com/",
        selector="region=eu",
        ttl=60,
        proxy="crawl/eu-1",
        session="s1",
        pool="eu",
        zone="eu-west-1a",
        provider="gcp-eu",
        session_lifetime=600,
        session_max_leases=50,
    )
    assert set(lease) == set(SCHEMAS["LeaseRequest"]["properties"])
    assert SCHEMAS["LeaseRequest"]["additionalProperties"] is False
    report = _models.report_body("throttled", status_code=429, retry_after=5, ok=3, failed=1, release=True)
    assert set(report) == set(SCHEMAS["Report"]["properties"])
    assert set(_models.ttl_body(60)) == set(SCHEMAS["RenewRequest"]["properties"])
    outcomes: List[str] = SCHEMAS["Outcome"]["enum"]
    assert list(_models.OUTCOMES) == outcomes

