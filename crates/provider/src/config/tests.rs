//! Table tests of the providers file's frame: what parses, and the exact message and path of each mistake. Each
//! backend's crate tests its own block the same way.

use ipnet::IpNet;

use super::*;
use crate::destinations::DestinationRule;

/// A block every field of which has a default, like the Kubernetes backend's.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Pods {
    #[serde(default = "default_namespace")]
    #[schemars(transform = identifier)]
    namespace: String,
    #[serde(default, with = "networks")]
    #[schemars(with = "Vec<String>", transform = networks::schema)]
    cluster_networks: Vec<IpNet>,
    #[serde(default)]
    #[schemars(range(min = 1024, max = 65536))]
    fd_limit: Option<u32>,
}

fn default_namespace() -> String {
    "egress-proxies".into()
}

impl SettingsBlock for Pods {
    const TYPE: &'static str = "kubernetes";

    fn denied_networks(&self) -> &[IpNet] {
        &self.cluster_networks
    }
}

/// A block with a required field and a check of its own, like the Compute Engine backend's.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Vms {
    project: String,
    #[serde(default)]
    zones: Vec<String>,
    default_zone: Option<String>,
}

impl SettingsBlock for Vms {
    const TYPE: &'static str = "gcp";

    fn check(&mut self, at: &str, problems: &mut Vec<Problem>) {
        if let Some(zone) = &self.default_zone
            && !self.zones.contains(zone)
        {
            problems.push(Problem { path: format!("{at}.defaultZone"), message: format!("{zone:?} is not a zone") });
        }
    }
}

fn types() -> SettingsTypes {
    SettingsTypes::new().with::<Pods>().with::<Vms>()
}

fn parse(text: &str) -> Result<ProvidersConfig, ConfigError> {
    ProvidersConfig::parse(text, "providers.yaml", &types())
}

fn problems(text: &str) -> Vec<String> {
    match parse(text) {
        Ok(config) => panic!("expected problems, parsed {config:?}"),
        Err(error) => error.problems.iter().map(ToString::to_string).collect(),
    }
}

