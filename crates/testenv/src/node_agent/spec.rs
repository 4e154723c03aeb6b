//! Turning a Pod into processes: volumes materialised on disk, each container's environment and command line, its
//! user, and its mounts, the way kubelet and a container runtime would set them up.

use std::collections::BTreeMap;
use std::fs;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, DownwardAPIVolumeFile, KeyToPath, ObjectFieldSelector, Pod, Probe, Secret, ServiceAccount,
    Volume,
};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};

use super::{ImageMap, Runtime};
pub(crate) use crate::process::shell_quote;
use crate::squid::service_name;

/// What kubelet would otherwise find in the image: the search path every container gets.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long a projected service-account token is asked to live: kubelet's `kube-api-access` default.
const TOKEN_SECONDS: i64 = 3607;

/// One container, ready to run.
#[derive(Clone, Debug)]
pub(crate) struct ContainerPlan {
    pub name: String,
    pub image: String,
    /// The shell command line that starts it (under the agent's wrapper).
    pub script: String,
    /// For exec probes: the prefix that enters the container's mount namespace (`{pid}` is replaced) and takes its
    /// user, followed by `env -i` with its environment.
    pub exec_prefix: Vec<String>,
    pub readiness: Option<Probe>,
    pub liveness: Option<Probe>,
    pub startup: Option<Probe>,
    /// Named container ports, for probes that name theirs.
    pub ports: BTreeMap<String, u16>,
}

/// A whole pod, ready to run.
#[derive(Clone, Debug)]
pub(crate) struct PodPlan {
    pub containers: Vec<ContainerPlan>,
    /// The group that must reach the pod's directory (Squid's `proxy`, or the pod's user's group); root alone when
    /// `None`.
    pub group: Option<u32>,
    /// Whether its Secret and ConfigMap volumes are kept in line with their objects (every container is a program
    /// that reads its mounts; a Squid pod's configuration is rewritten once, at start).
    pub refreshes: bool,
    /// `Always`, `OnFailure` or `Never`.
    pub restart_policy: String,
    /// `terminationGracePeriodSeconds` (30 when unset).
    pub grace: Duration,
}

/// Why a pod cannot start yet, as kubelet reports it on its containers (`reason` and `message` of `waiting`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Waiting {
    pub reason: &'static str,
    pub message: String,
}

impl Waiting {
    fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self { reason, message: message.into() }
    }
}

/// What one pass of preparation found.
pub(crate) enum Prepared {
    Ready(PodPlan),
    Waiting(Waiting),
}

/// What the agent knows that a pod's setup needs.
pub(crate) struct Node<'a> {
    pub client: &'a Client,
    pub images: &'a ImageMap,
    pub apiserver: Option<std::net::SocketAddr>,
}

/// Materialises the pod's volumes under `dir` and plans each container. A referenced object that does not exist yet,
/// or an image with no local program, is a [`Waiting`]; a pod the agent can never run is an error.
pub(crate) async fn prepare(node: &Node<'_>, pod: &Pod, ip: Ipv4Addr, dir: &Path) -> Result<Prepared> {
    let spec = pod.spec.as_ref().context("the pod has no spec")?;
    let namespace = pod.namespace().unwrap_or_default();
    let volumes_dir = dir.join("volumes");
    let mut volume_dirs = BTreeMap::new();
    for volume in spec.volumes.iter().flatten() {
        let target = volumes_dir.join(&volume.name);
        match materialise(node.client, pod, &namespace, ip, volume, &target).await? {
            Some(source) => {
                volume_dirs.insert(volume.name.clone(), source);
            }
            None => {
                let _ = fs::remove_dir_all(&target);
                return Ok(Prepared::Waiting(Waiting::new(
                    "ContainerCreating",
                    format!(
                        "volume {}: a referenced ConfigMap, Secret or ServiceAccount does not exist yet",
                        volume.name
                    ),
                )));
            }
        }
    }
    let mut containers = Vec::new();
    let mut group = None;
    let mut refreshes = true;
    for container in &spec.containers {
        let image = container.image.clone().unwrap_or_default();
        let Some(runtime) = node.images.resolve(&image) else {
            return Ok(Prepared::Waiting(Waiting::new(
                "ErrImagePull",
                format!("the local node agent maps no program to image {image:?}"),
            )));
        };
        let env = match environment(node, pod, &namespace, ip, container, runtime).await? {
            Ok(env) => env,
            Err(waiting) => return Ok(Prepared::Waiting(waiting)),
        };
        let plan = match runtime {
            Runtime::Squid => {
                // Squid drops to `proxy`, which reads the password file and writes its logs here.
                group = group.or_else(|| group_id("proxy"));
                refreshes = false;
                plan_squid(container, &volume_dirs, ip, dir, &env)?
            }
            Runtime::Program { entrypoint, .. } => {
                group = group.or_else(|| run_as_group(pod, container));
                match plan_program(pod, container, entrypoint, &volume_dirs, dir, &env)? {
                    Ok(plan) => plan,
                    Err(waiting) => return Ok(Prepared::Waiting(waiting)),
                }
            }
        };
        containers.push(plan);
    }
    let grace = spec.termination_grace_period_seconds.unwrap_or(30).max(0);
    Ok(Prepared::Ready(PodPlan {
        containers,
        group,
        refreshes,
        restart_policy: spec.restart_policy.clone().unwrap_or_else(|| "Always".into()),
        grace: Duration::from_secs(grace.unsigned_abs()),
    }))
}

