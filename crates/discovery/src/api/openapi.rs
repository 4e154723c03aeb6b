//! The OpenAPI 3 document of the API, served at `/openapi.json` and committed as `docs/discovery-openapi.json`
//! (a test fails when the two differ). The routes are listed here; every body's schema is derived (schemars) from
//! the very types the handlers parse and serialise, so the document cannot drift from what is sent.

use schemars::generate::{Contract, SchemaSettings};
use serde_json::{Value, json};

use super::leases::{LeaseBody, RenewBody, ReportBody, ReportResult};
use super::refusals::RefusalLine;
use crate::problem::Problem;

/// The schemas of the bodies: requests as they are parsed, answers as they are written (a field skipped when
/// empty is optional, not nullable).
fn schemas() -> serde_json::Map<String, Value> {
    let mut requests =
        SchemaSettings::openapi3().with(|settings| settings.contract = Contract::Deserialize).into_generator();
    requests.subschema_for::<LeaseBody>();
    requests.subschema_for::<RenewBody>();
    requests.subschema_for::<ReportBody>();
    let mut answers =
        SchemaSettings::openapi3().with(|settings| settings.contract = Contract::Serialize).into_generator();
    answers.subschema_for::<Problem>();
    answers.subschema_for::<egress_wire::ProxyList>();
    answers.subschema_for::<egress_wire::Lease<'static>>();
    answers.subschema_for::<ReportResult>();
    answers.subschema_for::<egress_wire::CooldownList>();
    answers.subschema_for::<egress_wire::ClearedCooldowns>();
    answers.subschema_for::<egress_wire::EndedSessions>();
    answers.subschema_for::<RefusalLine>();
    let mut schemas = requests.take_definitions(true);
    let mut answers = answers.take_definitions(true);
    answers.values_mut().for_each(optional_never_null);
    schemas.extend(answers);
    schemas
}

/// An answer leaves an empty optional field out rather than send `null`: such a field is optional, not nullable.
fn optional_never_null(schema: &mut Value) {
    let required: Vec<Value> = schema.get("required").and_then(Value::as_array).cloned().unwrap_or_default();
    let Some(properties) = schema.get_mut("properties").and_then(Value::as_object_mut) else { return };
    for (name, property) in properties.iter_mut() {
        if required.contains(&Value::String(name.clone())) {
            continue;
        }
        let Some(property) = property.as_object_mut() else { continue };
        property.remove("nullable");
        if let Some(Value::Array(alternatives)) = property.get("anyOf") {
            let null = json!([null]);
            let kept: Vec<Value> =
                alternatives.iter().filter(|alternative| alternative.get("enum") != Some(&null)).cloned().collect();
            if let [only] = kept.as_slice() {
                // `$ref` takes no siblings in OpenAPI 3.0, so the reference stays wrapped (its description beside).
                property.insert("allOf".to_owned(), json!([only]));
                property.remove("anyOf");
            }
        }
    }
}

fn problem_response(description: &str) -> Value {
    json!({ "description": description, "content": { "application/problem+json": { "schema": { "$ref": "#/components/schemas/Problem" } } } })
}

fn json_response(description: &str, schema: &str) -> Value {
    json!({ "description": description, "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{schema}") } } } })
}

fn json_body(schema: &str, required: bool) -> Value {
    json!({ "required": required, "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{schema}") } } } })
}

fn lease_id() -> Value {
    json!({ "name": "id", "in": "path", "required": true, "schema": { "type": "string" } })
}

