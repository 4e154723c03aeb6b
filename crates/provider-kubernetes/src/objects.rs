//! The Kubernetes objects of one proxy instance (Pod, ConfigMap, Secret) and the label mapping of the GC contract.

use std::collections::BTreeMap;

use crate::config::{KubernetesConfig, ResourceProfile};
use egress_provider::{CreateRequest, ProviderError, Tags};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, Pod, PodSpec, Probe, ResourceRequirements, Secret,
    SecretVolumeSource, SecurityContext, TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ObjectMeta;

use crate::squid::{self, Layout, SquidConfig};
use egress_provider::destinations::DestinationPolicy;

/// Tags become labels under this prefix: `crawl.example.com/cluster`, `crawl.example.com/proxy-uid`, ...
pub const LABEL_PREFIX: &str = "crawl.example.com/";

/// The label naming the instance on all of its objects.
pub const INSTANCE_LABEL: &str = "crawl.example.com/instance";

/// The label key a tag is stored under.
pub fn tag_label(key: &str) -> String {
    format!("{LABEL_PREFIX}{key}")
}

fn labels(request: &CreateRequest) -> BTreeMap<String, String> {
    let mut labels: BTreeMap<String, String> =
        request.tags.iter().map(|(key, value)| (tag_label(key), value.to_owned())).collect();
    labels.insert(INSTANCE_LABEL.into(), request.name.clone());
    labels.insert("app.kubernetes.io/name".into(), "egress-proxy".into());
    labels.insert("app.kubernetes.io/managed-by".into(), Tags::MANAGED_BY_VALUE.into());
    labels
}

/// The tags recorded in an object's labels.
pub fn tags_from_labels(labels: &BTreeMap<String, String>) -> Tags {
    labels
        .iter()
        .filter_map(|(key, value)| Some((key.strip_prefix(LABEL_PREFIX)?, value.as_str())))
        .filter(|(key, _)| *key != "instance")
        .collect()
}

