//! The Proxy's defaults, clamps and helpers.

use super::*;

fn managed() -> ProxySpec {
    ProxySpec { provider: Some("pods".into()), ..ProxySpec::new(ProxyMode::Managed) }
}

fn external(host: &str, port: i32) -> ProxySpec {
    ProxySpec { endpoint: Some(Endpoint { host: host.into(), port }), ..ProxySpec::new(ProxyMode::External) }
}

fn published(host: &str, port: i32) -> ProxyStatus {
    ProxyStatus { endpoint: Some((&Endpoint { host: host.into(), port }).into()), ..ProxyStatus::default() }
}

#[test]
fn effective_endpoint_follows_the_mode() {
    let cases: [(&str, ProxySpec, Option<ProxyStatus>, Option<Endpoint>); 5] = [
        (
            "external uses spec",
            external("proxy.example", 8080),
            None,
            Some(Endpoint { host: "proxy.example".into(), port: 8080 }),
        ),
        (
            "external ignores status",
            external("proxy.example", 8080),
            Some(published("10.0.0.1", 3128)),
            Some(Endpoint { host: "proxy.example".into(), port: 8080 }),
        ),
        ("managed without status", managed(), None, None),
        ("managed before publishing", managed(), Some(ProxyStatus::default()), None),
        (
            "managed uses status",
            managed(),
            Some(published("10.0.0.1", 3128)),
            Some(Endpoint { host: "10.0.0.1".into(), port: 3128 }),
        ),
    ];
    for (name, spec, status, expected) in cases {
        let mut proxy = Proxy::new("p", spec);
        proxy.status = status;
        assert_eq!(proxy.effective_endpoint(), expected, "{name}");
    }
}

#[test]
fn rotation_token_combines_the_annotation_and_max_age_rotations() {
    let cases = [
        (None, None, None, None),
        (None, Some(0), Some(0), None),
        (Some("a"), None, None, Some("a")),
        (None, Some(2), None, Some("#maxAge2")),
        (Some("a"), Some(1), None, Some("a#maxAge1")),
        (None, None, Some(1), Some("#heal1")),
        (Some("a"), Some(2), Some(3), Some("a#maxAge2#heal3")),
    ];
    for (annotation, rotations, replacements, expected) in cases {
        let mut proxy = Proxy::new("p", managed());
        if let Some(token) = annotation {
            proxy.metadata.annotations = Some([(crate::annotations::ROTATE.to_owned(), token.to_owned())].into());
        }
        proxy.status = Some(ProxyStatus { max_age_rotations: rotations, replacements, ..ProxyStatus::default() });
        assert_eq!(proxy.rotation_token().as_deref(), expected, "{annotation:?} {rotations:?} {replacements:?}");
        assert_eq!(proxy.desired_spec_hash(), crate::spec_hash(&proxy.spec, expected));
    }
}

#[test]
fn the_replacement_cause_is_read_from_the_instance_hash() {
    let proxy_with = |spec: ProxySpec, annotation: Option<&str>, rotations: u32, replacements: u32| {
        let mut proxy = Proxy::new("p", spec);
        if let Some(token) = annotation {
            proxy.metadata.annotations = Some([(crate::annotations::ROTATE.to_owned(), token.to_owned())].into());
        }
        proxy.status = Some(ProxyStatus {
            max_age_rotations: Some(rotations),
            replacements: Some(replacements),
            ..ProxyStatus::default()
        });
        proxy
    };
    let before = proxy_with(managed(), None, 1, 1).desired_spec_hash();
    let cases = [
        (proxy_with(managed(), None, 1, 2), "self-healing replaces the dead instance"),
        (proxy_with(managed(), None, 2, 1), "the instance reached maxAge"),
        (proxy_with(managed(), Some("now"), 1, 1), "the crawl.example.com/rotate annotation was set"),
        (
            proxy_with(ProxySpec { max_leases: Some(9), ..managed() }, None, 1, 1),
            "the spec (or the crawl.example.com/rotate annotation) changed",
        ),
    ];
    for (proxy, cause) in cases {
        assert_eq!(proxy.replacement_cause(&before, None, None), cause);
    }
    // The same spec on a provider whose destination policy changed.
    let proxy = proxy_with(managed(), None, 1, 1);
    let on_old_policy = proxy.desired_spec_hash_with(Some("0123456789abcdef"));
    assert_ne!(on_old_policy, before, "the fingerprint changes the hash");
    assert_eq!(
        proxy.replacement_cause(&on_old_policy, Some("0123456789abcdef"), Some("fedcba9876543210")),
        "the provider's destination policy changed"
    );
    assert_eq!(
        proxy.replacement_cause(&before, None, Some("fedcba9876543210")),
        "the provider's destination policy changed"
    );
}

