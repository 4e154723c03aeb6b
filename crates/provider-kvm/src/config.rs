//! The `kvm:` block of the providers file: the hosts, images and machine sizes libvirt guests are made from.

use std::collections::BTreeMap;
use std::path::PathBuf;

use egress_provider::config::{Problem, SettingsBlock, http_url, identifier, identifier_keys, schema::pattern};
use schemars::{JsonSchema, Schema};
use serde::Deserialize;

/// `kvm:` — libvirt guests.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KvmConfig {
    /// How to reach the hosts.
    pub ssh: KvmSsh,
    /// The hosts; `placement.zone` names one.
    #[schemars(length(min = 1))]
    pub hosts: Vec<KvmHost>,
    /// Images by key; `placement.image` names one.
    #[schemars(transform = identifier_keys)]
    pub images: BTreeMap<String, KvmImage>,
    /// Machine profiles by key; `placement.machineType` names one.
    #[serde(default)]
    #[schemars(transform = identifier_keys)]
    pub machine_types: BTreeMap<String, KvmMachineType>,
    /// The host for Proxies that give no `placement.zone`; default the first host.
    #[schemars(transform = identifier)]
    pub default_host: Option<String>,
    /// The image for Proxies that give no `placement.image`; default the only image when there is one.
    #[schemars(transform = identifier)]
    pub default_image: Option<String>,
    /// The machine profile for Proxies that give no `placement.machineType`.
    #[schemars(transform = identifier)]
    pub default_machine_type: Option<String>,
    /// cloud-init vendor-data to add beside the provider's own (which installs qemu-guest-agent); any format
    /// cloud-init accepts as a MIME part (a script, a cloud-config).
    pub vendor_data: Option<String>,
    /// The libvirt domain type: `kvm` (default) or `qemu` (emulation, for hosts without hardware virtualisation).
    #[serde(default = "default_domain_type")]
    #[schemars(extend("enum" = ["kvm", "qemu"]))]
    pub domain_type: String,
}

/// SSH settings shared by all hosts.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KvmSsh {
    /// The default user. Default `root`.
    #[serde(default = "default_user")]
    pub user: String,
    /// The private key file (for example a mounted Secret); read lazily, so it may appear after start.
    pub private_key_file: PathBuf,
    /// The known_hosts file; no host key is ever accepted unchecked.
    pub known_hosts_file: PathBuf,
}

/// One KVM host.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KvmHost {
    /// The key `placement.zone` uses.
    #[schemars(transform = identifier)]
    pub name: String,
    /// Host name or IP address for SSH; required unless `uri` is set (then `localhost`).
    #[serde(default)]
    pub address: String,
    /// SSH port. Default 22.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// SSH user; default `ssh.user`.
    pub user: Option<String>,
    /// The libvirt storage pool for images and disks. Default `default`.
    #[serde(default = "default_pool")]
    pub pool: String,
    /// The bridge guests attach to. Default `br0`.
    #[serde(default = "default_bridge")]
    pub bridge: String,
    /// The libvirt daemon's socket on the host, when not the system default (`socket=` in the URI).
    #[schemars(transform = absolute_path)]
    pub socket: Option<String>,
    /// A libvirt URI used instead of SSH: `qemu:///system` when the operator runs on the host itself, or
    /// `test:///default` for tests. `address`, `port`, `user` and the ssh settings are then unused.
    #[schemars(transform = local_uri)]
    pub uri: Option<String>,
}

/// A cached guest image.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KvmImage {
    /// Where to download it (http or https).
    #[schemars(transform = http_url)]
    pub url: String,
    /// Its SHA-256, 64 lowercase hex characters; a mismatch fails the download.
    #[schemars(transform = sha256)]
    pub sha256: String,
    /// `qcow2` (default) or `raw`.
    #[serde(default = "default_format")]
    #[schemars(extend("enum" = ["qcow2", "raw"]))]
    pub format: String,
    /// `uefi` (default) or `bios`.
    #[serde(default = "default_firmware")]
    #[schemars(extend("enum" = ["uefi", "bios"]))]
    pub firmware: String,
}

/// A guest size.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KvmMachineType {
    /// Virtual CPUs.
    #[schemars(range(min = 1, max = 256))]
    pub vcpus: u32,
    /// Memory in MiB.
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 128, max = 4_194_304))]
    pub memory_mib: u32,
    /// Root disk size in GiB.
    #[serde(rename = "diskGiB")]
    #[schemars(range(min = 1, max = 65_536))]
    pub disk_gib: u32,
}

fn default_domain_type() -> String {
    "kvm".into()
}

fn default_user() -> String {
    "root".into()
}

fn default_port() -> u16 {
    22
}

fn default_pool() -> String {
    "default".into()
}