/// Writes one volume's files; returns the directory (or, for hostPath, the host path) a mount binds, or None when
/// a referenced object does not exist yet.
async fn materialise(
    client: &Client,
    pod: &Pod,
    namespace: &str,
    ip: Ipv4Addr,
    volume: &Volume,
    target: &Path,
) -> Result<Option<PathBuf>> {
    if let Some(host) = &volume.host_path {
        return Ok(Some(PathBuf::from(&host.path)));
    }
    fs::create_dir_all(target)?;
    fs::set_permissions(target, fs::Permissions::from_mode(0o755))?;
    if volume.empty_dir.is_some() {
        // Writable by whichever user the containers run as, like a fresh emptyDir with no fsGroup.
        fs::set_permissions(target, fs::Permissions::from_mode(0o777))?;
        return Ok(Some(target.to_path_buf()));
    }
    let mut files: Vec<(String, Vec<u8>, u32)> = Vec::new();
    if let Some(source) = &volume.config_map {
        let mode = mode_of(source.default_mode);
        match config_map_files(client, namespace, &source.name, source.items.as_deref(), mode).await? {
            Some(found) => files.extend(found),
            None if source.optional == Some(true) => {}
            None => return Ok(None),
        }
    } else if let Some(source) = &volume.secret {
        let mode = mode_of(source.default_mode);
        let name = source.secret_name.clone().unwrap_or_default();
        match secret_files(client, namespace, &name, source.items.as_deref(), mode).await? {
            Some(found) => files.extend(found),
            None if source.optional == Some(true) => {}
            None => return Ok(None),
        }
    } else if let Some(source) = &volume.downward_api {
        let mode = mode_of(source.default_mode);
        files.extend(downward_files(pod, ip, source.items.as_deref().unwrap_or_default(), mode)?);
    } else if let Some(projected) = &volume.projected {
        let mode = mode_of(projected.default_mode);
        for projection in projected.sources.iter().flatten() {
            if let Some(source) = &projection.config_map {
                match config_map_files(client, namespace, &source.name, source.items.as_deref(), mode).await? {
                    Some(found) => files.extend(found),
                    None if source.optional == Some(true) => {}
                    None => return Ok(None),
                }
            } else if let Some(source) = &projection.secret {
                match secret_files(client, namespace, &source.name, source.items.as_deref(), mode).await? {
                    Some(found) => files.extend(found),
                    None if source.optional == Some(true) => {}
                    None => return Ok(None),
                }
            } else if let Some(source) = &projection.downward_api {
                files.extend(downward_files(pod, ip, source.items.as_deref().unwrap_or_default(), mode)?);
            } else if let Some(source) = &projection.service_account_token {
                let seconds = source.expiration_seconds.unwrap_or(TOKEN_SECONDS);
                match service_account_token(client, pod, namespace, source.audience.as_deref(), seconds).await? {
                    Some(token) => files.push((source.path.clone(), token.into_bytes(), mode)),
                    None => return Ok(None),
                }
            } else {
                bail!(
                    "volume {}: a projected source other than configMap, secret, downwardAPI or serviceAccountToken, which the local node agent cannot provide",
                    volume.name
                );
            }
        }
    } else {
        bail!(
            "volume {} is of a kind the local node agent cannot provide (it knows configMap, secret, emptyDir, hostPath, \
             downwardAPI and projected)",
            volume.name
        );
    }
    for (path, bytes, mode) in files {
        if path.split('/').any(|part| part == "..") || path.starts_with('/') {
            bail!("volume {}: item path {path:?} must be relative and must not contain '..'", volume.name);
        }
        let file = target.join(&path);
        if let Some(parent) = file.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::write(&file, bytes).with_context(|| format!("writing {}", file.display()))?;
        fs::set_permissions(&file, fs::Permissions::from_mode(mode))?;
    }
    Ok(Some(target.to_path_buf()))
}

/// The group a program container runs as (its `runAsGroup`, else its `runAsUser`), when its security context says.
fn run_as_group(pod: &Pod, container: &Container) -> Option<u32> {
    let pod_security = pod.spec.as_ref().and_then(|spec| spec.security_context.as_ref());
    let security = container.security_context.as_ref();
    let group = security.and_then(|s| s.run_as_group).or(pod_security.and_then(|s| s.run_as_group));
    let user = security.and_then(|s| s.run_as_user).or(pod_security.and_then(|s| s.run_as_user));
    group.or(user).and_then(|id| u32::try_from(id).ok())
}

