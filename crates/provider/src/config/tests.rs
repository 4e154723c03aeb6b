//! Table tests of the providers file: what parses, and the exact message and path of each mistake.

use super::walker::is_quantity;
use super::*;

fn parse(text: &str) -> Result<ProvidersConfig, ConfigError> {
    ProvidersConfig::parse(text, "providers.yaml")
}

fn problems(text: &str) -> Vec<String> {
    match parse(text) {
        Ok(config) => panic!("expected problems, parsed {config:?}"),
        Err(error) => error.problems.iter().map(ToString::to_string).collect(),
    }
}

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

#[test]
fn a_full_file_parses_with_defaults() {
    let text = format!(
        "{}{}",
        r#"
providers:
  - name: pods
    type: kubernetes
  - name: pods-big
    type: kubernetes
    kubernetes:
      namespace: egress
      image: ubuntu/squid:6.10
      imagePullPolicy: IfNotPresent
      fdLimit: 4096
      resources: { cpu: 100m, memory: 256Mi }
      machineTypes:
        large: { cpu: "1", memory: 1Gi }
  - name: gcp-eu
    type: gcp
    gcp: { project: my-project, defaultZone: europe-west1-b, endpoint: "http://127.0.0.1:9000" }
"#,
        KVM_OK.trim_start_matches("\nproviders:\n")
    );
    let config = parse(&text).unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(config.providers.len(), 4);
    let ProviderSettings::Kubernetes(pods) = &config.get("pods").expect("pods").settings else { panic!("kubernetes") };
    assert_eq!(
        (pods.namespace.as_str(), pods.image.as_str(), pods.fd_limit, pods.resources.memory.as_str()),
        ("egress-proxies", "ubuntu/squid:latest", 16384, "128Mi")
    );
    let ProviderSettings::Kubernetes(big) = &config.get("pods-big").expect("pods-big").settings else { panic!() };
    assert_eq!(big.machine_types["large"], ResourceProfile { cpu: "1".into(), memory: "1Gi".into() });
    assert_eq!(big.image_pull_policy.as_deref(), Some("IfNotPresent"));
    let ProviderSettings::Gcp(gcp) = &config.get("gcp-eu").expect("gcp-eu").settings else { panic!("gcp") };
    assert_eq!(
        (gcp.network.as_str(), gcp.default_machine_type.as_str(), gcp.firewall_tag.as_str()),
        ("default", "e2-micro", "egress-proxy")
    );
    assert!(!gcp.wire_logging, "the SDK's wire logging is off unless asked for");
    let ProviderSettings::Kvm(kvm) = &config.get("kvm-home").expect("kvm-home").settings else { panic!("kvm") };
    assert_eq!(kvm.hosts[0].port, 22);
    assert_eq!((kvm.hosts[0].pool.as_str(), kvm.hosts[0].bridge.as_str()), ("default", "br0"));
    assert_eq!(kvm.hosts[1].user.as_deref(), Some("virt"));
    assert_eq!((kvm.images["debian12"].format.as_str(), kvm.images["debian12"].firmware.as_str()), ("qcow2", "uefi"));
    assert_eq!((kvm.domain_type.as_str(), kvm.vendor_data.as_deref()), ("kvm", None));
    assert_eq!((kvm.hosts[0].socket.as_deref(), kvm.hosts[0].uri.as_deref()), (None, None));
    assert_eq!(kvm.default_machine_type.as_deref(), Some("small"));
}

#[test]
fn a_kvm_host_with_a_local_uri_needs_no_address() {
    let text = KVM_OK.replace("{ name: rack1, address: 192.0.2.10 }", "{ name: rack1, uri: \"test:///default\" }");
    let config = parse(&text).expect("parses");
    let ProviderSettings::Kvm(kvm) = &config.get("kvm-home").expect("kvm-home").settings else { panic!("kvm") };
    assert_eq!(kvm.hosts[0].uri.as_deref(), Some("test:///default"));
    assert_eq!(kvm.hosts[0].address, "localhost");
}

