//! The `aws:` block of the providers file: the region, subnet and defaults EC2 instances are launched with.

use egress_provider::config::{SettingsBlock, http_url, networks, schema::pattern};
use ipnet::IpNet;
use schemars::{JsonSchema, Schema};
use serde::Deserialize;

/// `aws:` — EC2.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AwsConfig {
    /// The region instances are launched in (`eu-west-1`).
    #[schemars(transform = region)]
    pub region: String,
    /// The subnet instances are launched in: one whose route table sends 0.0.0.0/0 to an internet gateway, so each
    /// instance gets a public address of its own.
    #[schemars(transform = subnet_id)]
    pub subnet_id: String,
    /// The AMI for Proxies that give no `placement.image`; it must run cloud-init (Debian and Ubuntu's do). AMI IDs
    /// differ per region: docs/providers/aws.md says how to find the current one.
    #[schemars(transform = image_id)]
    pub default_image_id: Option<String>,
    /// The instance type for Proxies that give no `placement.machineType`. Default `t3.micro`.
    #[serde(default = "default_instance_type")]
    pub default_instance_type: String,
    /// The networks allowed to reach the proxy port: the operator's (its probe) and the crawlers'. The provider keeps
    /// one security group per cluster and VPC (`egress-operator-<cluster>`) admitting exactly these on each Proxy's
    /// port. At least one; `0.0.0.0/0` is allowed but opens the proxy to the internet, behind its password only.
    #[serde(with = "networks")]
    #[schemars(with = "Vec<String>", transform = allowed_sources)]
    pub allowed_sources: Vec<IpNet>,
    /// Security groups the user manages, attached to every instance besides the provider's own.
    #[serde(default)]
    #[schemars(transform = security_group_ids)]
    pub security_group_ids: Vec<String>,
    /// Which of an instance's addresses the operator records, probes and hands to crawlers: `public` (default), or
    /// `private` when the operator and every crawler run inside the VPC (or peered with it).
    #[serde(default)]
    #[schemars(with = "String", transform = address_kind)]
    pub address: AddressKind,
    /// The shared config profile to read credentials from, when neither the environment nor web identity gives
    /// them; unset uses `AWS_PROFILE`, then `default`.
    pub profile: Option<String>,
    /// The EC2 endpoint; unset uses `https://ec2.<region>.amazonaws.com`. For private endpoints and tests.
    #[schemars(transform = http_url)]
    pub endpoint: Option<String>,
    /// The STS endpoint web identity credentials are exchanged at; unset uses `https://sts.<region>.amazonaws.com`.
    #[schemars(transform = http_url)]
    pub sts_endpoint: Option<String>,
}

/// Which address of an instance is the proxy's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum AddressKind {
    /// The public IPv4 address EC2 assigns at launch.
    #[default]
    Public,
    /// The address inside the VPC.
    Private,
}

impl AwsConfig {
    /// Settings for `region` and `subnet_id`, admitting `allowed_sources`, with every other default.
    pub fn new(region: impl Into<String>, subnet_id: impl Into<String>, allowed_sources: Vec<IpNet>) -> Self {
        Self {
            region: region.into(),
            subnet_id: subnet_id.into(),
            default_image_id: None,
            default_instance_type: default_instance_type(),
            allowed_sources,
            security_group_ids: Vec::new(),
            address: AddressKind::Public,
            profile: None,
            endpoint: None,
            sts_endpoint: None,
        }
    }

    /// The EC2 endpoint calls go to.
    pub fn ec2_endpoint(&self) -> String {
        self.endpoint.clone().unwrap_or_else(|| format!("https://ec2.{}.amazonaws.com", self.region))
    }

    /// The STS endpoint web identity credentials come from.
    pub fn sts_endpoint(&self) -> String {
        self.sts_endpoint.clone().unwrap_or_else(|| format!("https://sts.{}.amazonaws.com", self.region))
    }
}

fn default_instance_type() -> String {
    "t3.micro".into()
}

fn region(schema: &mut Schema) {
    pattern(schema, "^[a-z]{2}(-[a-z]+)+-[0-9]+$", "is not an AWS region (like eu-west-1)");
}

fn subnet_id(schema: &mut Schema) {
    pattern(schema, "^subnet-[0-9a-f]{8,17}$", "is not a subnet ID (subnet- and 8 or 17 hex digits)");
}