/// A group's ID from `/etc/group`.
fn group_id(name: &str) -> Option<u32> {
    let groups = fs::read_to_string("/etc/group").ok()?;
    groups.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name).then(|| fields.nth(1)?.parse().ok()).flatten()
    })
}

/// Brings a running pod's Secret and ConfigMap volumes in line with their objects, as kubelet does: each changed
/// file is replaced whole (written beside it, then renamed over it, so a reader never sees half of it), a key that
/// went away loses its file, and a volume whose object is gone keeps its files. Returns how many files changed.
pub(crate) async fn refresh(client: &Client, pod: &Pod, dir: &Path) -> Result<usize> {
    let Some(spec) = pod.spec.as_ref() else { return Ok(0) };
    let namespace = pod.namespace().unwrap_or_default();
    let mut changed = 0;
    for volume in spec.volumes.iter().flatten() {
        let files = if let Some(source) = &volume.config_map {
            config_map_files(client, &namespace, &source.name, source.items.as_deref(), mode_of(source.default_mode))
                .await?
        } else if let Some(source) = &volume.secret {
            let name = source.secret_name.clone().unwrap_or_default();
            secret_files(client, &namespace, &name, source.items.as_deref(), mode_of(source.default_mode)).await?
        } else {
            continue;
        };
        let Some(files) = files else { continue };
        let target = dir.join("volumes").join(&volume.name);
        let mut wanted = std::collections::BTreeSet::new();
        for (path, bytes, mode) in files {
            if path.split('/').any(|part| part == "..") || path.starts_with('/') {
                continue;
            }
            let file = target.join(&path);
            wanted.insert(file.clone());
            if fs::read(&file).is_ok_and(|current| current == bytes) {
                continue;
            }
            if let Some(parent) = file.parent() {
                fs::create_dir_all(parent)?;
            }
            let staged = file.with_file_name(format!(
                ".{}.refresh",
                file.file_name().and_then(|name| name.to_str()).unwrap_or("file")
            ));
            fs::write(&staged, bytes)?;
            fs::set_permissions(&staged, fs::Permissions::from_mode(mode))?;
            fs::rename(&staged, &file)?;
            changed += 1;
        }
        for entry in fs::read_dir(&target)?.flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|kind| kind.is_file()) && !wanted.contains(&path) {
                fs::remove_file(&path)?;
                changed += 1;
            }
        }
    }
    Ok(changed)
}

fn mode_of(mode: Option<i32>) -> u32 {
    mode.and_then(|mode| u32::try_from(mode).ok()).unwrap_or(0o644) & 0o777
}

/// The files of a ConfigMap (all keys, or the listed items), or None when it does not exist.
async fn config_map_files(
    client: &Client,
    namespace: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    mode: u32,
) -> Result<Option<Vec<(String, Vec<u8>, u32)>>> {
    let Some(map) = Api::<ConfigMap>::namespaced(client.clone(), namespace).get_opt(name).await? else {
        return Ok(None);
    };
    let mut data: BTreeMap<String, Vec<u8>> =
        map.data.unwrap_or_default().into_iter().map(|(key, value)| (key, value.into_bytes())).collect();
    data.extend(map.binary_data.unwrap_or_default().into_iter().map(|(key, value)| (key, value.0)));
    Ok(Some(select_items(data, items, mode, &format!("ConfigMap {namespace}/{name}"))?))
}

/// The files of a Secret (all keys, or the listed items), or None when it does not exist.
async fn secret_files(
    client: &Client,
    namespace: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    mode: u32,
) -> Result<Option<Vec<(String, Vec<u8>, u32)>>> {
    let Some(secret) = Api::<Secret>::namespaced(client.clone(), namespace).get_opt(name).await? else {
        return Ok(None);
    };
    let mut data: BTreeMap<String, Vec<u8>> =
        secret.data.unwrap_or_default().into_iter().map(|(key, value)| (key, value.0)).collect();
    data.extend(secret.string_data.unwrap_or_default().into_iter().map(|(key, value)| (key, value.into_bytes())));
    Ok(Some(select_items(data, items, mode, &format!("Secret {namespace}/{name}"))?))
}

fn select_items(
    data: BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    mode: u32,
    what: &str,
) -> Result<Vec<(String, Vec<u8>, u32)>> {
    match items {
        None => Ok(data.into_iter().map(|(key, bytes)| (key, bytes, mode)).collect()),
        Some(items) => items
            .iter()
            .map(|item| {
                let bytes = data.get(&item.key).with_context(|| format!("{what} has no key {:?}", item.key))?;
                Ok((item.path.clone(), bytes.clone(), item.mode.map_or(mode, |mode| mode_of(Some(mode)))))
            })
            .collect(),
    }
}

fn downward_files(
    pod: &Pod,
    ip: Ipv4Addr,
    items: &[DownwardAPIVolumeFile],
    mode: u32,
) -> Result<Vec<(String, Vec<u8>, u32)>> {
    items
        .iter()
        .map(|item| {
            let field = item.field_ref.as_ref().with_context(|| {
                format!("downward API file {:?}: only fieldRef is provided by the local node agent", item.path)
            })?;
            let value = field_value(pod, ip, field)?;
            Ok((item.path.clone(), value.into_bytes(), item.mode.map_or(mode, |mode| mode_of(Some(mode)))))
        })
        .collect()
}

