//! Target normalisation: what a cooldown is keyed by.
//!
//! A ban is about a site, not a URL: the target is lower-cased, stripped of scheme, credentials, port, path and a
//! trailing dot, and by default reduced to its registrable domain with the public suffix list, so a ban on
//! `www.shop.example.co.uk` also covers `img.shop.example.co.uk`. Exact-host mode keeps the full host name.
//!
//! A target is a host, an IP address, or an `http`/`https` URL; any other scheme (`javascript:`, `mailto:`,
//! `ftp://`) is refused. Internationalised names are normalised to their ASCII (punycode) form first, so
//! `bücher.example.de` and `xn--bcher-kva.example.de` are one site.

/// How targets are compared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TargetMode {
    /// Reduce to the registrable domain (`shop.example.co.uk` → `example.co.uk`).
    #[default]
    RegistrableDomain,
    /// Keep the host exactly (`www.example.com` and `example.com` differ).
    ExactHost,
}

/// A target that cannot be normalised.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{target:?} is not a host name, IP address or URL: {why}")]
pub struct InvalidTarget {
    /// What was given.
    pub target: String,
    /// What is wrong.
    pub why: &'static str,
}

/// Normalises a target: a host name, an IP address, or a URL.
pub fn normalize(target: &str, mode: TargetMode) -> Result<String, InvalidTarget> {
    let invalid = |why| InvalidTarget { target: target.to_owned(), why };
    let mut rest = target.trim();
    if let Some((scheme, after)) = rest.split_once("://") {
        if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
            return Err(invalid("only http and https URLs are targets"));
        }
        rest = after;
    } else if let Some((before, after)) = rest.split_once(':')
        && !before.contains(['/', '[', '@'])
        && before.matches(':').count() == 0
        && !after.contains(':')
        && !after
            .split(['/', '?', '#'])
            .next()
            .is_some_and(|port| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
    {
        // `javascript:alert(1)`, `mailto:a@b.com`: a scheme without `//`, not `host:port`.
        return Err(invalid("only http and https URLs are targets"));
    }
    rest = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if let Some((_, host)) = rest.rsplit_once('@') {
        rest = host;
    }
    let host = if let Some(bracketed) = rest.strip_prefix('[') {
        bracketed.split(']').next().unwrap_or_default()
    } else if rest.matches(':').count() == 1 {
        rest.split(':').next().unwrap_or_default()
    } else {
        rest
    };
    let host = host.trim_end_matches('.');
    let host = if host.is_ascii() {
        host.to_ascii_lowercase()
    } else {
        idna::domain_to_ascii(host).map_err(|_| invalid("it is not a valid internationalised domain name"))?
    };
    if host.is_empty() {
        return Err(invalid("it has no host"));
    }
    if host.len() > 253 {
        return Err(invalid("it is longer than 253 characters"));
    }
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(host);
    }
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && label.bytes().all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
    };
    if !host.split('.').all(label_ok) {
        return Err(invalid("a host name is dot-separated labels of letters, digits, '-' and '_'"));
    }
    Ok(match mode {
        TargetMode::ExactHost => host,
        TargetMode::RegistrableDomain => psl::domain_str(&host).map_or(host.clone(), str::to_owned),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_normalise_to_the_registrable_domain() {
        let cases = [
            ("www.shop.example.co.uk", "example.co.uk"),
            ("img.shop.example.co.uk", "example.co.uk"),
            ("https://User:pw@WWW.Example.com:8443/path?q=1", "example.com"),
            ("example.com.", "example.com"),
            ("sub.example.github.io", "example.github.io"),
            ("203.0.113.7", "203.0.113.7"),
            ("http://[2001:db8::1]:8080/", "2001:db8::1"),
            ("localhost", "localhost"),
        ];
        for (input, expected) in cases {
            assert_eq!(normalize(input, TargetMode::RegistrableDomain).as_deref(), Ok(expected), "{input}");
        }
    }

    #[test]
    fn exact_host_mode_keeps_the_host() {
        assert_eq!(
            normalize("WWW.shop.example.co.uk:443", TargetMode::ExactHost).as_deref(),
            Ok("www.shop.example.co.uk")
        );
    }

    #[test]
    fn junk_is_rejected() {
        for bad in ["", "   ", "http:///path", "exa mple.com", "a..b", &"a".repeat(300)] {
            assert!(normalize(bad, TargetMode::RegistrableDomain).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_http_and_https_urls_are_targets() {
        for bad in
            ["javascript:alert(1)", "mailto:a@b.com", "ftp://example.com/", "file:///etc/passwd", "data:text/html,x"]
        {
            let error = normalize(bad, TargetMode::RegistrableDomain).expect_err(bad);
            assert_eq!(error.why, "only http and https URLs are targets", "{bad}");
        }
        for good in
            ["HTTPS://example.com/", "example.com:8443", "example.com:8443/path", "[2001:db8::1]:443", "2001:db8::1"]
        {
            assert!(normalize(good, TargetMode::RegistrableDomain).is_ok(), "{good}");
        }
    }

    #[test]
    fn internationalised_names_normalise_to_punycode() {
        for input in ["bücher.example.de", "https://www.BÜCHER.example.de/", "xn--bcher-kva.example.de"] {
            assert_eq!(
                normalize(input, TargetMode::ExactHost).as_deref().map(|host| host.trim_start_matches("www.")),
                Ok("xn--bcher-kva.example.de"),
                "{input}"
            );
        }
        assert_eq!(normalize("shop.bücher.de", TargetMode::RegistrableDomain).as_deref(), Ok("xn--bcher-kva.de"));
        assert!(normalize("a\u{200b}\u{fffe}.example", TargetMode::ExactHost).is_err(), "not a valid name");
    }
}
