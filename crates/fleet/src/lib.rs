//! The names egress-operator's parts share without Kubernetes types, and the one shape of a proxy's credentials.
//!
//! A Proxy crosses from the controllers (which know it as a Kubernetes object reference) to the lease store, the
//! discovery API, the cooldown journal and metrics (which must not depend on Kubernetes). [`ProxyId`] and
//! [`PoolId`] are how it crosses: a namespace and a name, typed so that a pool's name is never taken for a proxy's.
//! Their one text form, `namespace/name` ([`std::fmt::Display`] and [`std::str::FromStr`]), is for the wire: lease
//! IDs, the journal, logs and metric labels. The controllers convert to and from `ObjectRef` in one place
//! (`egress_reconcile::ids`). [`sources`] counts connections per client address, the admission the discovery API's
//! servers and the gateway share.

pub mod errors;
pub mod labels;
mod outcome;
pub mod sources;

pub use errors::error_chain;
pub use outcome::Outcome;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::SystemTime;

/// A namespaced object's identity: `namespace/name`.
///
/// Kept as its text form with the position of the `/`, shared: cloning it (the lease store does for every lease)
/// copies a pointer, and ordering, equality and hashing are those of the text.
#[derive(Clone)]
pub struct NamespacedName {
    text: Arc<str>,
    slash: usize,
}

// By the text alone: the position of the '/' follows from it.
impl PartialEq for NamespacedName {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for NamespacedName {}

impl PartialOrd for NamespacedName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for NamespacedName {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.text.cmp(&other.text)
    }
}

impl std::hash::Hash for NamespacedName {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.text.hash(state);
    }
}

impl NamespacedName {
    /// The object `name` in `namespace`.
    ///
    /// Kubernetes allows no `/` in either; one in `namespace` would make the text form ambiguous, so it is checked
    /// (in debug builds) rather than trusted.
    pub fn new(namespace: &str, name: &str) -> Self {
        debug_assert!(!namespace.contains('/'), "a namespace has no '/': {namespace:?}");
        Self { text: format!("{namespace}/{name}").into(), slash: namespace.len() }
    }

    /// Its namespace.
    pub fn namespace(&self) -> &str {
        &self.text[..self.slash]
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.text[self.slash + 1..]
    }

    /// `namespace/name`.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for NamespacedName {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.text)
    }
}

impl fmt::Debug for NamespacedName {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.text, formatter)
    }
}

/// Text that is not `namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not namespace/name: {why}")]
pub struct InvalidName {
    /// The text.
    pub text: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl FromStr for NamespacedName {
    type Err = InvalidName;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = |why| InvalidName { text: text.to_owned(), why };
        let Some((namespace, name)) = text.split_once('/') else { return Err(invalid("no '/'")) };
        if namespace.is_empty() {
            return Err(invalid("the namespace is empty"));
        }
        if name.is_empty() {
            return Err(invalid("the name is empty"));
        }
        if name.contains('/') {
            return Err(invalid("more than one '/'"));
        }
        Ok(Self::new(namespace, name))
    }
}

macro_rules! typed_name {
    ($(#[$doc:meta])* $type:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $type(NamespacedName);

        impl $type {
            /// The one named `name` in `namespace`.
            pub fn new(namespace: &str, name: &str) -> Self {
                Self(NamespacedName::new(namespace, name))
            }

            /// Its namespace.
            pub fn namespace(&self) -> &str {
                self.0.namespace()
            }

            /// Its name.
            pub fn name(&self) -> &str {
                self.0.name()
            }

            /// `namespace/name`: its text form.
            pub fn as_str(&self) -> &str {
                self.0.as_str()
            }
        }

        impl fmt::Display for $type {
            fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, formatter)
            }
        }

        impl fmt::Debug for $type {
            fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, formatter)
            }
        }

        impl FromStr for $type {
            type Err = InvalidName;

            fn from_str(text: &str) -> Result<Self, Self::Err> {
                text.parse().map(Self)
            }
        }

        impl From<NamespacedName> for $type {
            fn from(name: NamespacedName) -> Self {
                Self(name)
            }
        }
    };
}

typed_name! {
    /// Which Proxy: its namespace and name.
    ProxyId
}

typed_name! {
    /// Which ProxyPool: its namespace and name.
    PoolId
}

/// A value that must never reach a log: its `Debug` prints a placeholder.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Sensitive<T>(T);