/// A token for the pod's ServiceAccount from the TokenRequest API, bound to the pod, as kubelet asks for one; None
/// when the ServiceAccount does not exist yet.
async fn service_account_token(
    client: &Client,
    pod: &Pod,
    namespace: &str,
    audience: Option<&str>,
    seconds: i64,
) -> Result<Option<String>> {
    let account = pod.spec.as_ref().and_then(|spec| spec.service_account_name.clone()).unwrap_or("default".into());
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    if accounts.get_opt(&account).await?.is_none() {
        return Ok(None);
    }
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: audience.map(|audience| vec![audience.to_owned()]),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
            expiration_seconds: Some(seconds),
        }),
        ..TokenRequest::default()
    };
    let issued: TokenRequest =
        accounts
            .create_subresource("token", &account, &PostParams::default(), &request)
            .await
            .with_context(|| format!("requesting a token for ServiceAccount {namespace}/{account}"))?;
    let token = issued.status.and_then(|status| status.token).context("the TokenRequest answer has no token")?;
    Ok(Some(token))
}

/// The value of a downward-API field reference, as kubelet resolves it.
fn field_value(pod: &Pod, ip: Ipv4Addr, field: &ObjectFieldSelector) -> Result<String> {
    let path = field.field_path.as_str();
    let keyed = |prefix: &str, map: Option<&BTreeMap<String, String>>| -> Option<String> {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(map.and_then(|map| map.get(key)).cloned().unwrap_or_default())
    };
    let spec = pod.spec.as_ref();
    Ok(match path {
        "metadata.name" => pod.name_any(),
        "metadata.namespace" => pod.namespace().unwrap_or_default(),
        "metadata.uid" => pod.uid().unwrap_or_default(),
        "spec.nodeName" => spec.and_then(|spec| spec.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec.and_then(|spec| spec.service_account_name.clone()).unwrap_or_default(),
        "status.podIP" | "status.podIPs" => ip.to_string(),
        "status.hostIP" | "status.hostIPs" => "127.0.0.1".into(),
        "metadata.labels" | "metadata.annotations" => {
            let map = if path == "metadata.labels" { &pod.metadata.labels } else { &pod.metadata.annotations };
            map.iter().flatten().map(|(key, value)| format!("{key}={value:?}\n")).collect()
        }
        _ => {
            if let Some(value) = keyed("metadata.labels['", pod.metadata.labels.as_ref()) {
                value
            } else if let Some(value) = keyed("metadata.annotations['", pod.metadata.annotations.as_ref()) {
                value
            } else {
                bail!("field reference {path:?} is not one the local node agent resolves")
            }
        }
    })
}

/// The container's environment in kubelet's order: the apiserver's service variables, the image's defaults, each
/// `envFrom`, each `env` (with `$(VAR)` references to earlier ones expanded), and last the agent's own overrides
/// for the image (its listen addresses: there is no network namespace per pod).
async fn environment(
    node: &Node<'_>,
    pod: &Pod,
    namespace: &str,
    ip: Ipv4Addr,
    container: &Container,
    runtime: &Runtime,
) -> Result<Result<Vec<(String, String)>, Waiting>> {
    let mut env: Vec<(String, String)> = Vec::new();
    let set = |env: &mut Vec<(String, String)>, name: String, value: String| {
        env.retain(|(existing, _)| *existing != name);
        env.push((name, value));
    };
    if let Some(address) = node.apiserver {
        set(&mut env, "KUBERNETES_SERVICE_HOST".into(), address.ip().to_string());
        set(&mut env, "KUBERNETES_SERVICE_PORT".into(), address.port().to_string());
        set(&mut env, "KUBERNETES_SERVICE_PORT_HTTPS".into(), address.port().to_string());
        set(&mut env, "KUBERNETES_PORT".into(), format!("tcp://{address}"));
    }
    set(&mut env, "PATH".into(), PATH.into());
    set(&mut env, "HOSTNAME".into(), pod.name_any());
    for source in container.env_from.iter().flatten() {
        let prefix = source.prefix.clone().unwrap_or_default();
        let values: Option<BTreeMap<String, String>> = if let Some(reference) = &source.config_map_ref {
            match Api::<ConfigMap>::namespaced(node.client.clone(), namespace).get_opt(&reference.name).await? {
                Some(map) => Some(map.data.unwrap_or_default()),
                None if reference.optional == Some(true) => Some(BTreeMap::new()),
                None => None,
            }
        } else if let Some(reference) = &source.secret_ref {
            match Api::<Secret>::namespaced(node.client.clone(), namespace).get_opt(&reference.name).await? {
                Some(secret) => Some(
                    secret
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(key, value)| (key, String::from_utf8_lossy(&value.0).into_owned()))
                        .collect(),
                ),
                None if reference.optional == Some(true) => Some(BTreeMap::new()),
                None => None,
            }
        } else {
            Some(BTreeMap::new())
        };
        let Some(values) = values else {
            return Ok(Err(Waiting::new("CreateContainerConfigError", "an envFrom source does not exist")));
        };
        for (key, value) in values {
            set(&mut env, format!("{prefix}{key}"), value);
        }
    }
    for variable in container.env.iter().flatten() {
        let value = match (&variable.value, &variable.value_from) {
            (Some(value), _) => expand(value, &env),
            (None, Some(source)) => {
                if let Some(field) = &source.field_ref {
                    field_value(pod, ip, field)?
                } else if let Some(key) = &source.config_map_key_ref {
                    let map = Api::<ConfigMap>::namespaced(node.client.clone(), namespace).get_opt(&key.name).await?;
                    match map.and_then(|map| map.data.unwrap_or_default().remove(&key.key)) {
                        Some(value) => value,
                        None if key.optional == Some(true) => continue,
                        None => {
                            return Ok(Err(Waiting::new(
                                "CreateContainerConfigError",
                                format!("env {}: ConfigMap {} has no key {}", variable.name, key.name, key.key),
                            )));
                        }
                    }
                } else if let Some(key) = &source.secret_key_ref {
                    let secret = Api::<Secret>::namespaced(node.client.clone(), namespace).get_opt(&key.name).await?;
                    match secret.and_then(|secret| secret.data.unwrap_or_default().remove(&key.key)) {
                        Some(value) => String::from_utf8_lossy(&value.0).into_owned(),
                        None if key.optional == Some(true) => continue,
                        None => {
                            return Ok(Err(Waiting::new(
                                "CreateContainerConfigError",
                                format!("env {}: Secret {} has no key {}", variable.name, key.name, key.key),
                            )));
                        }
                    }
                } else {
                    bail!("env {}: only fieldRef, configMapKeyRef and secretKeyRef are resolved here", variable.name);
                }
            }
            (None, None) => String::new(),
        };
        set(&mut env, variable.name.clone(), value);
    }
    if let Runtime::Program { env: overrides, .. } = runtime {
        for (name, value) in overrides {
            set(&mut env, name.clone(), value.replace("{pod_ip}", &ip.to_string()));
        }
    }
    Ok(Ok(env))
}