#[test]
fn a_file_parses_with_defaults_and_each_block_reads_as_its_type() {
    let config = parse(
        "providers:\n  - { name: pods, type: kubernetes }\n  - { name: vms, type: gcp, gcp: { project: p, zones: [a], defaultZone: a } }\n",
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let pods = config.get("pods").expect("pods");
    assert_eq!(
        (pods.type_name(), pods.settings::<Pods>().expect("pods").namespace.as_str()),
        ("kubernetes", "egress-proxies")
    );
    assert_eq!(pods.settings::<Pods>().expect("pods").fd_limit, None);
    assert!(pods.settings::<Vms>().is_none(), "a block reads only as its own type");
    let vms = config.get("vms").expect("vms").settings::<Vms>().expect("vms");
    assert_eq!((vms.project.as_str(), vms.default_zone.as_deref()), ("p", Some("a")));
    let vms = config.get("vms").expect("vms");
    assert_eq!((vms.destinations.clone(), vms.cooldown), (DestinationPolicy::default(), CooldownSettings::default()));
}

#[test]
fn each_mistake_has_its_message_and_path() {
    let cases: &[(&str, &str, &str)] = &[
        ("not YAML", "providers: [", "not valid YAML"),
        ("empty file", "", "the file is empty"),
        ("not a mapping", "- a\n- b\n", "must be a mapping, found a list"),
        ("unknown top-level key", "other: 1\n", "other: unknown field (expected one of: providers)"),
        ("no providers key", "other: 1\n", "providers: is required"),
        ("providers not a list", "providers: {}\n", "providers: must be a list, found a mapping"),
        ("entry not a mapping", "providers: [pods]\n", "providers[0]: must be a mapping, found a string"),
        (
            "unknown key",
            "providers:\n  - { name: a, type: kubernetes, zone: x }\n",
            "providers[0].zone: unknown field (expected one of: cooldown, destinations, gcp, kubernetes, name, pacing, type)",
        ),
        ("missing name", "providers:\n  - { type: kubernetes }\n", "providers[0].name: is required"),
        ("missing type", "providers:\n  - { name: a }\n", "providers[0].type: is required"),
        (
            "unknown type",
            "providers:\n  - { name: a, type: aws }\n",
            r#"providers[0].type: "aws" is not one of: kubernetes, gcp"#,
        ),
        (
            "bad name",
            "providers:\n  - { name: Pods_1, type: kubernetes }\n",
            r#"providers[0].name: "Pods_1" must match [a-z0-9]([a-z0-9-]*[a-z0-9])? (at most 63 characters)"#,
        ),
        (
            "trailing dash",
            "providers:\n  - { name: pods-, type: kubernetes }\n",
            "providers[0].name: \"pods-\" must match",
        ),
        (
            "name too long",
            &format!("providers:\n  - {{ name: {}, type: kubernetes }}\n", "a".repeat(64)),
            "providers[0].name: \"aaaa",
        ),
        (
            "duplicate names",
            "providers:\n  - { name: a, type: kubernetes }\n  - { name: a, type: kubernetes }\n",
            r#"providers[1].name: duplicate provider name "a""#,
        ),
        (
            "block mismatch",
            "providers:\n  - { name: a, type: kubernetes, gcp: { project: my-project } }\n",
            r#"providers[0].gcp: does not match type "kubernetes"; use a `kubernetes:` block"#,
        ),
        (
            "missing required block",
            "providers:\n  - { name: a, type: gcp }\n",
            r#"providers[0].gcp: is required for type "gcp""#,
        ),
        (
            "missing block field",
            "providers:\n  - { name: a, type: gcp, gcp: {} }\n",
            "providers[0].gcp.project: is required",
        ),
        (
            "block check",
            "providers:\n  - { name: a, type: gcp, gcp: { project: p, defaultZone: b } }\n",
            r#"providers[0].gcp.defaultZone: "b" is not a zone"#,
        ),
        (
            "wrong scalar type",
            "providers:\n  - { name: a, type: kubernetes, kubernetes: { namespace: 5 } }\n",
            "providers[0].kubernetes.namespace: must be a string, found a number",
        ),
        (
            "out of range",
            "providers:\n  - { name: a, type: kubernetes, kubernetes: { fdLimit: 10 } }\n",
            "providers[0].kubernetes.fdLimit: 10 is out of range (1024 to 65536)",
        ),
        (
            "empty string",
            "providers:\n  - { name: a, type: kubernetes, kubernetes: { namespace: '' } }\n",
            "providers[0].kubernetes.namespace: must not be empty",
        ),
    ];
    for (name, text, expected) in cases {
        let found = match parse(text) {
            Ok(config) => panic!("{name}: expected a problem, parsed {config:?}"),
            Err(error) => error.problems.iter().map(ToString::to_string).collect::<Vec<_>>(),
        };
        assert!(found.iter().any(|problem| problem.contains(expected)), "{name}: expected {expected:?} in {found:#?}");
    }
}

#[test]
fn five_mistakes_give_five_messages() {
    let text = r#"
providers:
  - name: pods
    type: kubernetes
    kubernetes: { namespace: egress, colour: blue }
  - name: pods
    type: kubernetes
  - name: vms
    type: gcp
    gcp: { zones: [a] }
  - name: Bad_Name
    type: kubernetes
  - name: more-vms
    type: gcp
    gcp: { project: p, zones: [a], defaultZone: b }
"#;
    let error = parse(text).expect_err("five mistakes");
    let messages: Vec<String> = error.problems.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [
            "providers[0].kubernetes.colour: unknown field (expected one of: clusterNetworks, fdLimit, namespace)",
            r#"providers[1].name: duplicate provider name "pods""#,
            "providers[2].gcp.project: is required",
            r#"providers[3].name: "Bad_Name" must match [a-z0-9]([a-z0-9-]*[a-z0-9])? (at most 63 characters)"#,
            r#"providers[4].gcp.defaultZone: "b" is not a zone"#,
        ]
    );
    let shown = error.to_string();
    assert!(shown.starts_with("providers.yaml has 5 problems:"), "{shown}");
    assert_eq!(shown.lines().count(), 6, "{shown}");
}

