use super::*;

fn rule(text: &str) -> DestinationRule {
    text.parse().unwrap_or_else(|error| panic!("{text}: {error}"))
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

#[test]
fn rules_parse_and_print_back() {
    for (text, shown) in [
        ("10.0.0.0/8", "10.0.0.0/8"),
        ("10.1.2.3", "10.1.2.3/32"),
        ("10.0.0.0/8:8000-8999", "10.0.0.0/8:8000-8999"),
        ("127.0.0.1:41234", "127.0.0.1/32:41234"),
        ("[fd00::/8]:443", "[fd00::/8]:443"),
        ("[fd00::1]", "fd00::1/128"),
        ("fd00::/8", "fd00::/8"),
        ("*:8443", "*:8443"),
        (" *:22-25 ", "*:22-25"),
    ] {
        let parsed = rule(text);
        assert_eq!(parsed.to_string(), shown, "{text}");
        assert_eq!(rule(shown), parsed, "{shown} parses back");
    }
}

#[test]
fn malformed_rules_are_refused_with_the_expected_forms() {
    for text in [
        "",
        "*",
        "*:",
        "10.0.0.0/33",
        "10.1.2.3/8",
        "10.0.0.0/8:",
        "10.0.0.0/8:0",
        "10.0.0.0/8:99999",
        "10.0.0.0/8:9-1",
        "example.com",
        "example.com:443",
        "[fd00::/8",
        "[fd00::/8]443",
        "fd00::1:443x",
        "10.0.0.0/8:80:81",
    ] {
        let error = text.parse::<DestinationRule>().expect_err(text);
        assert!(error.to_string().contains("expected a CIDR"), "{text}: {error}");
    }
}

#[test]
fn every_default_class_is_denied_and_the_public_web_is_not() {
    let policy = DestinationPolicy::default();
    for (address, class) in [
        ("127.0.0.1", "loopback"),
        ("0.0.0.0", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "shared"),
        ("fd00:ec2::254", "unique-local"),
        ("224.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        // IPv6 forms that carry an IPv4 address (here loopback and the metadata server's).
        ("::127.0.0.1", "ipv4-embedded"),
        ("::ffff:0:a9fe:a9fe", "ipv4-embedded"),
        ("64:ff9b::a9fe:a9fe", "ipv4-embedded"),
        ("64:ff9b:1::a9fe:a9fe", "ipv4-embedded"),
        ("2002:a9fe:a9fe::1", "ipv4-embedded"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "ipv4-embedded"),
        // An IPv4-mapped address is the IPv4 address it maps.
        ("::ffff:169.254.169.254", "link-local"),
    ] {
        match policy.check(ip(address), 443, true, &[]) {
            Some(Denial::Class(found)) => assert_eq!(found.name, class, "{address}"),
            other => panic!("{address}: {other:?}"),
        }
    }
    assert_eq!(policy.check(ip("93.184.215.14"), 443, true, &[]), None);
    assert_eq!(policy.check(ip("93.184.215.14"), 80, false, &[]), None);
    assert_eq!(policy.check(ip("2606:2800:21f:cb07::1"), 443, false, &[]), None);
}

#[test]
fn connect_reaches_443_only_and_plain_http_80_and_443() {
    let policy = DestinationPolicy::default();
    let public = ip("93.184.215.14");
    assert_eq!(policy.check(public, 22, true, &[]), Some(Denial::Port { port: 22, connect: true }));
    assert_eq!(policy.check(public, 80, true, &[]), Some(Denial::Port { port: 80, connect: true }));
    assert_eq!(policy.check(public, 8080, false, &[]), Some(Denial::Port { port: 8080, connect: false }));
    let wider = DestinationPolicy { allow: vec![rule("*:8443")], deny: Vec::new() };
    assert_eq!(wider.check(public, 8443, true, &[]), None);
    // A port-only allow never opens a denied network.
    assert!(matches!(wider.check(ip("10.0.0.1"), 8443, true, &[]), Some(Denial::Class(_))));
}

#[test]
fn allow_makes_exceptions_and_deny_wins_over_allow() {
    let policy = DestinationPolicy {
        allow: vec![rule("127.0.0.1:41234"), rule("10.0.0.0/8")],
        deny: vec![rule("10.9.0.0/16"), rule("*:25")],
    };
    assert_eq!(policy.check(ip("127.0.0.1"), 41234, true, &[]), None, "the exception skips the port check too");
    assert!(
        matches!(policy.check(ip("127.0.0.1"), 6443, true, &[]), Some(Denial::Class(_))),
        "other ports stay denied"
    );
    assert_eq!(policy.check(ip("10.1.2.3"), 8080, false, &[]), None);
    assert_eq!(policy.check(ip("10.9.1.1"), 443, true, &[]), Some(Denial::Rule(rule("10.9.0.0/16"))));
    assert_eq!(policy.check(ip("93.184.215.14"), 25, false, &[]), Some(Denial::Rule(rule("*:25"))));
    let narrowed = policy.narrowed_by(&[rule("10.1.0.0/16")]);
    assert!(matches!(narrowed.check(ip("10.1.2.3"), 443, true, &[]), Some(Denial::Rule(_))), "a Proxy narrows");
}

#[test]
fn provider_networks_are_denied_even_when_public() {
    let cluster: IpNet = "34.118.224.0/20".parse().expect("a network");
    let denial = DestinationPolicy::default().check(ip("34.118.224.10"), 443, true, &[cluster]);
    assert_eq!(denial, Some(Denial::Class(&PROVIDER_NETWORKS)));
    assert!(denial.expect("denied").to_string().contains("clusterNetworks"));
}

#[test]
fn squid_rules_deny_first_then_allow_then_the_classes_then_the_ports() {
    let policy = DestinationPolicy { allow: vec![rule("127.0.0.1:41234"), rule("*:8443")], deny: vec![rule("*:25")] };
    let cluster: IpNet = "34.118.224.0/20".parse().expect("a network");
    let rules = squid_rules(&policy, &[cluster]);
    let access: Vec<&str> = rules.lines().filter(|line| line.starts_with("http_access")).collect();
    // The cache manager and other schemes first: no allow rule can open them.
    assert_eq!(access[0], "http_access deny manager egress_denied_manager");
    assert_eq!(access[1], "http_access deny !CONNECT !egress_web_protocols egress_denied_protocol");
    assert_eq!(access[2], "http_access deny egress_deny_0_port egress_denied_rule_0");
    assert_eq!(access[3], "http_access allow egress_allow_0_dst egress_allow_0_port");
    assert_eq!(access[4], "http_access deny egress_loopback egress_denied_loopback");
    let classes = DEFAULT_DENIED.len();
    assert_eq!(access[4 + classes], "http_access deny egress_provider_network egress_denied_provider_network");
    assert_eq!(access[5 + classes], "http_access deny CONNECT !egress_tls_ports egress_denied_port");
    assert_eq!(access[6 + classes], "http_access deny !egress_web_ports egress_denied_port");
    assert_eq!(access.len(), 7 + classes);
    assert!(rules.contains("\nacl egress_web_protocols proto HTTP HTTPS\n"));
    assert!(rules.ends_with("\ncachemgr_passwd disable all\n"), "{rules}");
    assert!(rules.contains("\nacl egress_allow_0_dst dst 127.0.0.1/32\nacl egress_allow_0_port port 41234\n"));
    assert!(rules.contains("\nacl egress_provider_network dst 34.118.224.0/20\n"));
    assert!(rules.contains("\nacl egress_tls_ports port 443 8443\n"), "{rules}");
    assert!(rules.contains("\nacl egress_web_ports port 80 443 8443\n"));
    assert!(rules.contains("\nacl egress_link_local dst 169.254.0.0/16 fe80::/10\n"));
    assert!(rules.contains("reply_header_add X-Egress-Policy \"denied %{egress-policy}note\" egress_policy_denied\n"));
}

#[test]
fn literal_addresses_are_recognised_and_names_are_not() {
    assert_eq!(literal_address("127.0.0.1"), Some(ip("127.0.0.1")));
    assert_eq!(literal_address("[::1]"), Some(ip("::1")));
    assert_eq!(literal_address("::1"), Some(ip("::1")));
    assert_eq!(literal_address("example.com"), None);
    assert_eq!(literal_address("localhost"), Some(ip("127.0.0.1")));
    assert_eq!(literal_address("api.LOCALHOST."), Some(ip("127.0.0.1")));
    assert_eq!(literal_address("localhost.example"), None);
}

#[test]
fn the_fingerprint_changes_with_the_rules_and_not_with_their_order() {
    let policy = |allow: &[&str], deny: &[&str]| DestinationPolicy {
        allow: allow.iter().map(|text| rule(text)).collect(),
        deny: deny.iter().map(|text| rule(text)).collect(),
    };
    assert_eq!(DestinationPolicy::default().fingerprint(), None, "the default policy keeps the plain spec hash");
    let one = policy(&["127.0.0.1:8080", "10.1.0.0/16"], &[]).fingerprint().expect("a fingerprint");
    assert_eq!(one.len(), 16);
    assert!(one.bytes().all(|byte| byte.is_ascii_hexdigit()));
    assert_eq!(
        policy(&["10.1.0.0/16", "127.0.0.1:8080", "10.1.0.0/16"], &[]).fingerprint().as_deref(),
        Some(one.as_str())
    );
    let widened = policy(&["127.0.0.1:8080", "10.1.0.0/16", "127.0.0.1:9090"], &[]).fingerprint();
    assert_ne!(widened.as_deref(), Some(one.as_str()), "an allow rule more");
    // The same rule denied instead of allowed.
    let denied = policy(&["10.1.0.0/16"], &["127.0.0.1:8080"]).fingerprint();
    assert_ne!(denied.as_deref(), Some(one.as_str()));
}