/// Kubelet's `$(VAR)` expansion: a defined variable is replaced, `$$` is a literal `$`, anything else stays as it is.
pub(crate) fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
            && let Some((_, value)) = env.iter().rev().find(|(name, _)| name == &inner[..end])
        {
            out.push_str(value);
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The container's command line as the runtime builds it: `command` replaces the image's entrypoint and `args`
/// follow either, with `$(VAR)` expanded.
fn command_line(container: &Container, entrypoint: &[String], env: &[(String, String)]) -> Vec<String> {
    let command = container.command.clone().filter(|command| !command.is_empty());
    let base = command.clone().unwrap_or_else(|| entrypoint.to_vec());
    base.iter().chain(container.args.iter().flatten()).map(|part| expand(part, env)).collect()
}

fn ports_of(container: &Container) -> BTreeMap<String, u16> {
    container
        .ports
        .iter()
        .flatten()
        .filter_map(|port| Some((port.name.clone()?, u16::try_from(port.container_port).ok()?)))
        .collect()
}

/// A Squid container: its own command, with the mount paths and `squid.conf` rewritten for this machine (the
/// listen address becomes the pod's, runtime files move into the pod's directory), as root, as Squid expects.
fn plan_squid(
    container: &Container,
    volume_dirs: &BTreeMap<String, PathBuf>,
    ip: Ipv4Addr,
    dir: &Path,
    env: &[(String, String)],
) -> Result<ContainerPlan> {
    let mut rewrites: Vec<(String, String)> = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let source = volume_dirs.get(&mount.name).with_context(|| format!("volume {} is not declared", mount.name))?;
        rewrites.push((mount.mount_path.clone(), source.display().to_string()));
    }
    // Longest mount path first, so /etc/squid-egress-auth is not rewritten as /etc/squid-egress + "-auth".
    rewrites.sort_by_key(|(from, _)| std::cmp::Reverse(from.len()));
    for (_, target) in &rewrites {
        let conf = Path::new(target).join("squid.conf");
        if conf.is_file() {
            let text = fs::read_to_string(&conf)?;
            fs::write(&conf, rewrite_squid_config(&text, ip, dir, &rewrites))?;
        }
    }
    let command = command_line(container, &[], env);
    if command.is_empty() {
        bail!("the container has no command; the local node agent does not know the Squid image's entrypoint");
    }
    let command = rewrite_command(&command, &rewrites, &service_name(dir));
    let environment: Vec<String> = env.iter().map(|(name, value)| format!("{name}={value}")).collect();
    let script = std::iter::once("env".to_owned())
        .chain(environment.iter().cloned())
        .chain(command)
        .map(|part| shell_quote(&part))
        .collect::<Vec<_>>()
        .join(" ");
    let ports = ports_of(container);
    Ok(ContainerPlan {
        name: container.name.clone(),
        image: container.image.clone().unwrap_or_default(),
        script,
        exec_prefix: std::iter::once("env".to_owned()).chain(environment).collect(),
        readiness: container.readiness_probe.clone(),
        liveness: container.liveness_probe.clone(),
        startup: container.startup_probe.clone(),
        ports,
    })
}