#[test]
fn a_blocks_own_checks_run_in_the_same_pass_as_its_schema_problems() {
    // The bad zone list item is dropped, so the block still reads and its check still runs.
    let found =
        problems("providers:\n  - { name: a, type: gcp, gcp: { project: p, zones: [a, 5], defaultZone: b } }\n");
    assert_eq!(
        found,
        [
            "providers[0].gcp.zones[1]: must be a string, found a number",
            r#"providers[0].gcp.defaultZone: "b" is not a zone"#
        ]
    );
}

#[test]
fn identifiers() {
    for good in ["a", "pods", "gcp-eu-1", "0", &"a".repeat(63)] {
        assert!(is_identifier(good), "{good:?}");
    }
    for bad in ["", "-a", "a-", "A", "a_b", "a.b", "a/b", &"a".repeat(64)] {
        assert!(!is_identifier(bad), "{bad:?}");
    }
}

#[test]
fn the_schema_pattern_for_identifiers_agrees_with_is_identifier() {
    let regex = regex::Regex::new(IDENTIFIER_REGEX).expect("a regex");
    for value in
        ["a", "pods", "gcp-eu-1", "0", &"a".repeat(63), "", "-a", "a-", "A", "a_b", "a/b", &"a".repeat(64), "a\n"]
    {
        assert_eq!(regex.is_match(value), is_identifier(value), "{value:?}");
    }
}

