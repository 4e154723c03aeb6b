//! Target normalisation: what a cooldown is keyed by.
//!
//! A ban is about a site, not a URL: the target is lower-cased, stripped of scheme, credentials, port, path and a
//! trailing dot, and by default reduced to its registrable domain with the public suffix list, so a ban on
//! `www.shop.example.co.uk` also covers `img.shop.example.co.uk`. Exact-host mode keeps the full host name.
//!
//! A target is a host, an IP address, or an `http`/`https` URL; any other scheme (`javascript:`, `mailto:`,
//! `ftp://`) is refused. It is parsed as a browser parses it (the WHATWG URL standard, through the `url` crate), so
//! the host the cooldown names is the host a browser or crawler would connect to: `http://good.com\@evil.com/` is
//! `good.com`, `01.02.03.04` is `1.2.3.4`, internationalised names become their ASCII (punycode) form. On top of
//! the URL standard a name must be a DNS name (labels of letters, digits, `-` and `_`, none starting or ending with
//! `-`, punycode that decodes), and a public suffix alone (`com`, `co.uk`) is no site.

use std::net::Ipv6Addr;

use url::{Host, Url};

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

/// The longest target accepted, in bytes, before parsing.
const MAX_TARGET_BYTES: usize = 2048;

/// Whether `text` starts with a URL scheme (`javascript:`, `mailto:`, `ftp://`) rather than `host:port`. A
/// scheme with a dot is read as a host (`example.com:-1` is a bad port, not a scheme), unless `//` follows.
fn has_scheme(text: &str) -> bool {
    let Some((scheme, rest)) = text.split_once(':') else { return false };
    let scheme_like = scheme.bytes().next().is_some_and(|first| first.is_ascii_alphabetic())
        && scheme.bytes().all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'+' | b'-' | b'.'))
        && (!scheme.contains('.') || rest.starts_with("//"));
    let port = rest.split(['/', '?', '#']).next().unwrap_or_default();
    scheme_like && (rest.starts_with("//") || port.is_empty() || !port.bytes().all(|byte| byte.is_ascii_digit()))
}

/// Whether `text` is a host name the URL parser gives back as it is: lower-case letters, digits, `-` and `.`, no
/// punycode label, and a last label starting with a letter (so no IPv4 address in any of its forms). Most targets
/// are; they skip the parser, which is most of a lease's cost in this crate.
fn plain_host(text: &str) -> bool {
    let last = text.trim_end_matches('.').rsplit('.').next().unwrap_or_default();
    text.bytes().all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || matches!(byte, b'-' | b'.'))
        && last.bytes().next().is_some_and(|first| first.is_ascii_lowercase())
        && !text.starts_with("xn--")
        && !text.contains(".xn--")
}

