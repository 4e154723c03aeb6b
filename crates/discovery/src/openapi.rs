//! The OpenAPI 3 document of the API, served at `/openapi.json` and committed as `docs/discovery-openapi.json`
//! (a test fails when the two differ).

use serde_json::{Value, json};

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
                    ("200".to_owned(), json_response("the lease with its new expiry and ID, and the proxy's current URL", "Renewed")),
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
            "/healthz": { "get": { "summary": "Liveness", "security": [], "responses": { "200": { "description": "alive" } } } },
            "/readyz": { "get": { "summary": "Readiness: the proxy store has synced and this replica serves", "security": [], "responses": {
                "200": { "description": "ready" }, "503": problem_response("not ready, with the reason")
            } } }
        },
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": {
                "Problem": { "type": "object", "required": ["type", "title", "status", "detail"], "properties": {
                    "type": { "type": "string" }, "title": { "type": "string" }, "status": { "type": "integer" }, "detail": { "type": "string" },
                    "reason": { "type": "string", "description": "none-healthy, all-at-capacity, all-cooling-down, scaling-up (a pool is getting members; Retry-After is how long a new member takes), proxy-cooling-down, proxy-unavailable, unknown-pool, not-serving, quota-max-leases, quota-reports-per-minute" },
                    "retryAfterSeconds": { "type": "integer" }
                }},
                "ProxyRef": { "type": "object", "required": ["namespace", "name", "host", "port", "url"], "properties": {
                    "namespace": { "type": "string" }, "name": { "type": "string" }, "host": { "type": "string" }, "port": { "type": "integer" },
                    "url": { "type": "string", "description": "http://[user:password@]host:port; credentials only for lease-scope tokens" },
                    "egressIP": { "type": "string", "description": "the address sites see requests through this proxy come from, once its probes observed it; proxies sharing it share cooldowns" }
                }},
                "Proxy": { "allOf": [{ "$ref": "#/components/schemas/ProxyRef" }, { "type": "object", "required": ["labels", "activeLeases", "maxLeases"], "properties": {
                    "labels": { "type": "object", "additionalProperties": { "type": "string" } },
                    "zone": { "type": "string" }, "provider": { "type": "string" }, "activeLeases": { "type": "integer" }, "maxLeases": { "type": "integer" },
                    "pool": { "type": "string", "description": "the name of the ProxyPool it is a member of, in its namespace" },
                    "coolingDownUntil": { "type": "string", "format": "date-time" },
                    "cooldownPolicy": {
                        "type": "object",
                        "description": "How long a site's ban cools this proxy down: baseSeconds after the first ban in a row, times factor for each further one, at most maxSeconds",
                        "properties": {
                            "baseSeconds": { "type": "integer" },
                            "factor": { "type": "integer" },
                            "maxSeconds": { "type": "integer" }
                        }
                    },
                    "successRate": { "type": "number", "minimum": 0, "maximum": 1, "description": "with target: the share of requests reported through this proxy for that site (in the last hour of reports) that it served" },
                    "reported": { "type": "integer", "description": "with target: how many reported requests successRate is over" }
                }}]},
                "ProxyList": { "type": "object", "required": ["proxies"], "properties": { "proxies": { "type": "array", "items": { "$ref": "#/components/schemas/Proxy" } } } },
                "LeaseRequest": { "type": "object", "additionalProperties": false, "required": ["target"], "properties": {
                    "target": { "type": "string", "maxLength": 2048, "description": "host name, IP address or URL of the site" },
                    "selector": { "type": "string" }, "ttlSeconds": { "type": "integer", "minimum": 1, "maximum": 3600, "default": 300 },
                    "proxy": { "type": "string", "description": "namespace/name of a specific proxy" },
                    "session": { "type": "string", "maxLength": 256, "description": "sticky-session key" },
                    "pool": { "type": "string", "description": "only members of this ProxyPool: namespace/name, or a name only one namespace has; a pool with no members that autoscales answers 503 scaling-up and grows" }
                }},
                "Lease": { "type": "object", "required": ["id", "proxy", "target", "expiresAt"], "properties": {
                    "id": { "type": "string", "description": "self-verifying: usable only with a token of the tenant that took the lease, by any replica that shares the operator's lease key (it survives restarts and failovers); renew answers a newer ID for the same lease" },
                    "proxy": { "$ref": "#/components/schemas/ProxyRef" },
                    "target": { "type": "string", "description": "the normalised target" }, "expiresAt": { "type": "string", "format": "date-time" }
                }},
                "RenewRequest": { "type": "object", "additionalProperties": false, "properties": { "ttlSeconds": { "type": "integer", "minimum": 1, "maximum": 3600 } } },
                "Renewed": { "allOf": [{ "$ref": "#/components/schemas/Lease" }, { "type": "object", "required": ["replaced"], "properties": {
                    "replaced": { "type": "boolean", "description": "true when the proxy's instance was replaced since the holder was last told its URL: use proxy.url from now on (the old instance is kept only until its holders renew, or the drain timeout)" }
                }}]},
                "Report": { "type": "object", "additionalProperties": false, "description": "an outcome, counts, or both", "properties": {
                    "outcome": { "type": "string", "enum": ["ok", "banned", "throttled", "failed"], "description": "banned: a cooldown that doubles with each ban in a row; throttled (429 and the like): a short cooldown, for retryAfterSeconds when given, that leaves the ban streak alone. While a cooldown runs, a further ban or throttle from the same tenant changes nothing (the answer gives the running cooldown's end); another tenant's ban counts once" },
                    "statusCode": { "type": "integer", "minimum": 100, "maximum": 599 },
                    "retryAfterSeconds": { "type": "integer", "minimum": 1, "maximum": 86400, "description": "with outcome throttled: the site's own Retry-After" },
                    "ok": { "type": "integer", "minimum": 0, "maximum": 1000000, "description": "requests the site served through this lease since the last report; one lease's reports count at most 100 requests plus 100 per second of its age, the rest is dropped" },
                    "failed": { "type": "integer", "minimum": 0, "maximum": 1000000, "description": "requests that failed otherwise" },
                    "release": { "type": "boolean", "default": false }
                }},
                "ReportResult": { "type": "object", "properties": { "cooldownUntil": { "type": "string", "format": "date-time" } } },
                "Cooldown": { "type": "object", "required": ["proxy", "target", "until", "streak"], "properties": {
                    "proxy": { "type": "string" }, "target": { "type": "string" }, "until": { "type": "string", "format": "date-time" }, "streak": { "type": "integer" }
                }},
                "CooldownList": { "type": "object", "required": ["cooldowns"], "properties": { "cooldowns": { "type": "array", "items": { "$ref": "#/components/schemas/Cooldown" } } } },
                "ClearedCooldowns": { "type": "object", "required": ["cleared"], "properties": { "cleared": { "type": "array", "items": { "$ref": "#/components/schemas/Cooldown" } } } }
            }
        }
    })
}