/// A container whose image maps to a local program: in a mount namespace of its own where each volume is mounted at
/// its `mountPath` (over an overlay where the path's parents do not exist on this machine, so nothing on the host
/// changes), as the user its security context names, with exactly its environment.
fn plan_program(
    pod: &Pod,
    container: &Container,
    entrypoint: &[String],
    volume_dirs: &BTreeMap<String, PathBuf>,
    dir: &Path,
    env: &[(String, String)],
) -> Result<Result<ContainerPlan, Waiting>> {
    let pod_security = pod.spec.as_ref().and_then(|spec| spec.security_context.as_ref());
    let security = container.security_context.as_ref();
    let user = security.and_then(|s| s.run_as_user).or(pod_security.and_then(|s| s.run_as_user));
    let group = security.and_then(|s| s.run_as_group).or(pod_security.and_then(|s| s.run_as_group));
    let non_root = security.and_then(|s| s.run_as_non_root).or(pod_security.and_then(|s| s.run_as_non_root));
    if non_root == Some(true) && user.unwrap_or(0) == 0 {
        return Ok(Err(Waiting::new(
            "CreateContainerConfigError",
            "container has runAsNonRoot and its user is root (or unset, and the image's user is root)",
        )));
    }

    // The program, staged where any user can reach it (the build directory may be under a private home).
    let mut entrypoint = entrypoint.to_vec();
    if container.command.as_ref().is_none_or(Vec::is_empty)
        && let Some(program) = entrypoint.first_mut()
    {
        // The real file: a hard link to a symbolic link (python3 -> python3.11) would dangle in the staging directory.
        // It keeps the name it is called by: some programs are one binary under several names (redis-server is a
        // link to redis-check-rdb, and looks at its name to know which to be).
        let source = fs::canonicalize(&*program).with_context(|| format!("the image's program {program}"))?;
        let bin = dir.join("bin");
        fs::create_dir_all(&bin)?;
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755))?;
        let staged = bin.join(Path::new(&*program).file_name().context("the image's program has no file name")?);
        if fs::hard_link(&source, &staged).is_err() {
            fs::copy(&source, &staged).with_context(|| format!("staging {}", source.display()))?;
        }
        fs::set_permissions(&staged, fs::Permissions::from_mode(0o755))?;
        *program = staged.display().to_string();
    }
    let command = command_line(container, &entrypoint, env);
    if command.is_empty() {
        bail!("the container has no command and its image no entrypoint");
    }

    let mut mounts: Vec<(PathBuf, PathBuf, bool)> = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let mut source =
            volume_dirs.get(&mount.name).with_context(|| format!("volume {} is not declared", mount.name))?.clone();
        if let Some(sub) = mount.sub_path.as_deref().filter(|sub| !sub.is_empty()) {
            if sub.split('/').any(|part| part == "..") {
                bail!("volume mount {}: subPath {sub:?} must not contain '..'", mount.name);
            }
            source = source.join(sub);
        }
        mounts.push((source, PathBuf::from(&mount.mount_path), mount.read_only == Some(true)));
    }
    let setup = mount_script(&mounts, dir)?;
    let identity = match (user, group) {
        (None, None) => Vec::new(),
        (user, group) => {
            let mut identity = vec!["setpriv".to_owned()];
            if let Some(user) = user {
                identity.push(format!("--reuid={user}"));
            }
            identity.push(format!("--regid={}", group.or(user).unwrap_or(0)));
            identity.push("--clear-groups".into());
            identity.push("--".into());
            identity
        }
    };
    let environment: Vec<String> = std::iter::once("env".to_owned())
        .chain(std::iter::once("-i".to_owned()))
        .chain(env.iter().map(|(name, value)| format!("{name}={value}")))
        .collect();
    let working_dir = container.working_dir.clone().unwrap_or_else(|| "/".into());
    let exec: Vec<String> = identity.iter().chain(&environment).chain(&command).cloned().collect();
    let inner = format!(
        "set -e; {setup} cd {}; exec {}",
        shell_quote(&working_dir),
        exec.iter().map(|part| shell_quote(part)).collect::<Vec<_>>().join(" ")
    );
    let script = format!("unshare --mount --propagation private -- sh -c {}", shell_quote(&inner));
    let exec_prefix = ["nsenter", "--target", "{pid}", "--mount", "--"]
        .into_iter()
        .map(str::to_owned)
        .chain(identity)
        .chain(environment)
        .collect();
    let ports = ports_of(container);
    Ok(Ok(ContainerPlan {
        name: container.name.clone(),
        image: container.image.clone().unwrap_or_default(),
        script,
        exec_prefix,
        readiness: container.readiness_probe.clone(),
        liveness: container.liveness_probe.clone(),
        startup: container.startup_probe.clone(),
        ports,
    }))
}