/// Normalises a target: a host name, an IP address, or a URL.
pub fn normalize(target: &str, mode: TargetMode) -> Result<String, InvalidTarget> {
    let invalid = |why| InvalidTarget { target: target.to_owned(), why };
    let text = target.trim();
    if text.is_empty() {
        return Err(invalid("it has no host"));
    }
    if text.len() > MAX_TARGET_BYTES {
        return Err(invalid("it is longer than 2048 characters"));
    }
    let parsed;
    let host = if plain_host(text) {
        text.trim_end_matches('.')
    } else {
        parsed = if has_scheme(text) {
            let url = Url::parse(text).map_err(|_| invalid("it is not a valid URL"))?;
            if url.scheme() != "http" && url.scheme() != "https" {
                return Err(invalid("only http and https URLs are targets"));
            }
            url
        } else if let Ok(address) = text.parse::<Ipv6Addr>() {
            // A bare IPv6 address, which a URL would need in brackets.
            return Ok(address.to_string());
        } else {
            Url::parse(&format!("http://{text}")).map_err(|_| invalid("it is not a valid host, host:port or URL"))?
        };
        match parsed.host() {
            Some(Host::Ipv4(address)) => return Ok(address.to_string()),
            Some(Host::Ipv6(address)) => return Ok(address.to_string()),
            Some(Host::Domain(domain)) => domain.trim_end_matches('.'),
            None => return Err(invalid("it has no host")),
        }
    };
    if host.is_empty() {
        return Err(invalid("it has no host"));
    }
    if host.len() > 253 {
        return Err(invalid("it is longer than 253 characters"));
    }
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label.bytes().all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
    };
    if !host.split('.').all(label_ok) {
        return Err(invalid(
            "a host name is dot-separated labels of letters, digits, '-' and '_', none starting or ending with '-'",
        ));
    }
    if host.split('.').any(|label| label.starts_with("xn--")) && idna::domain_to_unicode(host).1.is_err() {
        return Err(invalid("it is not a valid internationalised domain name"));
    }
    if psl::suffix(host.as_bytes()).is_some_and(|suffix| suffix.is_known() && suffix.as_bytes() == host.as_bytes()) {
        return Err(invalid("it is a public suffix (like com or co.uk), not a site"));
    }
    Ok(match mode {
        TargetMode::ExactHost => host.to_owned(),
        TargetMode::RegistrableDomain => psl::domain_str(host).unwrap_or(host).to_owned(),
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
    fn plain_hosts_are_what_the_url_parser_makes_of_them() {
        let plain = ["example.com", "www.shop.example.co.uk", "a-b.example.com.", "localhost", "x1.example.io", "a..b"];
        for host in plain {
            assert!(plain_host(host), "{host}");
            let url = Url::parse(&format!("http://{host}")).expect(host);
            assert_eq!(url.host_str().map(|parsed| parsed.trim_end_matches('.')), Some(host.trim_end_matches('.')));
        }
        let not_plain = [
            "Example.com",
            "1.2.3.4",
            "example.123",
            "0x7f.1",
            "xn--bcher-kva.example",
            "a.xn--p1ai",
            "a.com:80",
            "é.fr",
        ];
        for host in not_plain {
            assert!(!plain_host(host), "{host}");
        }
        // Either way, the same site.
        assert_eq!(
            normalize("WWW.Example.COM", TargetMode::RegistrableDomain),
            normalize("www.example.com", TargetMode::RegistrableDomain)
        );
        assert!(normalize("a..b", TargetMode::RegistrableDomain).is_err());
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
        for bad in ["", "   ", "http://", "exa mple.com", "a..b", &"a".repeat(300)] {
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

    /// Targets as a browser would parse them, and what each names (or why it names nothing).
    #[test]
    fn targets_parse_as_browsers_parse_them() {
        let named = [
            ("example.com", "example.com"),
            ("EXAMPLE.com.", "example.com"),
            ("http://example.com", "example.com"),
            ("https://www.example.com:8443/a?b#c", "example.com"),
            ("//example.com/path", "example.com"),
            ("http://user:pw@example.com/", "example.com"),
            // The URL standard reads `\` as `/` in http URLs: the host is good.com, not evil.com.
            ("http://good.com\\@evil.com/", "good.com"),
            ("http://evil.com@good.com/", "good.com"),
            // IPv4 in the forms browsers accept, as the address they connect to.
            ("01.02.03.04", "1.2.3.4"),
            ("http://0x7f.1/", "127.0.0.1"),
            ("http://2130706433/", "127.0.0.1"),
            ("203.0.113.7:80", "203.0.113.7"),
            ("http://[::ffff:127.0.0.1]/", "::ffff:127.0.0.1"),
            ("[2001:DB8::1]", "2001:db8::1"),
            ("2001:db8::1", "2001:db8::1"),
            ("bücher.example.de", "example.de"),
            ("xn--bcher-kva.example.de", "example.de"),
            ("http://EXAMPLE.co.uk:443", "example.co.uk"),
            ("a_b.example.com", "example.com"),
            ("localhost:8080", "localhost"),
            // As in a browser's address bar: the empty authority is skipped, `path` is the host.
            ("http:///path", "path"),
        ];
        for (input, expected) in named {
            assert_eq!(normalize(input, TargetMode::RegistrableDomain).as_deref(), Ok(expected), "{input}");
        }
        let refused = [
            ("", "no host"),
            ("http://example.com:99999/", "not a valid URL"),
            ("example.com:-1", "not a valid host"),
            ("example.com:99999", "not a valid host"),
            ("-a.com", "starting or ending with '-'"),
            ("a-.com", "starting or ending with '-'"),
            // Punycode that does not decode: the URL parser refuses it already.
            ("xn--zz", "not a valid host"),
            ("xn--zz.example.com", "not a valid host"),
            ("com", "public suffix"),
            ("co.uk", "public suffix"),
            ("https://co.uk/", "public suffix"),
            ("github.io", "public suffix"),
            ("a..b.com", "labels"),
            ("exa mple.com", "not a valid host"),
            ("http://", "not a valid URL"),
            ("javascript:alert(1)", "only http and https"),
            ("ftp://example.com/", "only http and https"),
            ("http://[::1/", "not a valid URL"),
            ("http://a%00b.com/", "not a valid URL"),
        ];
        for (input, why) in refused {
            let error = normalize(input, TargetMode::RegistrableDomain).expect_err(input);
            assert!(error.why.contains(why), "{input:?}: {}", error.why);
        }
        assert!(named.len() + refused.len() >= 30);
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