/// Whether `value` is a valid label value: at most 63 characters of `[A-Za-z0-9._-]`, alphanumeric at both ends.
fn is_label_value(value: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    value.is_empty()
        || (value.len() <= 63
            && value.starts_with(alnum)
            && value.ends_with(alnum)
            && value.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.')))
}

/// A label selector matching every tag; a tag that cannot be a label is a permanent error.
pub fn selector(tags: &Tags) -> Result<String, ProviderError> {
    validate_tags(tags)?;
    Ok(tags.iter().map(|(key, value)| format!("{}={value}", tag_label(key))).collect::<Vec<_>>().join(","))
}

fn validate_tags(tags: &Tags) -> Result<(), ProviderError> {
    for (key, value) in tags.iter() {
        let key_ok = !key.is_empty() && key.len() <= 63 && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !key_ok || !is_label_value(value) {
            return Err(ProviderError::permanent(format!(
                "tag {key}={value:?} cannot be a Kubernetes label (values: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends)"
            )));
        }
    }
    Ok(())
}

fn metadata(request: &CreateRequest, namespace: &str, owner: Option<OwnerReference>) -> ObjectMeta {
    ObjectMeta {
        name: Some(request.name.clone()),
        namespace: Some(namespace.to_owned()),
        labels: Some(labels(request)),
        owner_references: owner.map(|owner| vec![owner]),
        ..ObjectMeta::default()
    }
}

/// The proxy pod.
pub fn pod(
    config: &KubernetesConfig,
    request: &CreateRequest,
    namespace: &str,
    image: &str,
    resources: &ResourceProfile,
) -> Result<Pod, ProviderError> {
    validate_tags(&request.tags)?;
    if request.port == 0 {
        return Err(ProviderError::permanent("port 0 is not a valid proxy port"));
    }
    let port = i32::from(request.port);
    let mut mounts = vec![VolumeMount {
        name: "config".into(),
        mount_path: squid::CONFIG_DIR.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    }];
    let mut volumes = vec![Volume {
        name: "config".into(),
        config_map: Some(ConfigMapVolumeSource { name: request.name.clone(), ..ConfigMapVolumeSource::default() }),
        ..Volume::default()
    }];
    if request.credentials.is_some() {
        mounts.push(VolumeMount {
            name: "auth".into(),
            mount_path: squid::AUTH_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        volumes.push(Volume {
            name: "auth".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(request.name.clone()),
                // Squid runs its auth helper as the unprivileged `proxy` user, which must read the hash file.
                default_mode: Some(0o444),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
    let quantity = |value: &str| Quantity(value.to_owned());
    let container = Container {
        name: "squid".into(),
        image: Some(image.to_owned()),
        image_pull_policy: config.image_pull_policy.clone(),
        command: Some(vec!["/bin/sh".into(), "-c".into(), squid_command(config.fd_limit)]),
        ports: Some(vec![ContainerPort {
            name: Some("proxy".into()),
            container_port: port,
            ..ContainerPort::default()
        }]),
        readiness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction { port: IntOrString::Int(port), ..TCPSocketAction::default() }),
            period_seconds: Some(5),
            failure_threshold: Some(2),
            ..Probe::default()
        }),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".into(), quantity(&resources.cpu)),
                ("memory".into(), quantity(&resources.memory)),
            ])),
            limits: Some(BTreeMap::from([("memory".into(), quantity(&resources.memory))])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(mounts),
        ..Container::default()
    };
    Ok(Pod {
        metadata: metadata(request, namespace, None),
        spec: Some(PodSpec {
            containers: vec![container],
            volumes: Some(volumes),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(10),
            ..PodSpec::default()
        }),
        status: None,
    })
}

/// The container's shell command. Squid, started as root, switches to its user before it opens its logs by path
/// (`/dev/stdout`, `/dev/stderr`, as the rendered configuration names them); a runtime's output pipes belong to root
/// with mode 0600, which that user cannot reopen, and Squid would stop with "Cannot open '/dev/stdout' for writing".
/// So the pipes are given to Squid's user first. Squid sizes its descriptor table from RLIMIT_NOFILE, and an unlimited
/// or huge limit makes it allocate gigabytes and get OOM-killed, so the limit is set before exec.
fn squid_command(fd_limit: u32) -> String {
    format!(
        "chown {user} /proc/self/fd/1 /proc/self/fd/2 2>/dev/null; ulimit -n {fd_limit} && exec squid -N -f {}/{}",
        squid::CONFIG_DIR,
        squid::CONFIG_KEY,
        user = squid::EFFECTIVE_USER
    )
}

/// The ConfigMap with `squid.conf`, enforcing `destinations` and denying the cluster's own networks.
pub fn config_map(
    request: &CreateRequest,
    namespace: &str,
    owner: Option<OwnerReference>,
    destinations: &DestinationPolicy,
    settings: &KubernetesConfig,
) -> ConfigMap {
    let password_file = squid::container_password_file();
    let conf = squid::render(&SquidConfig {
        instance: &request.name,
        port: request.port,
        password_file: request.credentials.as_ref().map(|_| password_file.as_str()),
        policy: destinations,
        provider_networks: &settings.cluster_networks,
        layout: Layout::Container,
    });
    ConfigMap {
        metadata: metadata(request, namespace, owner),
        data: Some(BTreeMap::from([(squid::CONFIG_KEY.to_owned(), conf)])),
        ..ConfigMap::default()
    }
}

/// The Secret with the password file, when the request has credentials.
pub fn auth_secret(request: &CreateRequest, namespace: &str, owner: Option<OwnerReference>) -> Option<Secret> {
    let credentials = request.credentials.as_ref()?;
    let line = squid::password_line(&request.name, credentials);
    Some(Secret {
        metadata: metadata(request, namespace, owner),
        data: Some(BTreeMap::from([(squid::PASSWORD_KEY.to_owned(), ByteString(line.into_bytes()))])),
        type_: Some("Opaque".into()),
        ..Secret::default()
    })
}

#[cfg(test)]
mod tests {
    use egress_provider::config::ProvidersConfig;

    use super::*;

    fn request() -> CreateRequest {
        CreateRequest::new("px-abc", 3128, Tags::gc_contract("prod", "0b6f6a2e-uid", "340e470e78ddee5a"))
    }

    #[test]
    fn tags_round_trip_through_labels() {
        let request = request();
        let labels = labels(&request);
        assert_eq!(labels[INSTANCE_LABEL], "px-abc");
        assert_eq!(labels["crawl.example.com/cluster"], "prod");
        assert_eq!(tags_from_labels(&labels), request.tags);
    }

    #[test]
    fn selector_lists_every_tag_and_refuses_bad_values() {
        assert_eq!(
            selector(&Tags::owned_by_cluster("prod")).expect("valid"),
            "crawl.example.com/cluster=prod,crawl.example.com/managed-by=egress-operator"
        );
        let bad = Tags::owned_by_cluster("prod/eu");
        assert_eq!(
            selector(&bad).expect_err("a slash is not a label value").class(),
            egress_provider::ErrorClass::Permanent
        );
    }

    #[test]
    fn pod_bounds_descriptors_and_mounts_auth_only_with_credentials() {
        let config =
            ProvidersConfig::parse_as::<KubernetesConfig>("providers:\n  - { name: pods, type: kubernetes }\n", "test")
                .expect("valid");
        let config = config.providers[0].settings::<KubernetesConfig>().expect("kubernetes");
        let pod = pod(config, &request(), "egress", "ubuntu/squid:latest", &config.resources).expect("pod");
        let spec = pod.spec.expect("spec");
        let command = spec.containers[0].command.clone().expect("command").join(" ");
        assert!(
            command.contains(
                "chown proxy /proc/self/fd/1 /proc/self/fd/2 2>/dev/null; \
                 ulimit -n 16384 && exec squid -N -f /etc/squid-egress/squid.conf"
            ),
            "{command}"
        );
        assert_eq!(spec.volumes.as_ref().map(Vec::len), Some(1));
        assert_eq!(
            spec.containers[0].readiness_probe.as_ref().and_then(|probe| probe.tcp_socket.clone()).map(|tcp| tcp.port),
            Some(IntOrString::Int(3128))
        );
        assert!(auth_secret(&request(), "egress", None).is_none());
    }

    #[test]
    fn the_config_map_denies_the_cluster_networks_and_applies_the_policy() {
        let config = ProvidersConfig::parse_as::<KubernetesConfig>(
            "providers:\n  - name: pods\n    type: kubernetes\n    destinations: { allow: [\"127.0.0.1:8080\"] }\n    \
             kubernetes: { clusterNetworks: [34.118.224.0/20] }\n",
            "test",
        )
        .expect("valid");
        let provider = &config.providers[0];
        let settings = provider.settings::<KubernetesConfig>().expect("kubernetes");
        let map = config_map(&request(), "egress", None, &provider.destinations, settings);
        let conf = &map.data.expect("data")[squid::CONFIG_KEY];
        assert!(conf.contains("\nacl egress_provider_network dst 34.118.224.0/20\n"), "{conf}");
        assert!(conf.contains("\nhttp_access allow egress_allow_0_dst egress_allow_0_port\n"));
        assert!(!conf.contains("auth_param"), "no credentials, no auth");
    }
}