/// The shell commands, run as root inside the new mount namespace, that mount each `(source, target, read-only)`:
/// every target whose parent is missing on this machine lives on an overlay (its upper layer a tmpfs of the
/// namespace) of its deepest existing ancestor, so the directories are created there and not on the host.
fn mount_script(mounts: &[(PathBuf, PathBuf, bool)], dir: &Path) -> Result<String> {
    let mut overlays: Vec<PathBuf> = Vec::new();
    for (_, target, _) in mounts {
        if target.is_dir() {
            continue;
        }
        let mut ancestor = target.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("/"));
        while !ancestor.is_dir() {
            ancestor = ancestor.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("/"));
        }
        let ancestor = fs::canonicalize(&ancestor).unwrap_or(ancestor);
        if ancestor == Path::new("/") {
            bail!("mount path {} has no existing parent but /, which the agent will not overlay", target.display());
        }
        overlays.push(ancestor);
    }
    overlays.sort();
    overlays.dedup();
    // An ancestor inside another overlaid ancestor is covered by that one.
    let tops: Vec<PathBuf> = overlays
        .iter()
        .filter(|path| !overlays.iter().any(|other| other != *path && path.starts_with(other)))
        .cloned()
        .collect();
    let mut script = String::new();
    for (index, top) in tops.iter().enumerate() {
        let layer = dir.join("overlays").join(index.to_string());
        fs::create_dir_all(&layer)?;
        let (layer, top) = (shell_quote(&layer.display().to_string()), shell_quote(&top.display().to_string()));
        script.push_str(&format!(
            "mount -t tmpfs tmpfs {layer}; mkdir {layer}/upper {layer}/work; \
             mount -t overlay overlay -o lowerdir={top},upperdir={layer}/upper,workdir={layer}/work {top}; "
        ));
    }
    let mut ordered: Vec<&(PathBuf, PathBuf, bool)> = mounts.iter().collect();
    ordered.sort_by_key(|(_, target, _)| target.components().count());
    for (source, target, read_only) in ordered {
        let (source_text, target_text) =
            (shell_quote(&source.display().to_string()), shell_quote(&target.display().to_string()));
        if source.is_dir() {
            script.push_str(&format!("mkdir -p {target_text}; "));
        } else {
            script.push_str(&format!("mkdir -p \"$(dirname {target_text})\"; touch {target_text}; "));
        }
        script.push_str(&format!("mount --bind {source_text} {target_text}; "));
        if *read_only {
            script.push_str(&format!("mount -o remount,bind,ro {target_text}; "));
        }
    }
    Ok(script)
}

/// The pod's command with its mount paths rewritten, and each `squid -N` given the service name `service` (so
/// its shared-memory segments do not collide with another pod's, as standalone test Squids do).
pub(crate) fn rewrite_command(command: &[String], rewrites: &[(String, String)], service: &str) -> Vec<String> {
    command
        .iter()
        .map(|part| apply_rewrites(part, rewrites).replace("squid -N ", &format!("squid -N -n {service} ")))
        .collect()
}

/// Replaces every mount path in `text` in one left-to-right pass, longest match first, so a replacement is never
/// itself rewritten again (`/etc/squid-egress` is a prefix of the rewritten `/etc/squid-egress-auth` target).
pub(crate) fn apply_rewrites(text: &str, rewrites: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    'scan: while !rest.is_empty() {
        for (from, to) in rewrites {
            if !from.is_empty()
                && let Some(after) = rest.strip_prefix(from.as_str())
            {
                out.push_str(to);
                rest = after;
                continue 'scan;
            }
        }
        let next = rest.chars().next().map_or(1, char::len_utf8);
        out.push_str(&rest[..next]);
        rest = &rest[next..];
    }
    out
}