impl<T> Sensitive<T> {
    /// Wraps a secret value.
    pub fn new(value: T) -> Self {
        Self(value)
    }

    /// The secret value itself, for the places that must send it (a backend's API call, a proxy URL, a probe's
    /// `Proxy-Authorization`).
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> fmt::Debug for Sensitive<T> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("<redacted>")
    }
}

/// The basic-auth credentials a proxy requires from its clients: what a Proxy's auth Secret holds, what Squid is
/// configured with, what the health engine probes with and what a lease hands its holder. `Debug` shows the user
/// name only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyCredentials {
    /// The user name (not secret).
    pub username: String,
    /// The password.
    pub password: Sensitive<String>,
}

impl ProxyCredentials {
    /// `username` with `password`.
    pub fn new(username: impl Into<String>, password: impl Into<String>) -> Self {
        Self { username: username.into(), password: Sensitive::new(password.into()) }
    }
}

/// When leases asked for by a pool were last refused, by why: what the discovery API tells the pool autoscaler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolDemand {
    /// Every member was at its lease cap.
    pub at_capacity: Option<SystemTime>,
    /// No member was healthy while the pool had members.
    pub none_healthy: Option<SystemTime>,
    /// The pool had no members.
    pub woken: Option<SystemTime>,
}

/// Whether `value` is a DNS label: 1–63 of `a-z 0-9 -`, starting and ending with a letter or digit (the names of
/// namespaces, and every name and key in the providers file).
pub fn is_dns_label(value: &str) -> bool {
    let bytes = value.as_bytes();
    let edge = |byte: &u8| byte.is_ascii_lowercase() || byte.is_ascii_digit();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.first().is_some_and(edge)
        && bytes.last().is_some_and(edge)
        && bytes.iter().all(|byte| edge(byte) || *byte == b'-')
}

/// `host:port`, with an IPv6 host in brackets: what a client connects to, and the authority of a URL.
pub fn authority(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_is_bracketed_in_an_authority() {
        assert_eq!(authority("10.0.0.1", 3128), "10.0.0.1:3128");
        assert_eq!(authority("squid.crawl", 3128), "squid.crawl:3128");
        assert_eq!(authority("2001:db8::7", 3128), "[2001:db8::7]:3128");
    }

    #[test]
    fn the_text_form_goes_both_ways() {
        let id = ProxyId::new("crawl", "eu-0");
        assert_eq!((id.namespace(), id.name(), id.as_str()), ("crawl", "eu-0", "crawl/eu-0"));
        assert_eq!(id.to_string(), "crawl/eu-0");
        assert_eq!(format!("{id:?}"), "\"crawl/eu-0\"");
        assert_eq!("crawl/eu-0".parse::<ProxyId>(), Ok(id));
        assert_eq!("crawl/eu".parse::<PoolId>().map(|pool| pool.name().to_owned()), Ok("eu".to_owned()));
    }

    #[test]
    fn text_that_is_not_namespace_and_name_is_refused_with_why() {
        for (text, why) in [
            ("eu-0", "no '/'"),
            ("/eu-0", "the namespace is empty"),
            ("crawl/", "the name is empty"),
            ("crawl/eu/0", "more than one '/'"),
            ("", "no '/'"),
        ] {
            let error = text.parse::<ProxyId>().expect_err(text);
            assert_eq!(error.why, why, "{text:?}");
            assert_eq!(error.to_string(), format!("{text:?} is not namespace/name: {why}"));
        }
    }

    #[test]
    fn credentials_never_show_their_password() {
        let credentials = ProxyCredentials::new("crawler", "s3cret");
        let shown = format!("{credentials:?} {:?}", Some(&credentials));
        assert!(!shown.contains("s3cret") && shown.contains("crawler"), "{shown}");
        assert_eq!(credentials.password.expose(), "s3cret");
    }

    #[test]
    fn order_and_equality_are_those_of_the_text() {
        let mut ids = [ProxyId::new("b", "a"), ProxyId::new("a-b", "x"), ProxyId::new("a", "x")];
        ids.sort();
        let texts: Vec<&str> = ids.iter().map(ProxyId::as_str).collect();
        assert_eq!(texts, ["a-b/x", "a/x", "b/a"]);
        assert_eq!(ProxyId::new("a", "b"), ProxyId::new("a", "b"));
        assert_ne!(ProxyId::new("a", "bc"), ProxyId::new("ab", "c"));
    }
}