fn default_bridge() -> String {
    "br0".into()
}

fn default_format() -> String {
    "qcow2".into()
}

fn default_firmware() -> String {
    "uefi".into()
}

fn sha256(schema: &mut Schema) {
    pattern(schema, "^[0-9a-f]{64}$", "must be 64 lowercase hex characters");
}

fn absolute_path(schema: &mut Schema) {
    pattern(schema, "^/", "must be an absolute path");
}

fn local_uri(schema: &mut Schema) {
    pattern(schema, ":///", "must be a local libvirt URI such as qemu:///system");
}

impl SettingsBlock for KvmConfig {
    const TYPE: &'static str = "kvm";

    fn check(&mut self, at: &str, problems: &mut Vec<Problem>) {
        let mut names: Vec<&str> = Vec::new();
        for (index, host) in self.hosts.iter_mut().enumerate() {
            // A host reached through `uri` needs no SSH address.
            if host.address.is_empty() {
                match host.uri {
                    Some(_) => host.address = "localhost".into(),
                    None => problems
                        .push(Problem { path: format!("{at}.hosts[{index}].address"), message: "is required".into() }),
                }
            }
        }
        for (index, host) in self.hosts.iter().enumerate() {
            if names.contains(&host.name.as_str()) {
                let message = format!("duplicate host name {:?}", host.name);
                problems.push(Problem { path: format!("{at}.hosts[{index}].name"), message });
            }
            names.push(&host.name);
        }
        // A name whose entry had a problem of its own (and so was left out) is not reported again.
        let mut reference = |key: &str, value: &Option<String>, known: Vec<&str>, section: &str| {
            let reported = |value: &str| {
                let entry = format!("{at}.{section}.{value}");
                problems.iter().any(|problem| problem.path == entry || problem.path.starts_with(&format!("{entry}.")))
            };
            if let Some(value) = value
                && !known.contains(&value.as_str())
                && !reported(value)
            {
                let mut known = known;
                known.sort_unstable();
                let message = format!("{value:?} is not one of the {section}: {}", known.join(", "));
                problems.push(Problem { path: format!("{at}.{key}"), message });
            }
        };
        reference("defaultHost", &self.default_host, names, "hosts");
        reference("defaultImage", &self.default_image, self.images.keys().map(String::as_str).collect(), "images");
        let machine_types = self.machine_types.keys().map(String::as_str).collect();
        reference("defaultMachineType", &self.default_machine_type, machine_types, "machineTypes");
    }
}

#[cfg(test)]
mod tests {
    use egress_provider::config::ProvidersConfig;

    use super::*;