/// Rewrites a pod's `squid.conf` for this machine: the listen address becomes the pod's IP, PID and core paths move
/// into the pod's runtime directory (the logs stay on the container's output, as the pod's command leaves them), mount paths move to where the volumes were materialised, the
/// ICMP pinger (which needs privileges) is turned off, and outgoing connections leave from the pod's IP. Everything
/// else is left exactly as the provider wrote it.
pub fn rewrite_squid_config(text: &str, ip: Ipv4Addr, runtime_dir: &Path, mounts: &[(String, String)]) -> String {
    let runtime = runtime_dir.display();
    let mut out = String::with_capacity(text.len() + 256);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let directive = words.next().unwrap_or_default();
        let rewritten = match directive {
            "http_port" => {
                let rest: Vec<&str> = words.collect();
                let port = rest.first().map(|first| first.rsplit(':').next().unwrap_or(first)).unwrap_or("3128");
                let options = rest.get(1..).map(|options| options.join(" ")).unwrap_or_default();
                format!("http_port {ip}:{port} {options}").trim_end().to_owned()
            }
            "pid_filename" => format!("pid_filename {runtime}/squid.pid"),
            "coredump_dir" => format!("coredump_dir {runtime}"),
            _ => apply_rewrites(line, mounts),
        };
        out.push_str(&rewritten);
        out.push('\n');
    }
    out.push_str("pinger_enable off\n");
    // Connections to origins leave from the pod's own address, as they would from a pod's own network namespace
    // (here every pod shares one, and the kernel would pick the same source for all of them).
    out.push_str(&format!("tcp_outgoing_address {ip}\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squid_config_is_rewritten_for_the_local_machine() {
        let conf = "http_port 3128\nauth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid-egress-auth/passwd\n\
                    access_log stdio:/dev/stdout egress\ncache_log /dev/stderr\npid_filename none\ncoredump_dir /tmp\ncache deny all\n";
        let mounts = vec![
            ("/etc/squid-egress-auth".to_owned(), "/tmp/p/root/etc/squid-egress-auth".to_owned()),
            ("/etc/squid-egress".to_owned(), "/tmp/p/root/etc/squid-egress".to_owned()),
        ];
        let out = rewrite_squid_config(conf, Ipv4Addr::new(127, 1, 0, 7), Path::new("/tmp/p"), &mounts);
        assert!(out.contains("http_port 127.1.0.7:3128\n"), "{out}");
        assert!(out.contains("basic_ncsa_auth /tmp/p/root/etc/squid-egress-auth/passwd\n"), "{out}");
        assert!(out.contains("access_log stdio:/dev/stdout egress\n"), "the container's output, as in a pod");
        assert!(out.contains("cache_log /dev/stderr\n"));
        assert!(out.contains("pid_filename /tmp/p/squid.pid\n"));
        assert!(out.contains("tcp_outgoing_address 127.1.0.7\n"), "{out}");
        assert!(out.contains("coredump_dir /tmp/p\n"));
        assert!(out.contains("cache deny all\n"), "other lines are untouched");
    }

    #[test]
    fn each_pod_squid_gets_its_own_service_name() {
        let mounts = vec![("/etc/squid-egress".to_owned(), "/tmp/egress-pod-ab12/root/etc/squid-egress".to_owned())];
        let command = [
            "sh".to_owned(),
            "-c".to_owned(),
            "ulimit -n 16384 && exec squid -N -f /etc/squid-egress/squid.conf".to_owned(),
        ];
        let rewritten = rewrite_command(&command, &mounts, "egresspodab12");
        assert_eq!(
            rewritten[2],
            "ulimit -n 16384 && exec squid -N -n egresspodab12 -f /tmp/egress-pod-ab12/root/etc/squid-egress/squid.conf"
        );
    }

    #[test]
    fn rewrites_are_applied_once() {
        let mounts = vec![
            ("/etc/squid-egress-auth".to_owned(), "/tmp/p/root/etc/squid-egress-auth".to_owned()),
            ("/etc/squid-egress".to_owned(), "/tmp/p/root/etc/squid-egress".to_owned()),
        ];
        assert_eq!(
            apply_rewrites("-f /etc/squid-egress/squid.conf /etc/squid-egress-auth/passwd", &mounts),
            "-f /tmp/p/root/etc/squid-egress/squid.conf /tmp/p/root/etc/squid-egress-auth/passwd"
        );
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
    }

    #[test]
    fn variables_expand_as_kubelet_expands_them() {
        let env = vec![("CLUSTER_ID".to_owned(), "prod".to_owned()), ("EMPTY".to_owned(), String::new())];
        assert_eq!(expand("--cluster-id=$(CLUSTER_ID)", &env), "--cluster-id=prod");
        assert_eq!(expand("$(EMPTY)x", &env), "x");
        assert_eq!(expand("$(UNDEFINED) stays", &env), "$(UNDEFINED) stays");
        assert_eq!(expand("$$(CLUSTER_ID) is literal", &env), "$(CLUSTER_ID) is literal");
        assert_eq!(expand("cost: 5$", &env), "cost: 5$");
        assert_eq!(expand("$(CLUSTER_ID", &env), "$(CLUSTER_ID");
    }

    #[test]
    fn missing_mount_parents_are_overlaid_not_created_on_the_host() {
        let dir = tempfile::tempdir().expect("dir");
        let source = dir.path().join("volume");
        fs::create_dir_all(&source).expect("source");
        let mounts = vec![
            (source.clone(), PathBuf::from("/etc/egress-testenv-nowhere/providers"), true),
            (source.clone(), PathBuf::from("/etc/egress-testenv-nowhere/tokens"), true),
            (source, PathBuf::from("/var/run/secrets/egress-testenv-nowhere"), false),
        ];
        let script = mount_script(&mounts, dir.path()).expect("script");
        assert_eq!(script.matches("mount -t overlay").count(), 2, "one overlay each for /etc and /run: {script}");
        assert!(script.contains("lowerdir='/etc'"), "{script}");
        assert!(script.contains("remount,bind,ro '/etc/egress-testenv-nowhere/providers'"), "{script}");
        assert!(!Path::new("/etc/egress-testenv-nowhere").exists(), "nothing was created on the host");
    }
}
