//! The `kubernetes:` block of the providers file: where and how Squid pods run.

use std::collections::BTreeMap;

use egress_provider::config::{
    Problem, SettingsBlock, identifier, identifier_keys, identifier_list, networks, schema::pattern,
};
use ipnet::IpNet;
use schemars::{JsonSchema, Schema};
use serde::Deserialize;

/// `kubernetes:` — Squid in a Pod. Every field has a default, so the block may be left out.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Namespace for pods whose Proxy gives no `placement.zone`. Default `egress-proxies`.
    #[serde(default = "default_namespace")]
    #[schemars(transform = identifier)]
    pub namespace: String,
    /// Container image with Squid. Default `ubuntu/squid:latest`.
    #[serde(default = "default_image")]
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never`; unset leaves Kubernetes' default.
    #[schemars(extend("enum" = ["Always", "IfNotPresent", "Never"]))]
    pub image_pull_policy: Option<String>,
    /// The open-files limit Squid runs under (`ulimit -n`). Default 16384.
    #[serde(default = "default_fd_limit")]
    #[schemars(range(min = 1024, max = 1_048_576))]
    pub fd_limit: u32,
    /// Requests and memory limit for pods whose Proxy gives no `placement.machineType`.
    #[serde(default)]
    pub resources: ResourceProfile,
    /// Named resource profiles `placement.machineType` may select.
    #[serde(default)]
    #[schemars(transform = identifier_keys)]
    pub machine_types: BTreeMap<String, ResourceProfile>,
    /// The cluster's own pod and service networks, which its proxies may never reach (on top of the default
    /// denials, for clusters whose networks are not private ranges).
    #[serde(default, with = "networks")]
    #[schemars(with = "Vec<String>", transform = networks::schema)]
    pub cluster_networks: Vec<IpNet>,
    /// The only namespaces its pods may go in (`namespace` among them), when given: `placement.zone` must name one,
    /// and pods are listed in each of them rather than cluster-wide, so the operator needs no cluster-wide grant on
    /// pods, ConfigMaps or Secrets (`deploy/namespaced`). Empty: any namespace, listed cluster-wide.
    #[serde(default)]
    #[schemars(transform = identifier_list)]
    pub namespaces: Vec<String>,
}

/// A pod resource profile: CPU request, and memory as both request and limit.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourceProfile {
    /// CPU request, a Kubernetes quantity (`50m`, `1`). Default `50m`.
    #[serde(default = "default_cpu")]
    #[schemars(transform = quantity)]
    pub cpu: String,
    /// Memory request and limit, a Kubernetes quantity (`128Mi`). Default `128Mi`.
    #[serde(default = "default_memory")]
    #[schemars(transform = quantity)]
    pub memory: String,
}

impl Default for ResourceProfile {
    fn default() -> Self {
        Self { cpu: default_cpu(), memory: default_memory() }
    }
}

fn default_namespace() -> String {
    "egress-proxies".into()
}

fn default_image() -> String {
    "ubuntu/squid:latest".into()
}

fn default_fd_limit() -> u32 {
    16384
}

fn default_cpu() -> String {
    "50m".into()
}

fn default_memory() -> String {
    "128Mi".into()
}

/// The shape of a Kubernetes quantity: a decimal number and an optional suffix.
const QUANTITY: &str = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$";

fn quantity(schema: &mut Schema) {
    pattern(schema, QUANTITY, "is not a Kubernetes quantity such as 100m, 1 or 128Mi");
}

impl SettingsBlock for KubernetesConfig {
    const TYPE: &'static str = "kubernetes";

    fn check(&mut self, at: &str, problems: &mut Vec<Problem>) {
        if !self.namespaces.is_empty() && !self.namespaces.contains(&self.namespace) {
            problems.push(Problem {
                path: format!("{at}.namespaces"),
                message: format!(
                    "must include {:?}, the namespace of pods whose Proxy gives no placement.zone",
                    self.namespace
                ),
            });
        }
    }

    fn denied_networks(&self) -> &[IpNet] {
        &self.cluster_networks
    }
}

#[cfg(test)]
mod tests {
    use egress_provider::config::{ProvidersConfig, SettingsTypes};

    use super::*;

    fn parse(text: &str) -> Result<KubernetesConfig, Vec<String>> {
        match ProvidersConfig::parse(text, "providers.yaml", &SettingsTypes::new().with::<KubernetesConfig>()) {
            Ok(config) => Ok(config.providers[0].settings::<KubernetesConfig>().expect("kubernetes").clone()),
            Err(error) => Err(error.problems.iter().map(ToString::to_string).collect()),
        }
    }

    #[test]
    fn a_block_left_out_or_given_in_part_takes_the_defaults() {
        let pods = parse("providers:\n  - { name: pods, type: kubernetes }\n").expect("parses");
        assert_eq!(
            (pods.namespace.as_str(), pods.image.as_str(), pods.fd_limit, pods.resources.memory.as_str()),
            ("egress-proxies", "ubuntu/squid:latest", 16384, "128Mi")
        );
        assert_eq!((pods.image_pull_policy, pods.namespaces.len()), (None, 0));
        let big = parse(
            r#"
providers:
  - name: pods-big
    type: kubernetes
    kubernetes:
      namespace: egress
      image: ubuntu/squid:6.10
      imagePullPolicy: IfNotPresent
      fdLimit: 4096
      resources: { cpu: 100m }
      machineTypes:
        large: { cpu: "1", memory: 1Gi }
"#,
        )
        .expect("parses");
        assert_eq!(big.machine_types["large"], ResourceProfile { cpu: "1".into(), memory: "1Gi".into() });
        assert_eq!(big.resources, ResourceProfile { cpu: "100m".into(), memory: "128Mi".into() });
        assert_eq!((big.image_pull_policy.as_deref(), big.fd_limit), (Some("IfNotPresent"), 4096));
    }

    #[test]
    fn each_mistake_has_its_message_and_path() {
        let cases = [
            ("{ image: 5 }", "providers[0].kubernetes.image: must be a string, found a number"),
            ("{ fdLimit: 10 }", "providers[0].kubernetes.fdLimit: 10 is out of range (1024 to 1048576)"),
            (
                "{ resources: { cpu: lots } }",
                r#"providers[0].kubernetes.resources.cpu: "lots" is not a Kubernetes quantity"#,
            ),
            ("{ resources: { cpu: 1.5.1 } }", r#"providers[0].kubernetes.resources.cpu: "1.5.1" is not a Kubernetes"#),
            (
                "{ imagePullPolicy: Sometimes }",
                r#"providers[0].kubernetes.imagePullPolicy: "Sometimes" is not one of: Always, IfNotPresent, Never"#,
            ),
            ("{ image: '' }", "providers[0].kubernetes.image: must not be empty"),
            (
                "{ machineTypes: { Big: { cpu: '1' } } }",
                r#"providers[0].kubernetes.machineTypes.Big: "Big" must match"#,
            ),
            (
                "{ colour: blue }",
                "providers[0].kubernetes.colour: unknown field (expected one of: clusterNetworks, fdLimit,",
            ),
        ];
        for (block, expected) in cases {
            let found = parse(&format!("providers:\n  - {{ name: a, type: kubernetes, kubernetes: {block} }}\n"))
                .expect_err(block);
            assert!(
                found.iter().any(|problem| problem.contains(expected)),
                "{block}: expected {expected:?} in {found:#?}"
            );
        }
    }

    #[test]
    fn quantities() {
        let regex = regex::Regex::new(QUANTITY).expect("a regex");
        for good in ["1", "50m", "0.5", "128Mi", "2Gi", "1.5G", "100k"] {
            assert!(regex.is_match(good), "{good:?}");
        }
        for bad in ["", "m", "1.", ".5", "1..5", "10mb", "1 Gi", "lots", "1e3"] {
            assert!(!regex.is_match(bad), "{bad:?}");
        }
    }

    #[test]
    fn cluster_networks_are_denied() {
        let text = "providers:\n  - { name: a, type: kubernetes, kubernetes: { clusterNetworks: [10.244.0.0/16, \"fd10::/64\"] } }\n";
        let config =
            ProvidersConfig::parse(text, "p", &SettingsTypes::new().with::<KubernetesConfig>()).expect("parses");
        let networks: Vec<String> = config.providers[0].provider_networks().iter().map(ToString::to_string).collect();
        assert_eq!(networks, ["10.244.0.0/16", "fd10::/64"]);
    }

    #[test]
    fn namespaces_parse_and_bad_ones_are_reported_with_their_paths() {
        let settings = parse("providers:\n  - { name: pods, type: kubernetes, kubernetes: { namespace: crawl, namespaces: [crawl, crawl-eu] } }\n")
            .expect("parses");
        assert_eq!(settings.namespaces, ["crawl", "crawl-eu"]);
        let found = parse("providers:\n  - { name: pods, type: kubernetes, kubernetes: { namespace: crawl, namespaces: [crawl-eu] } }\n")
            .expect_err("the default namespace is not allowed");
        assert_eq!(
            found,
            [
                "providers[0].kubernetes.namespaces: must include \"crawl\", the namespace of pods whose Proxy gives no placement.zone"
            ]
        );
        let found = parse(
            "providers:\n  - { name: pods, type: kubernetes, kubernetes: { namespace: crawl, namespaces: [crawl-eu, Crawl_US, crawl-eu, 7] } }\n",
        )
        .expect_err("three mistakes");
        assert_eq!(
            found,
            [
                "providers[0].kubernetes.namespaces[1]: \"Crawl_US\" must match [a-z0-9]([a-z0-9-]*[a-z0-9])? (at most 63 characters)",
                "providers[0].kubernetes.namespaces[3]: must be a string, found a number",
                "providers[0].kubernetes.namespaces[2]: \"crawl-eu\" is listed twice",
            ],
            "{found:#?}"
        );
    }
}