/// The document.
pub fn document() -> Value {
    let auth_errors = |mut responses: serde_json::Map<String, Value>| {
        responses.insert("401".into(), problem_response("missing or unknown bearer token"));
        responses.insert("403".into(), problem_response("the token's scope does not allow this route"));
        responses.insert(
            "503".into(),
            problem_response("not serving (for example not the leader), or no proxy is eligible"),
        );
        Value::Object(responses)
    };
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "egress-operator discovery API",
            "version": "v1",
            "description": "Lease healthy HTTP forward proxies for a target site, renew and release them, and report bans, which cool a proxy down for that site only."
        },
        "security": [{ "bearer": [] }],
        "paths": {
            "/v1/proxies": { "get": {
                "summary": "List healthy proxies",
                "parameters": [
                    { "name": "selector", "in": "query", "schema": { "type": "string" }, "description": "label selector: a=b, a!=b, a, !a, comma-separated" },
                    { "name": "target", "in": "query", "schema": { "type": "string" }, "description": "report each proxy's cooldown for this site" },
                    { "name": "pool", "in": "query", "schema": { "type": "string" }, "description": "only members of this ProxyPool: namespace/name, or a name only one namespace has" }
                ],
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("200".to_owned(), json_response("the proxies", "ProxyList")),
                    ("400".to_owned(), problem_response("invalid selector, target or query parameter")),
                ]))
            }},
            "/v1/leases": { "post": {
                "summary": "Lease a proxy for a target",
                "requestBody": json_body("LeaseRequest", true),
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("201".to_owned(), json_response("the lease", "Lease")),
                    ("400".to_owned(), problem_response("invalid body")),
                    ("404".to_owned(), problem_response("the named proxy or pool does not exist")),
                    ("503".to_owned(), problem_response("nothing can be leased now (reason none-healthy, all-at-capacity, all-cooling-down, scaling-up or not-serving), with Retry-After")),
                    ("409".to_owned(), problem_response("the named proxy is cooling down for the target, full, drained or unhealthy")),
                    ("413".to_owned(), problem_response("the body is too large")),
                    ("415".to_owned(), problem_response("the body is not JSON")),
                    ("429".to_owned(), problem_response("the tenant holds its maxLeases already (quota-exceeded, reason quota-max-leases), with Retry-After")),
                ]))
            }},
            "/v1/leases/{id}": { "delete": {
                "summary": "Release a lease",
                "parameters": [lease_id()],
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("204".to_owned(), json!({ "description": "released" })),
                    ("404".to_owned(), problem_response("no such lease (expired or released)")),
                ]))
            }},
            "/v1/leases/{id}/renew": { "post": {
                "summary": "Extend a lease",
                "parameters": [lease_id()],
                "requestBody": json_body("RenewRequest", false),
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("200".to_owned(), json_response("the lease with its new expiry and ID, the proxy's current URL, and replaced", "Lease")),
                    ("400".to_owned(), problem_response("invalid body")),
                    ("404".to_owned(), problem_response("no such lease for this token (expired, released, or never granted to it)")),
                    ("410".to_owned(), problem_response("the lease was revoked: its proxy turned unhealthy or went away")),
                ]))
            }},
            "/v1/leases/{id}/report": { "post": {
                "summary": "Report what happened with a lease; a ban cools the proxy down for the lease's site",
                "parameters": [lease_id()],
                "requestBody": json_body("Report", true),
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("200".to_owned(), json_response("the cooldown, for a ban or a throttle", "ReportResult")),
                    ("400".to_owned(), problem_response("invalid body")),
                    ("404".to_owned(), problem_response("no such lease")),
                    ("429".to_owned(), problem_response("the tenant made its reportsPerMinute reports this minute (quota-exceeded, reason quota-reports-per-minute), with Retry-After")),
                ]))
            }},
            "/v1/cooldowns": { "get": {
                "summary": "List live cooldowns your tenant's reports made (an admin: every one)",
                "parameters": [{ "name": "target", "in": "query", "schema": { "type": "string" } }],
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("200".to_owned(), json_response("the cooldowns", "CooldownList")),
                    ("400".to_owned(), problem_response("invalid target or query parameter")),
                ]))
            }, "delete": {
                "summary": "Clear cooldowns (admin scope): end them now and forget their ban streaks",
                "description": "Ends the cooldowns for target of one proxy (and of the proxies sharing its egress IP, which shared the cooldown) or of every proxy; answered once the change is kept, so a restart or a new leader does not bring them back.",
                "parameters": [
                    { "name": "target", "in": "query", "required": true, "schema": { "type": "string" } },
                    { "name": "proxy", "in": "query", "schema": { "type": "string" }, "description": "namespace/name; every proxy when absent" }
                ],
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("200".to_owned(), json_response("the cooldowns that were running and ended", "ClearedCooldowns")),
                    ("400".to_owned(), problem_response("invalid or missing target, or an invalid query parameter")),
                    ("404".to_owned(), problem_response("no such proxy")),
                ]))
            }},
            "/v1/sessions": { "delete": {
                "summary": "End your tenant's sessions: one by name, or all of them",
                "description": "Releases the leases of the caller's session of that name (every site), or of all its sessions, wherever they are held (a gateway replica holding one learns it at its next renewal), and forgets the proxies the sessions kept (stickiness), so their next leases choose afresh. Leases without a session are left alone.",
                "parameters": [{ "name": "session", "in": "query", "schema": { "type": "string", "minLength": 1, "maxLength": 256 }, "description": "the session; every session of the tenant when absent" }],
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("200".to_owned(), json_response("what was ended", "EndedSessions")),
                    ("400".to_owned(), problem_response("an invalid session or query parameter")),
                ]))
            }},
            "/v1/refusals": { "get": {
                "summary": "Follow the refusals (bans, throttles) your tenant reports, from any client, as they are taken",
                "description": "Newline-delimited JSON, one RefusalEvent a line: first your tenant's live cooldowns, then {\"type\":\"synced\"}, then each refusal as it is reported, and a heartbeat every 10 s while nothing happens. The stream ends when this replica stops serving; connect again. Gateway replicas follow it to move every session of the tenant off a refused proxy.",
                "responses": auth_errors(serde_json::Map::from_iter([
                    ("200".to_owned(), json!({ "description": "the stream", "content": { "application/x-ndjson": { "schema": { "$ref": "#/components/schemas/RefusalEvent" } } } })),
                    ("400".to_owned(), problem_response("a query parameter (this route takes none)")),
                ]))
            }},
            "/healthz": { "get": { "summary": "Liveness", "security": [], "responses": { "200": { "description": "alive" } } } },
            "/readyz": { "get": { "summary": "Readiness: the proxy store has synced and this replica serves", "security": [], "responses": {
                "200": { "description": "ready" }, "503": problem_response("not ready, with the reason")
            } } }
        },
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": schemas(),
        }
    })
}
