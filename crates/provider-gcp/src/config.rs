//! The `gcp:` block of the providers file: the project and defaults Compute Engine instances are created with.

use std::path::PathBuf;

use egress_provider::config::{SettingsBlock, http_url, identifier, schema::pattern};
use schemars::{JsonSchema, Schema};
use serde::Deserialize;

/// `gcp:` — Compute Engine.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GcpConfig {
    /// The project instances are created in.
    #[schemars(transform = project_id)]
    pub project: String,
    /// The VPC network. Default `default`.
    #[serde(default = "default_network")]
    pub network: String,
    /// The subnetwork, when the network is in custom mode.
    pub subnetwork: Option<String>,
    /// The zone for Proxies that give no `placement.zone`.
    pub default_zone: Option<String>,
    /// The machine type for Proxies that give no `placement.machineType`. Default `e2-micro`.
    #[serde(default = "default_machine_type")]
    pub default_machine_type: String,
    /// The image for Proxies that give no `placement.image`; it must run cloud-init. Default Ubuntu 24.04 LTS.
    #[serde(default = "default_image")]
    pub default_image: String,
    /// The network tag the user's firewall rule opens the proxy port for. Default `egress-proxy`.
    #[serde(default = "default_firewall_tag")]
    #[schemars(transform = identifier)]
    pub firewall_tag: String,
    /// A service-account key file; unset uses Application Default Credentials.
    pub credentials_file: Option<PathBuf>,
    /// The Compute Engine endpoint; unset uses Google's. For private endpoints and tests.
    #[schemars(transform = http_url)]
    pub endpoint: Option<String>,
    /// `wireLogging: true` turns on the SDK's own request tracing (whole requests and responses, at debug), which
    /// the operator logs through a redacting layer: records about auth or tokens dropped, fields over 1 KiB and any
    /// value holding user data elided. Default false.
    #[serde(default)]
    pub wire_logging: bool,
}

impl GcpConfig {
    /// Settings for `project` with every default (the file's `gcp: { project: … }`).
    pub fn new(project: impl Into<String>) -> Self {
        Self {
            project: project.into(),
            network: default_network(),
            subnetwork: None,
            default_zone: None,
            default_machine_type: default_machine_type(),
            default_image: default_image(),
            firewall_tag: default_firewall_tag(),
            credentials_file: None,
            endpoint: None,
            wire_logging: false,
        }
    }
}

fn default_network() -> String {
    "default".into()
}

fn default_machine_type() -> String {
    "e2-micro".into()
}

fn default_image() -> String {
    "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64".into()
}

fn default_firewall_tag() -> String {
    "egress-proxy".into()
}

/// A project ID: 6 to 30 lowercase letters, digits and dashes, starting with a letter, not ending with a dash.
const PROJECT_ID: &str = "^[a-z][a-z0-9-]{4,28}[a-z0-9]$";

fn project_id(schema: &mut Schema) {
    pattern(
        schema,
        PROJECT_ID,
        "is not a project ID (6 to 30 lowercase letters, digits and dashes, starting with a letter)",
    );
}

impl SettingsBlock for GcpConfig {
    const TYPE: &'static str = "gcp";
}

#[cfg(test)]
mod tests {
    use egress_provider::config::ProvidersConfig;

    use super::*;

    fn parse(block: &str) -> Result<GcpConfig, Vec<String>> {
        let text = format!("providers:\n  - {{ name: g, type: gcp, gcp: {block} }}\n");
        match ProvidersConfig::parse_as::<GcpConfig>(&text, "providers.yaml") {
            Ok(config) => Ok(config.providers[0].settings::<GcpConfig>().expect("gcp").clone()),
            Err(error) => Err(error.problems.iter().map(ToString::to_string).collect()),
        }
    }

    #[test]
    fn a_block_with_a_project_takes_the_defaults() {
        let gcp = parse("{ project: my-project, defaultZone: europe-west1-b, endpoint: \"http://127.0.0.1:9000\" }")
            .expect("parses");
        assert_eq!(
            (gcp.network.as_str(), gcp.default_machine_type.as_str(), gcp.firewall_tag.as_str()),
            ("default", "e2-micro", "egress-proxy")
        );
        assert!(!gcp.wire_logging, "the SDK's wire logging is off unless asked for");
        assert_eq!(
            gcp,
            GcpConfig {
                default_zone: Some("europe-west1-b".into()),
                endpoint: Some("http://127.0.0.1:9000".into()),
                ..GcpConfig::new("my-project")
            },
            "the file's defaults are GcpConfig::new's"
        );
        assert!(parse("{ project: my-project, wireLogging: true }").expect("parses").wire_logging);
    }

    #[test]
    fn each_mistake_has_its_message_and_path() {
        let cases = [
            ("{}", "providers[0].gcp.project: is required"),
            ("{ project: My_Project }", r#"providers[0].gcp.project: "My_Project" is not a project ID"#),
            ("{ project: short }", r#"providers[0].gcp.project: "short" is not a project ID"#),
            ("{ project: ends-with-dash- }", r#"providers[0].gcp.project: "ends-with-dash-" is not a project ID"#),
            (
                "{ project: my-project, endpoint: ftp://x }",
                r#"providers[0].gcp.endpoint: "ftp://x" must be an http:// or https:// URL"#,
            ),
            (
                "{ project: my-project, endpoint: \"http:///x\" }",
                r#"providers[0].gcp.endpoint: "http:///x" must be an http"#,
            ),
            (
                "{ project: my-project, wireLogging: \"yes\" }",
                "providers[0].gcp.wireLogging: must be true or false, found a string",
            ),
            ("{ project: my-project, firewallTag: Web }", r#"providers[0].gcp.firewallTag: "Web" must match"#),
        ];
        for (block, expected) in cases {
            let found = parse(block).expect_err(block);
            assert!(
                found.iter().any(|problem| problem.contains(expected)),
                "{block}: expected {expected:?} in {found:#?}"
            );
        }
    }
}