    const KVM_OK: &str = r#"
providers:
  - name: kvm-home
    type: kvm
    kvm:
      ssh: { privateKeyFile: /keys/id_ed25519, knownHostsFile: /keys/known_hosts }
      hosts:
        - { name: rack1, address: 192.0.2.10 }
        - { name: rack2, address: 192.0.2.11, port: 2222, user: virt, pool: images, bridge: br1 }
      images:
        debian12: { url: "https://images.example/debian-12.qcow2", sha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef" }
      machineTypes:
        small: { vcpus: 1, memoryMiB: 512, diskGiB: 4 }
      defaultMachineType: small
"#;

    fn parse(text: &str) -> Result<KvmConfig, Vec<String>> {
        match ProvidersConfig::parse_as::<KvmConfig>(text, "providers.yaml") {
            Ok(config) => Ok(config.providers[0].settings::<KvmConfig>().expect("kvm").clone()),
            Err(error) => Err(error.problems.iter().map(ToString::to_string).collect()),
        }
    }

    #[test]
    fn a_full_block_parses_with_defaults() {
        let kvm = parse(KVM_OK).unwrap_or_else(|problems| panic!("{problems:#?}"));
        assert_eq!(kvm.hosts[0].port, 22);
        assert_eq!((kvm.hosts[0].pool.as_str(), kvm.hosts[0].bridge.as_str()), ("default", "br0"));
        assert_eq!((kvm.hosts[1].user.as_deref(), kvm.hosts[1].port), (Some("virt"), 2222));
        assert_eq!(
            (kvm.images["debian12"].format.as_str(), kvm.images["debian12"].firmware.as_str()),
            ("qcow2", "uefi")
        );
        assert_eq!((kvm.domain_type.as_str(), kvm.vendor_data.as_deref()), ("kvm", None));
        assert_eq!((kvm.hosts[0].socket.as_deref(), kvm.hosts[0].uri.as_deref()), (None, None));
        assert_eq!(kvm.default_machine_type.as_deref(), Some("small"));
        assert_eq!(kvm.machine_types["small"], KvmMachineType { vcpus: 1, memory_mib: 512, disk_gib: 4 });
        assert_eq!(kvm.ssh.user, "root");
    }

    #[test]
    fn a_host_with_a_local_uri_needs_no_address() {
        let text = KVM_OK.replace("{ name: rack1, address: 192.0.2.10 }", "{ name: rack1, uri: \"test:///default\" }");
        let kvm = parse(&text).unwrap_or_else(|problems| panic!("{problems:#?}"));
        assert_eq!(kvm.hosts[0].uri.as_deref(), Some("test:///default"));
        assert_eq!(kvm.hosts[0].address, "localhost");
    }

    #[test]
    fn each_mistake_has_its_message_and_path() {
        let with = |from: &str, to: &str| {
            assert!(KVM_OK.contains(from), "fixture contains {from:?}");
            KVM_OK.replace(from, to)
        };
        let cases: Vec<(&str, String, &str)> = vec![
            (
                "host key with a slash",
                with("name: rack1", "name: rack/1"),
                r#"providers[0].kvm.hosts[0].name: "rack/1" must match"#,
            ),
            (
                "image key with a slash",
                with("debian12:", "\"debian/12\":"),
                r#"providers[0].kvm.images.debian/12: "debian/12" must match"#,
            ),
            (
                "duplicate host",
                with("name: rack2", "name: rack1"),
                r#"providers[0].kvm.hosts[1].name: duplicate host name "rack1""#,
            ),
            ("missing address", with("address: 192.0.2.10 ", ""), "providers[0].kvm.hosts[0].address: is required"),
            (
                "short checksum",
                with("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", "abc"),
                r#"providers[0].kvm.images.debian12.sha256: "abc" must be 64 lowercase hex characters"#,
            ),
            (
                "bad firmware",
                with("sha256:", "firmware: efi, sha256:"),
                r#"providers[0].kvm.images.debian12.firmware: "efi" is not one of: uefi, bios"#,
            ),
            (
                "missing key file",
                with("privateKeyFile: /keys/id_ed25519, ", ""),
                "providers[0].kvm.ssh.privateKeyFile: is required",
            ),
            ("missing vcpus", with("vcpus: 1, ", ""), "providers[0].kvm.machineTypes.small.vcpus: is required"),
            (
                "tiny memory",
                with("memoryMiB: 512", "memoryMiB: 16"),
                "providers[0].kvm.machineTypes.small.memoryMiB: 16 is out of range (128 to 4194304)",
            ),
            (
                "unknown default",
                with("defaultMachineType: small", "defaultMachineType: huge"),
                r#"providers[0].kvm.defaultMachineType: "huge" is not one of the machineTypes: small"#,
            ),
            (
                "relative socket",
                with("bridge: br1 }", "bridge: br1, socket: run/libvirt-sock }"),
                r#"providers[0].kvm.hosts[1].socket: "run/libvirt-sock" must be an absolute path"#,
            ),
            (
                "remote uri",
                with("bridge: br1 }", "bridge: br1, uri: \"qemu+ssh://h/system\" }"),
                r#"providers[0].kvm.hosts[1].uri: "qemu+ssh://h/system" must be a local libvirt URI"#,
            ),
            (
                "bad domain type",
                with("defaultMachineType: small", "defaultMachineType: small\n      domainType: xen"),
                r#"providers[0].kvm.domainType: "xen" is not one of: kvm, qemu"#,
            ),
            (
                "port out of range",
                with("port: 2222", "port: 70000"),
                "providers[0].kvm.hosts[1].port: 70000 is out of range (1 to 65535)",
            ),
            ("no hosts", with("hosts:", "hosts: []\n      other:"), "providers[0].kvm.hosts: must not be empty"),
            ("no images", with("images:", "imagez:"), "providers[0].kvm.images: is required"),
        ];
        for (name, text, expected) in cases {
            let found = parse(&text).expect_err(name);
            assert!(
                found.iter().any(|problem| problem.contains(expected)),
                "{name}: expected {expected:?} in {found:#?}"
            );
        }
    }

    #[test]
    fn schema_problems_and_references_are_reported_in_one_pass() {
        let text = KVM_OK
            .replace("memoryMiB: 512", "memoryMiB: 16")
            .replace("defaultMachineType: small", "defaultMachineType: small\n      defaultHost: rack9");
        let found = parse(&text).expect_err("two mistakes");
        assert_eq!(
            found,
            [
                "providers[0].kvm.machineTypes.small.memoryMiB: 16 is out of range (128 to 4194304)",
                r#"providers[0].kvm.defaultHost: "rack9" is not one of the hosts: rack1, rack2"#,
            ],
            "the machine type left out for its own problem is not reported again as unknown"
        );
    }
}