fn image_id(schema: &mut Schema) {
    pattern(schema, "^ami-[0-9a-f]{8,17}$", "is not an AMI ID (ami- and 8 or 17 hex digits)");
}

fn security_group_ids(schema: &mut Schema) {
    let mut item = schemars::json_schema!({ "type": "string" });
    pattern(&mut item, "^sg-[0-9a-f]{8,17}$", "is not a security group ID (sg- and 8 or 17 hex digits)");
    schema.insert("items".into(), item.to_value());
    schema.insert("uniqueItems".into(), true.into());
}

fn address_kind(schema: &mut Schema) {
    schema.insert("enum".into(), serde_json::json!(["public", "private"]));
}

fn allowed_sources(schema: &mut Schema) {
    networks::schema(schema);
    schema.insert("minItems".into(), 1.into());
}

impl SettingsBlock for AwsConfig {
    const TYPE: &'static str = "aws";
}

#[cfg(test)]
mod tests {
    use egress_provider::config::ProvidersConfig;

    use super::*;

    fn parse(block: &str) -> Result<AwsConfig, Vec<String>> {
        let text = format!("providers:\n  - {{ name: a, type: aws, aws: {block} }}\n");
        match ProvidersConfig::parse_as::<AwsConfig>(&text, "providers.yaml") {
            Ok(config) => Ok(config.providers[0].settings::<AwsConfig>().expect("aws").clone()),
            Err(error) => Err(error.problems.iter().map(ToString::to_string).collect()),
        }
    }

    const MINIMAL: &str = "region: eu-west-1, subnetId: subnet-0123456789abcdef0, allowedSources: [198.51.100.0/24]";

    #[test]
    fn a_minimal_block_takes_the_defaults() {
        let aws = parse(&format!("{{ {MINIMAL} }}")).expect("parses");
        assert_eq!(
            aws,
            AwsConfig::new("eu-west-1", "subnet-0123456789abcdef0", vec!["198.51.100.0/24".parse().unwrap()])
        );
        assert_eq!(aws.ec2_endpoint(), "https://ec2.eu-west-1.amazonaws.com");
        assert_eq!(aws.sts_endpoint(), "https://sts.eu-west-1.amazonaws.com");
        let private =
            parse(&format!("{{ {MINIMAL}, address: private, endpoint: \"http://127.0.0.1:5000\" }}")).expect("parses");
        assert_eq!(private.address, AddressKind::Private);
        assert_eq!(private.ec2_endpoint(), "http://127.0.0.1:5000");
    }

    #[test]
    fn each_mistake_has_its_message_and_path() {
        let cases = [
            ("{}", "providers[0].aws.region: is required"),
            ("{}", "providers[0].aws.subnetId: is required"),
            ("{}", "providers[0].aws.allowedSources: is required"),
            (
                "{ region: Europe, subnetId: subnet-0123456789abcdef0, allowedSources: [10.0.0.0/8] }",
                r#"providers[0].aws.region: "Europe" is not an AWS region"#,
            ),
            (
                "{ region: eu-west-1, subnetId: sn-1, allowedSources: [10.0.0.0/8] }",
                r#"providers[0].aws.subnetId: "sn-1" is not a subnet ID"#,
            ),
            ("{ region: eu-west-1, subnetId: subnet-0123456789abcdef0, allowedSources: [] }", "allowedSources"),
            (
                "{ region: eu-west-1, subnetId: subnet-0123456789abcdef0, allowedSources: [the-office] }",
                "allowedSources",
            ),
            (
                "{ region: eu-west-1, subnetId: subnet-0123456789abcdef0, allowedSources: [10.0.0.0/8], \
                 defaultImageId: debian }",
                r#"providers[0].aws.defaultImageId: "debian" is not an AMI ID"#,
            ),
            (
                "{ region: eu-west-1, subnetId: subnet-0123456789abcdef0, allowedSources: [10.0.0.0/8], \
                 securityGroupIds: [web] }",
                r#"providers[0].aws.securityGroupIds[0]: "web" is not a security group ID"#,
            ),
            (
                "{ region: eu-west-1, subnetId: subnet-0123456789abcdef0, allowedSources: [10.0.0.0/8], \
                 address: elastic }",
                "providers[0].aws.address",
            ),
            (
                "{ region: eu-west-1, subnetId: subnet-0123456789abcdef0, allowedSources: [10.0.0.0/8], \
                 accessKey: AKIA }",
                "accessKey",
            ),
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
