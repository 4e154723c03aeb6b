//! The providers file's walker: reads the YAML tree field by field, records every problem with its path, and
//! carries on, so one pass reports them all.

use super::*;

/// Collects problems while walking the tree. Each reader returns `None` (after recording why) when a value is
/// unusable, and the caller carries on with the next field.
#[derive(Default)]
pub(super) struct Walker {
    pub(super) problems: Vec<Problem>,
}

/// A mapping in the tree and where it is.
pub(super) struct Node<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

impl Node<'_> {
    fn child(&self, key: &str) -> String {
        if self.path.is_empty() { key.to_owned() } else { format!("{}.{key}", self.path) }
    }
}

pub(super) fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "empty",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

impl Walker {
    fn problem(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem { path: path.into(), message: message.into() });
    }

    /// A mapping with only the `allowed` keys; an unknown key is reported and otherwise ignored.
    fn mapping<'a>(&mut self, path: &str, value: &'a Value, allowed: &[&str]) -> Option<Node<'a>> {
        let Value::Object(map) = value else {
            self.problem(path, format!("must be a mapping, found {}", kind_of(value)));
            return None;
        };
        let node = Node { path: path.to_owned(), map };
        for key in map.keys() {
            if !allowed.contains(&key.as_str()) {
                self.problem(node.child(key), format!("unknown field (expected one of: {})", allowed.join(", ")));
            }
        }
        Some(node)
    }

    fn string(&mut self, node: &Node<'_>, key: &str, required: bool) -> Option<String> {
        match node.map.get(key) {
            None | Some(Value::Null) => {
                if required {
                    self.problem(node.child(key), "is required");
                }
                None
            }
            Some(Value::String(text)) if text.trim().is_empty() => {
                self.problem(node.child(key), "must not be empty");
                None
            }
            Some(Value::String(text)) => Some(text.clone()),
            Some(other) => {
                self.problem(node.child(key), format!("must be a string, found {}", kind_of(other)));
                None
            }
        }
    }

    fn identifier(&mut self, node: &Node<'_>, key: &str, required: bool) -> Option<String> {
        let value = self.string(node, key, required)?;
        self.check_identifier(&node.child(key), &value).then_some(value)
    }

    fn check_identifier(&mut self, path: &str, value: &str) -> bool {
        let ok = is_identifier(value);
        if !ok {
            self.problem(path, format!("{value:?} must match {IDENTIFIER_PATTERN} (at most 63 characters)"));
        }
        ok
    }

    fn one_of(&mut self, node: &Node<'_>, key: &str, choices: &[&str]) -> Option<String> {
        let value = self.string(node, key, false)?;
        if choices.contains(&value.as_str()) {
            Some(value)
        } else {
            self.problem(node.child(key), format!("{value:?} is not one of: {}", choices.join(", ")));
            None
        }
    }

    fn url(&mut self, node: &Node<'_>, key: &str, required: bool) -> Option<String> {
        let value = self.string(node, key, required)?;
        let rest = value.strip_prefix("https://").or_else(|| value.strip_prefix("http://"));
        if rest.is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/') && !rest.contains(char::is_whitespace)) {
            Some(value)
        } else {
            self.problem(node.child(key), format!("{value:?} must be an http:// or https:// URL"));
            None
        }
    }

    fn boolean(&mut self, node: &Node<'_>, key: &str) -> bool {
        match node.map.get(key) {
            None | Some(Value::Null) => false,
            Some(Value::Bool(value)) => *value,
            Some(other) => {
                self.problem(node.child(key), format!("must be true or false, found {}", kind_of(other)));
                false
            }
        }
    }

    fn integer(&mut self, node: &Node<'_>, key: &str, min: u64, max: u64) -> Option<u32> {
        let value = node.map.get(key)?;
        match value.as_u64() {
            Some(number) if (min..=max).contains(&number) => u32::try_from(number).ok(),
            Some(number) => {
                self.problem(node.child(key), format!("{number} is out of range ({min} to {max})"));
                None
            }
            None => {
                self.problem(node.child(key), format!("must be a whole number from {min} to {max}, found {value}"));
                None
            }
        }
    }

    fn quantity(&mut self, node: &Node<'_>, key: &str, default: &str) -> String {
        match self.string(node, key, false) {
            Some(value) if is_quantity(&value) => value,
            Some(value) => {
                self.problem(
                    node.child(key),
                    format!("{value:?} is not a Kubernetes quantity such as 100m, 1 or 128Mi"),
                );
                default.to_owned()
            }
            None => default.to_owned(),
        }
    }

    fn list<'a>(&mut self, node: &Node<'a>, key: &str) -> Vec<(String, &'a Value)> {
        match node.map.get(key) {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => {
                items.iter().enumerate().map(|(index, item)| (format!("{}[{index}]", node.child(key)), item)).collect()
            }
            Some(other) => {
                self.problem(node.child(key), format!("must be a list, found {}", kind_of(other)));
                Vec::new()
            }
        }
    }

    /// A mapping whose keys are identifiers, read entry by entry with `read`.
    fn keyed<'a, T>(
        &mut self,
        node: &Node<'a>,
        key: &str,
        mut read: impl FnMut(&mut Self, &str, &'a Value) -> Option<T>,
    ) -> BTreeMap<String, T> {
        let mut entries = BTreeMap::new();
        match node.map.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Object(map)) => {
                for (name, value) in map {
                    let path = format!("{}.{name}", node.child(key));
                    let valid_key = self.check_identifier(&path, name);
                    if let Some(entry) = read(self, &path, value)
                        && valid_key
                    {
                        entries.insert(name.clone(), entry);
                    }
                }
            }
            Some(other) => self.problem(node.child(key), format!("must be a mapping, found {}", kind_of(other))),
        }
        entries
    }

    pub(super) fn file(&mut self, tree: &Value) -> Option<ProvidersConfig> {
        if tree.is_null() {
            self.problem("", "the file is empty; expected a mapping with a `providers` list");
            return None;
        }
        let root = self.mapping("", tree, &["providers"])?;
        if !root.map.contains_key("providers") {
            self.problem("providers", "is required");
        }
        let mut providers = Vec::new();
        let mut names = HashSet::new();
        for (path, value) in self.list(&root, "providers") {
            if let Some(provider) = self.provider(&path, value) {
                if !names.insert(provider.name.clone()) {
                    self.problem(format!("{path}.name"), format!("duplicate provider name {:?}", provider.name));
                }
                providers.push(provider);
            }
        }
        Some(ProvidersConfig { providers })
    }

    fn provider(&mut self, path: &str, value: &Value) -> Option<ProviderConfig> {
        let node =
            self.mapping(path, value, &["name", "type", "destinations", "cooldown", "kubernetes", "gcp", "kvm"])?;
        let destinations = match node.map.get("destinations") {
            None | Some(Value::Null) => DestinationPolicy::default(),
            Some(value) => self.destinations(&node.child("destinations"), value),
        };
        let cooldown = match node.map.get("cooldown") {
            None | Some(Value::Null) => CooldownSettings::default(),
            Some(value) => self.cooldown(&node.child("cooldown"), value),
        };
        let name = self.identifier(&node, "name", true);
        let kind = self.string(&node, "type", true);
        if let Some(kind) = &kind
            && !PROVIDER_TYPES.contains(&kind.as_str())
        {
            self.problem(node.child("type"), format!("{kind:?} is not one of: {}", PROVIDER_TYPES.join(", ")));
        }
        // A block of another type is a mistake even when the right block is present too.
        for block in PROVIDER_TYPES {
            if node.map.contains_key(block) && kind.as_deref().is_some_and(|kind| kind != block) {
                let kind = kind.as_deref().unwrap_or_default();
                self.problem(node.child(block), format!("does not match type {kind:?}; use a `{kind}:` block"));
            }
        }
        let kind = kind.filter(|kind| PROVIDER_TYPES.contains(&kind.as_str()))?;
        let block_path = node.child(&kind);
        let empty = Value::Object(Map::new());
        let block = match node.map.get(kind.as_str()) {
            Some(block) => block,
            // A kubernetes provider can live with every default; the others need their block.
            None if kind == "kubernetes" => &empty,
            None => {
                self.problem(&block_path, format!("is required for type {kind:?}"));
                return None;
            }
        };
        let settings = match kind.as_str() {
            "kubernetes" => ProviderSettings::Kubernetes(self.kubernetes(&block_path, block)?),
            "gcp" => ProviderSettings::Gcp(self.gcp(&block_path, block)?),
            _ => ProviderSettings::Kvm(self.kvm(&block_path, block)?),
        };
        Some(ProviderConfig { name: name?, destinations, cooldown, settings })
    }

    fn cooldown(&mut self, path: &str, value: &Value) -> CooldownSettings {
        let Some(node) = self.mapping(path, value, &["baseSeconds", "factor", "maxSeconds"]) else {
            return CooldownSettings::default();
        };
        let settings = CooldownSettings {
            base_seconds: self.integer(&node, "baseSeconds", 1, 86_400),
            factor: self.integer(&node, "factor", 1, 10),
            max_seconds: self.integer(&node, "maxSeconds", 1, 604_800),
        };
        if let (Some(base), Some(max)) = (settings.base_seconds, settings.max_seconds)
            && max < base
        {
            self.problem(node.child("maxSeconds"), format!("{max} is less than baseSeconds ({base})"));
        }
        settings
    }

    fn destinations(&mut self, path: &str, value: &Value) -> DestinationPolicy {
        let Some(node) = self.mapping(path, value, &["allow", "deny"]) else {
            return DestinationPolicy::default();
        };
        let allow = self.rules(&node, "allow");
        let deny = self.rules(&node, "deny");
        DestinationPolicy { allow, deny }
    }

    fn rules(&mut self, node: &Node<'_>, key: &str) -> Vec<DestinationRule> {
        let mut rules = Vec::new();
        for (path, item) in self.list(node, key) {
            match item {
                Value::String(text) => match text.parse::<DestinationRule>() {
                    Ok(rule) => rules.push(rule),
                    Err(error) => self.problem(path, error.to_string()),
                },
                other => self.problem(path, format!("must be a string such as 10.0.0.0/8, found {}", kind_of(other))),
            }
        }
        rules
    }

    fn networks(&mut self, node: &Node<'_>, key: &str) -> Vec<IpNet> {
        let mut networks = Vec::new();
        for (path, item) in self.list(node, key) {
            match item.as_str().and_then(|text| text.parse::<DestinationRule>().ok()) {
                Some(DestinationRule { network: Some(network), ports: None }) => networks.push(network),
                _ => self.problem(path, format!("{item} is not a network in CIDR notation such as 10.244.0.0/16")),
            }
        }
        networks
    }

    fn kubernetes(&mut self, path: &str, value: &Value) -> Option<KubernetesConfig> {
        let node = self.mapping(
            path,
            value,
            &[
                "namespace",
                "namespaces",
                "image",
                "imagePullPolicy",
                "fdLimit",
                "resources",
                "machineTypes",
                "clusterNetworks",
            ],
        )?;
        let namespace = self.identifier(&node, "namespace", false).unwrap_or_else(|| "egress-proxies".into());
        let image = self.string(&node, "image", false).unwrap_or_else(|| "ubuntu/squid:latest".into());
        let image_pull_policy = self.one_of(&node, "imagePullPolicy", &["Always", "IfNotPresent", "Never"]);
        let fd_limit = self.integer(&node, "fdLimit", 1024, 1_048_576).unwrap_or(16384);
        let resources = match node.map.get("resources") {
            Some(value) => self.resource_profile(&node.child("resources"), value)?,
            None => ResourceProfile { cpu: "50m".into(), memory: "128Mi".into() },
        };
        let machine_types =
            self.keyed(&node, "machineTypes", |walker, path, value| walker.resource_profile(path, value));
        let cluster_networks = self.networks(&node, "clusterNetworks");
        let mut namespaces = Vec::new();
        for (path, item) in self.list(&node, "namespaces") {
            match item.as_str() {
                Some(name) if namespaces.iter().any(|known| known == name) => {
                    self.problem(path, format!("{name:?} is listed twice"));
                }
                Some(name) => {
                    if self.check_identifier(&path, name) {
                        namespaces.push(name.to_owned());
                    }
                }
                None => self.problem(path, format!("must be a namespace's name, found {}", kind_of(item))),
            }
        }
        if !namespaces.is_empty() && !namespaces.contains(&namespace) {
            self.problem(
                node.child("namespaces"),
                format!("must include {namespace:?}, the namespace of pods whose Proxy gives no placement.zone"),
            );
        }
        Some(KubernetesConfig {
            namespace,
            image,
            image_pull_policy,
            fd_limit,
            resources,
            machine_types,
            cluster_networks,
            namespaces,
        })
    }

    fn resource_profile(&mut self, path: &str, value: &Value) -> Option<ResourceProfile> {
        let node = self.mapping(path, value, &["cpu", "memory"])?;
        Some(ResourceProfile {
            cpu: self.quantity(&node, "cpu", "50m"),
            memory: self.quantity(&node, "memory", "128Mi"),
        })
    }

    fn gcp(&mut self, path: &str, value: &Value) -> Option<GcpConfig> {
        let node = self.mapping(
            path,
            value,
            &[
                "project",
                "network",
                "subnetwork",
                "defaultZone",
                "defaultMachineType",
                "defaultImage",
                "firewallTag",
                "credentialsFile",
                "endpoint",
                "wireLogging",
            ],
        )?;
        let project = self.string(&node, "project", true);
        if let Some(project) = &project
            && !is_gcp_project_id(project)
        {
            self.problem(
                node.child("project"),
                format!("{project:?} is not a project ID (6 to 30 lowercase letters, digits and dashes, starting with a letter)"),
            );
        }
        let network = self.string(&node, "network", false).unwrap_or_else(|| "default".into());
        let subnetwork = self.string(&node, "subnetwork", false);
        let default_zone = self.string(&node, "defaultZone", false);
        let default_machine_type = self.string(&node, "defaultMachineType", false).unwrap_or_else(|| "e2-micro".into());
        let default_image = self
            .string(&node, "defaultImage", false)
            .unwrap_or_else(|| "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64".into());
        let firewall_tag = self.identifier(&node, "firewallTag", false).unwrap_or_else(|| "egress-proxy".into());
        let credentials_file = self.string(&node, "credentialsFile", false).map(PathBuf::from);
        let endpoint = self.url(&node, "endpoint", false);
        let wire_logging = self.boolean(&node, "wireLogging");
        Some(GcpConfig {
            project: project.filter(|project| is_gcp_project_id(project))?,
            network,
            subnetwork,
            default_zone,
            default_machine_type,
            default_image,
            firewall_tag,
            credentials_file,
            endpoint,
            wire_logging,
        })
    }

    fn kvm(&mut self, path: &str, value: &Value) -> Option<KvmConfig> {
        let node = self.mapping(
            path,
            value,
            &[
                "ssh",
                "hosts",
                "images",
                "machineTypes",
                "defaultHost",
                "defaultImage",
                "defaultMachineType",
                "vendorData",
                "domainType",
            ],
        )?;
        let ssh = match node.map.get("ssh") {
            Some(value) => self.kvm_ssh(&node.child("ssh"), value),
            None => {
                self.problem(node.child("ssh"), "is required (privateKeyFile and knownHostsFile)");
                None
            }
        };
        let mut hosts = Vec::new();
        let mut host_names = HashSet::new();
        let host_entries = self.list(&node, "hosts");
        if host_entries.is_empty() {
            self.problem(node.child("hosts"), "needs at least one host");
        }
        for (host_path, value) in host_entries {
            if let Some(host) = self.kvm_host(&host_path, value) {
                if !host_names.insert(host.name.clone()) {
                    self.problem(format!("{host_path}.name"), format!("duplicate host name {:?}", host.name));
                }
                hosts.push(host);
            }
        }
        let images = self.keyed(&node, "images", |walker, path, value| walker.kvm_image(path, value));
        if images.is_empty() && !node.map.contains_key("images") {
            self.problem(node.child("images"), "needs at least one image");
        }
        let machine_types =
            self.keyed(&node, "machineTypes", |walker, path, value| walker.kvm_machine_type(path, value));
        let default_host = self.reference(&node, "defaultHost", host_names.iter().map(String::as_str), "hosts");
        let default_image = self.reference(&node, "defaultImage", images.keys().map(String::as_str), "images");
        let default_machine_type =
            self.reference(&node, "defaultMachineType", machine_types.keys().map(String::as_str), "machineTypes");
        let vendor_data = self.string(&node, "vendorData", false);
        let domain_type = self.one_of(&node, "domainType", &["kvm", "qemu"]).unwrap_or_else(|| "kvm".into());
        Some(KvmConfig {
            ssh: ssh?,
            hosts,
            images,
            machine_types,
            default_host,
            default_image,
            default_machine_type,
            vendor_data,
            domain_type,
        })
    }

    /// An optional field that must name one of `known`.
    fn reference<'k>(
        &mut self,
        node: &Node<'_>,
        key: &str,
        known: impl Iterator<Item = &'k str> + Clone,
        section: &str,
    ) -> Option<String> {
        let value = self.identifier(node, key, false)?;
        if known.clone().any(|name| name == value) {
            Some(value)
        } else {
            let mut names: Vec<&str> = known.collect();
            names.sort_unstable();
            self.problem(node.child(key), format!("{value:?} is not one of the {section}: {}", names.join(", ")));
            None
        }
    }

    fn kvm_ssh(&mut self, path: &str, value: &Value) -> Option<KvmSsh> {
        let node = self.mapping(path, value, &["user", "privateKeyFile", "knownHostsFile"])?;
        let user = self.string(&node, "user", false).unwrap_or_else(|| "root".into());
        let private_key_file = self.string(&node, "privateKeyFile", true).map(PathBuf::from);
        let known_hosts_file = self.string(&node, "knownHostsFile", true).map(PathBuf::from);
        Some(KvmSsh { user, private_key_file: private_key_file?, known_hosts_file: known_hosts_file? })
    }

    fn kvm_host(&mut self, path: &str, value: &Value) -> Option<KvmHost> {
        let node =
            self.mapping(path, value, &["name", "address", "port", "user", "pool", "bridge", "socket", "uri"])?;
        let name = self.identifier(&node, "name", true);
        // A host reached through `uri` needs no SSH address.
        let has_uri = node.map.contains_key("uri");
        let address = self.string(&node, "address", !has_uri).or_else(|| has_uri.then(|| "localhost".to_owned()));
        let port = self.integer(&node, "port", 1, 65535).and_then(|port| u16::try_from(port).ok()).unwrap_or(22);
        let user = self.string(&node, "user", false);
        let pool = self.string(&node, "pool", false).unwrap_or_else(|| "default".into());
        let bridge = self.string(&node, "bridge", false).unwrap_or_else(|| "br0".into());
        let socket = self.string(&node, "socket", false);
        if let Some(socket) = &socket
            && !socket.starts_with('/')
        {
            self.problem(node.child("socket"), format!("{socket:?} must be an absolute path"));
        }
        let uri = self.string(&node, "uri", false);
        if let Some(uri) = &uri
            && !uri.contains(":///")
        {
            self.problem(node.child("uri"), format!("{uri:?} must be a local libvirt URI such as qemu:///system"));
        }
        Some(KvmHost { name: name?, address: address?, port, user, pool, bridge, socket, uri })
    }

    fn kvm_image(&mut self, path: &str, value: &Value) -> Option<KvmImage> {
        let node = self.mapping(path, value, &["url", "sha256", "format", "firmware"])?;
        let url = self.url(&node, "url", true);
        let sha256 = self.string(&node, "sha256", true);
        if let Some(sha256) = &sha256
            && !(sha256.len() == 64
                && sha256.bytes().all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte)))
        {
            self.problem(node.child("sha256"), "must be 64 lowercase hex characters");
        }
        let format = self.one_of(&node, "format", &["qcow2", "raw"]).unwrap_or_else(|| "qcow2".into());
        let firmware = self.one_of(&node, "firmware", &["uefi", "bios"]).unwrap_or_else(|| "uefi".into());
        let sha256 = sha256.filter(|sha256| sha256.len() == 64)?;
        Some(KvmImage { url: url?, sha256, format, firmware })
    }

    fn kvm_machine_type(&mut self, path: &str, value: &Value) -> Option<KvmMachineType> {
        let node = self.mapping(path, value, &["vcpus", "memoryMiB", "diskGiB"])?;
        let required = |walker: &mut Self, key: &str, min: u64, max: u64| {
            if !node.map.contains_key(key) {
                walker.problem(node.child(key), "is required");
            }
            walker.integer(&node, key, min, max)
        };
        let vcpus = required(self, "vcpus", 1, 256);
        let memory_mib = required(self, "memoryMiB", 128, 4_194_304);
        let disk_gib = required(self, "diskGiB", 1, 65_536);
        Some(KvmMachineType { vcpus: vcpus?, memory_mib: memory_mib?, disk_gib: disk_gib? })
    }
}

pub(super) fn is_gcp_project_id(value: &str) -> bool {
    (6..=30).contains(&value.len())
        && value.starts_with(|c: char| c.is_ascii_lowercase())
        && !value.ends_with('-')
        && value.bytes().all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'-')
}

/// A Kubernetes quantity: a decimal number and an optional suffix (`m`, `k`, `M`, `G`, `T`, `Ki`, `Mi`, `Gi`, `Ti`).
pub(super) fn is_quantity(value: &str) -> bool {
    let split = value.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(value.len());
    let (number, suffix) = value.split_at(split);
    let number_ok =
        !number.is_empty() && number.matches('.').count() <= 1 && !number.starts_with('.') && !number.ends_with('.');
    number_ok && ["", "m", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti"].contains(&suffix)
}