#[test]
fn gcp_wire_logging_is_an_explicit_switch() {
    let config = parse("providers:\n  - { name: g, type: gcp, gcp: { project: my-project, wireLogging: true } }\n")
        .expect("parses");
    let ProviderSettings::Gcp(gcp) = &config.get("g").expect("g").settings else { panic!("gcp") };
    assert!(gcp.wire_logging);
}

#[test]
fn each_mistake_has_its_message_and_path() {
    let cases: &[(&str, &str, &str)] = &[
        ("not YAML", "providers: [", "not valid YAML"),
        ("empty file", "", "the file is empty"),
        ("not a mapping", "- a\n- b\n", "must be a mapping, found a list"),
        ("no providers key", "other: 1\n", "other: unknown field (expected one of: providers)"),
        ("providers not a list", "providers: {}\n", "providers: must be a list, found a mapping"),
        ("unknown key", "providers:\n  - { name: a, type: kubernetes, zone: x }\n", "providers[0].zone: unknown field"),
        ("missing name", "providers:\n  - { type: kubernetes }\n", "providers[0].name: is required"),
        ("missing type", "providers:\n  - { name: a }\n", "providers[0].type: is required"),
        (
            "unknown type",
            "providers:\n  - { name: a, type: aws }\n",
            r#"providers[0].type: "aws" is not one of: kubernetes, gcp, kvm"#,
        ),
        (
            "bad name",
            "providers:\n  - { name: Pods_1, type: kubernetes }\n",
            r#"providers[0].name: "Pods_1" must match [a-z0-9]([a-z0-9-]*[a-z0-9])?"#,
        ),
        (
            "trailing dash",
            "providers:\n  - { name: pods-, type: kubernetes }\n",
            "providers[0].name: \"pods-\" must match",
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
            "missing gcp block",
            "providers:\n  - { name: a, type: gcp }\n",
            r#"providers[0].gcp: is required for type "gcp""#,
        ),
        (
            "missing project",
            "providers:\n  - { name: a, type: gcp, gcp: {} }\n",
            "providers[0].gcp.project: is required",
        ),
        (
            "bad project",
            "providers:\n  - { name: a, type: gcp, gcp: { project: My_Project } }\n",
            r#"providers[0].gcp.project: "My_Project" is not a project ID"#,
        ),
        (
            "bad endpoint",
            "providers:\n  - { name: a, type: gcp, gcp: { project: my-project, endpoint: ftp://x } }\n",
            r#"providers[0].gcp.endpoint: "ftp://x" must be an http:// or https:// URL"#,
        ),
        (
            "wireLogging not a boolean",
            "providers:\n  - { name: a, type: gcp, gcp: { project: my-project, wireLogging: \"yes\" } }\n",
            "providers[0].gcp.wireLogging: must be true or false, found a string",
        ),
        (
            "wrong scalar type",
            "providers:\n  - { name: a, type: kubernetes, kubernetes: { image: 5 } }\n",
            "providers[0].kubernetes.image: must be a string, found a number",
        ),
        (
            "fd limit out of range",
            "providers:\n  - { name: a, type: kubernetes, kubernetes: { fdLimit: 10 } }\n",
            "providers[0].kubernetes.fdLimit: 10 is out of range (1024 to 1048576)",
        ),
        (
            "bad quantity",
            "providers:\n  - { name: a, type: kubernetes, kubernetes: { resources: { cpu: lots } } }\n",
            r#"providers[0].kubernetes.resources.cpu: "lots" is not a Kubernetes quantity"#,
        ),
        (
            "bad pull policy",
            "providers:\n  - { name: a, type: kubernetes, kubernetes: { imagePullPolicy: Sometimes } }\n",
            r#"providers[0].kubernetes.imagePullPolicy: "Sometimes" is not one of: Always, IfNotPresent, Never"#,
        ),
        (
            "empty string",
            "providers:\n  - { name: a, type: kubernetes, kubernetes: { image: '' } }\n",
            "providers[0].kubernetes.image: must not be empty",
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
fn kvm_mistakes_have_their_paths() {
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
            "providers[0].kvm.images.debian12.sha256: must be 64 lowercase hex characters",
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
            "providers[0].kvm.machineTypes.small.memoryMiB: 16 is out of range",
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
    ];
    for (name, text, expected) in cases {
        let found = problems(&text);
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
  - name: gcp-eu
    type: gcp
    gcp: { network: default }
  - name: Bad_Name
    type: kubernetes
  - name: kvm-home
    type: kvm
    kvm:
      ssh: { privateKeyFile: /k, knownHostsFile: /h }
      hosts: [ { name: "rack/1", address: 192.0.2.1 } ]
      images: {}
"#;
    let error = parse(text).expect_err("five mistakes");
    let messages: Vec<String> = error.problems.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [
            "providers[0].kubernetes.colour: unknown field (expected one of: namespace, namespaces, image, imagePullPolicy, fdLimit, resources, machineTypes, clusterNetworks)",
            r#"providers[1].name: duplicate provider name "pods""#,
            "providers[2].gcp.project: is required",
            r#"providers[3].name: "Bad_Name" must match [a-z0-9]([a-z0-9-]*[a-z0-9])? (at most 63 characters)"#,
            r#"providers[4].kvm.hosts[0].name: "rack/1" must match [a-z0-9]([a-z0-9-]*[a-z0-9])? (at most 63 characters)"#,
        ]
    );
    let shown = error.to_string();
    assert!(shown.starts_with("providers.yaml has 5 problems:"), "{shown}");
    assert_eq!(shown.lines().count(), 6, "{shown}");
}

#[test]
fn identifiers() {
    for good in ["a", "pods", "gcp-eu-1", "0", &"a".repeat(63)] {
        assert!(is_identifier(good), "{good:?}");
    }
    for bad in ["", "-a", "a-", "A", "a_b", "a/b", "a.b", "a b", &"a".repeat(64)] {
        assert!(!is_identifier(bad), "{bad:?}");
    }
}

#[test]
fn quantities() {
    for good in ["1", "100m", "0.5", "128Mi", "1Gi", "2G"] {
        assert!(is_quantity(good), "{good:?}");
    }
    for bad in ["", "m", "1.", ".5", "1.2.3", "lots", "1MB", "-1"] {
        assert!(!is_quantity(bad), "{bad:?}");
    }
}

#[test]
fn destinations_and_cluster_networks_parse() {
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
    let ProviderSettings::Kubernetes(settings) = &pods.settings else { panic!("kubernetes") };
    let networks: Vec<String> = settings.cluster_networks.iter().map(ToString::to_string).collect();
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
    assert_eq!(found[2], "providers[0].destinations.allow[1]: must be a string such as 10.0.0.0/8, found a number");
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
fn kubernetes_namespaces_parse_and_bad_ones_are_reported_with_their_paths() {
    let config = parse(
        r#"
providers:
  - name: pods
    type: kubernetes
    kubernetes: { namespace: crawl, namespaces: [crawl, crawl-eu] }
"#,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let ProviderSettings::Kubernetes(settings) = &config.get("pods").expect("pods").settings else {
        panic!("kubernetes")
    };
    assert_eq!(settings.namespaces, ["crawl", "crawl-eu"]);
    let found = problems(
        r#"
providers:
  - name: pods
    type: kubernetes
    kubernetes: { namespace: crawl, namespaces: [crawl-eu, Crawl_US, crawl-eu, 7] }
"#,
    );
    assert_eq!(
        found,
        [
            "providers[0].kubernetes.namespaces[1]: \"Crawl_US\" must match [a-z0-9]([a-z0-9-]*[a-z0-9])? (at most 63 characters)",
            "providers[0].kubernetes.namespaces[2]: \"crawl-eu\" is listed twice",
            "providers[0].kubernetes.namespaces[3]: must be a namespace's name, found a number",
            "providers[0].kubernetes.namespaces: must include \"crawl\", the namespace of pods whose Proxy gives no placement.zone",
        ],
        "{found:#?}"
    );
}