#[test]
fn endpoint_address_brackets_ipv6() {
    let cases = [
        ("10.0.0.1", 3128, "10.0.0.1:3128"),
        ("::1", 8080, "[::1]:8080"),
        ("[::1]", 80, "[::1]:80"),
        ("proxy.example", 1, "proxy.example:1"),
    ];
    for (host, port, expected) in cases {
        assert_eq!(Endpoint { host: host.into(), port }.address(), expected);
    }
}

#[test]
fn max_leases_defaults_to_five_and_keeps_zero() {
    let cases = [(None, 5), (Some(0), 0), (Some(1), 1), (Some(40), 40), (Some(-3), 0)];
    for (value, expected) in cases {
        let spec = ProxySpec { max_leases: value, ..managed() };
        assert_eq!(spec.max_leases(), expected, "maxLeases {value:?}");
    }
}

#[test]
fn max_age_parses_go_durations() {
    let cases = [
        (None, None),
        (Some("90m"), Some(5400)),
        (Some("24h"), Some(86400)),
        (Some("1h30m"), Some(5400)),
        (Some("0s"), None),
        (Some("-5m"), None),
    ];
    for (value, expected) in cases {
        let spec = ProxySpec { max_age: value.map(|v| v.parse().expect("valid duration")), ..managed() };
        assert_eq!(spec.max_age().map(|age| age.as_secs()), expected, "maxAge {value:?}");
    }
}

#[test]
fn health_check_with_defaults() {
    let default_url = "https://probe.example/ip";
    let cases = [
        ("defaults", HealthCheck::default(), (30, 10, 2, 3, default_url)),
        (
            "explicit",
            HealthCheck {
                interval_seconds: 60,
                timeout_seconds: 5,
                healthy_threshold: 1,
                unhealthy_threshold: 7,
                probe_url: Some("http://o.example/".into()),
                replace_after_seconds: 60,
            },
            (60, 5, 1, 7, "http://o.example/"),
        ),
        (
            "clamped from nonsense",
            HealthCheck {
                interval_seconds: 0,
                timeout_seconds: 99,
                healthy_threshold: 0,
                unhealthy_threshold: -1,
                probe_url: None,
                replace_after_seconds: -5,
            },
            (5, 4, 1, 1, default_url),
        ),
    ];
    for (name, check, (interval, timeout, healthy, unhealthy, url)) in cases {
        let effective = check.effective(default_url);
        assert_eq!(effective.interval, StdDuration::from_secs(interval), "{name}");
        assert_eq!(effective.timeout, StdDuration::from_secs(timeout), "{name}");
        assert_eq!(effective.healthy_threshold, healthy, "{name}");
        assert_eq!(effective.unhealthy_threshold, unhealthy, "{name}");
        assert_eq!(effective.probe_url, url, "{name}");
    }
}

#[test]
fn empty_health_check_deserializes_with_every_default() {
    let check: HealthCheck = serde_json::from_str("{}").expect("empty object is a valid health check");
    assert_eq!(check, HealthCheck::default());
}

#[test]
fn explicit_zero_max_leases_survives_serde() {
    let spec = ProxySpec { max_leases: Some(0), ..managed() };
    let json = serde_json::to_value(&spec).expect("serializes");
    assert_eq!(json["maxLeases"], 0);
    let back: ProxySpec = serde_json::from_value(json).expect("deserializes");
    assert_eq!(back.max_leases, Some(0));
    let unset = serde_json::to_value(managed()).expect("serializes");
    assert!(unset.get("maxLeases").is_none(), "an unset maxLeases is omitted so the apiserver default applies");
}