#[test]
fn destinations_and_networks_parse() {
    let config = parse(
        r#"
providers:
  - name: pods
    type: kubernetes
    destinations:
      allow: ["127.0.0.1:8080", "*:8443", "[fd00::/8]:443"]
      deny: [203.0.113.0/24]
    kubernetes: { clusterNetworks: [10.244.0.0/16, "fd10::/64"] }
  - name: plain
    type: kubernetes
"#,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let pods = config.get("pods").expect("pods");
    let shown = |rules: &[DestinationRule]| rules.iter().map(ToString::to_string).collect::<Vec<_>>();
    assert_eq!(shown(&pods.destinations.allow), ["127.0.0.1/32:8080", "*:8443", "[fd00::/8]:443"]);
    assert_eq!(shown(&pods.destinations.deny), ["203.0.113.0/24"]);
    let networks: Vec<String> = pods.provider_networks().iter().map(ToString::to_string).collect();
    assert_eq!(networks, ["10.244.0.0/16", "fd10::/64"]);
    assert_eq!(config.get("plain").expect("plain").destinations, DestinationPolicy::default());
}

#[test]
fn malformed_destinations_are_reported_with_their_paths() {
    let found = problems(
        r#"
providers:
  - name: pods
    type: kubernetes
    destinations:
      allow: ["10.1.2.3/8", 8080]
      deny: example.com
      permit: []
    kubernetes: { clusterNetworks: ["10.244.0.0/16:80", nope] }
"#,
    );
    assert_eq!(found.len(), 6, "{found:#?}");
    assert!(found[0].starts_with("providers[0].destinations.permit: unknown field (expected one of: allow, deny)"));
    assert!(found[1].starts_with("providers[0].destinations.allow[0]: \"10.1.2.3/8\" is not a destination rule"));
    assert_eq!(found[2], "providers[0].destinations.allow[1]: must be a string, found a number");
    assert_eq!(found[3], "providers[0].destinations.deny: must be a list, found a string");
    assert_eq!(
        found[4],
        "providers[0].kubernetes.clusterNetworks[0]: \"10.244.0.0/16:80\" is not a network in CIDR notation such as 10.244.0.0/16"
    );
    assert!(found[5].starts_with("providers[0].kubernetes.clusterNetworks[1]: \"nope\""), "{}", found[5]);
}

#[test]
fn a_cooldown_policy_parses_in_part_and_its_mistakes_are_named() {
    let config = parse(
        r#"
providers:
  - name: small-fleet
    type: kubernetes
    cooldown: { baseSeconds: 30, factor: 3 }
  - name: plain
    type: kubernetes
"#,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let small = config.get("small-fleet").expect("small-fleet");
    assert_eq!(small.cooldown, CooldownSettings { base_seconds: Some(30), factor: Some(3), max_seconds: None });
    assert_eq!(config.get("plain").expect("plain").cooldown, CooldownSettings::default());
    let found = problems(
        r#"
providers:
  - name: a
    type: kubernetes
    cooldown: { baseSeconds: 0, factor: 11, maxSeconds: 700000, grow: 2 }
  - name: b
    type: kubernetes
    cooldown: { baseSeconds: 600, maxSeconds: 60 }
"#,
    );
    let expected = [
        "providers[0].cooldown.grow: unknown field (expected one of: baseSeconds, factor, maxSeconds)",
        "providers[0].cooldown.baseSeconds: 0 is out of range (1 to 86400)",
        "providers[0].cooldown.factor: 11 is out of range (1 to 10)",
        "providers[0].cooldown.maxSeconds: 700000 is out of range (1 to 604800)",
        "providers[1].cooldown.maxSeconds: 60 is less than baseSeconds (600)",
    ];
    assert_eq!(found.len(), expected.len(), "{found:#?}");
    for want in expected {
        assert!(found.iter().any(|problem| problem.contains(want)), "{want:?} not in {found:#?}");
    }
}

#[test]
fn a_pacing_parses_and_its_mistakes_are_named() {
    let config = parse(
        r#"
providers:
  - name: polite
    type: kubernetes
    pacing: { intervalMilliseconds: 12000, burst: 2 }
  - name: plain
    type: kubernetes
"#,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let polite = config.get("polite").expect("polite");
    assert_eq!(polite.pacing, Some(PacingSettings { interval_milliseconds: 12_000, burst: Some(2) }));
    assert_eq!(config.get("plain").expect("plain").pacing, None);
    let found = problems(
        r#"
providers:
  - name: a
    type: kubernetes
    pacing: { intervalMilliseconds: 0, burst: 1001, every: 2 }
  - name: b
    type: kubernetes
    pacing: { burst: 2 }
"#,
    );
    let expected = [
        "providers[0].pacing.every: unknown field (expected one of: burst, intervalMilliseconds)",
        "providers[0].pacing.intervalMilliseconds: 0 is out of range (1 to 86400000)",
        "providers[0].pacing.burst: 1001 is out of range (1 to 1000)",
        "providers[1].pacing.intervalMilliseconds",
    ];
    assert_eq!(found.len(), expected.len(), "{found:#?}");
    for want in expected {
        assert!(found.iter().any(|problem| problem.contains(want)), "{want:?} not in {found:#?}");
    }
}

#[test]
fn the_files_schema_has_the_frame_and_one_block_per_type() {
    let schema = types().schema();
    let entry = &schema["properties"]["providers"]["items"];
    assert_eq!(entry["properties"]["type"]["enum"], json!(["kubernetes", "gcp"]));
    assert_eq!(entry["additionalProperties"], json!(false));
    assert_eq!(entry["properties"]["gcp"], json!({ "$ref": "#/$defs/Vms" }));
    assert_eq!(schema["$defs"]["Vms"]["required"], json!(["project"]));
    assert_eq!(entry["properties"]["name"]["pattern"], json!(IDENTIFIER_REGEX));
    assert_eq!(schema["$defs"]["Pods"]["properties"]["clusterNetworks"]["items"]["format"], json!("cidr"));
    assert_eq!(entry["allOf"].as_array().map(Vec::len), Some(2), "one if/then per type");
    // Every reference resolves.
    let text = schema.to_string();
    for reference in text.split("\"$ref\":\"#/$defs/").skip(1) {
        let name = reference.split('"').next().unwrap_or_default();
        assert!(schema["$defs"].get(name).is_some(), "{name} is not in $defs");
    }
}
