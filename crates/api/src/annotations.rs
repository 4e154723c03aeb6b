//! Annotation and label names that users and the operator put on objects, and the readers for them.
//!
//! Annotations are how a user asks for something the spec does not describe (force a rotation, clear a latched
//! failure, release a stuck finalizer); they live here so the reconciler and the docs name them the same way.

use kube::Resource;

/// `crawl.example.com/skip-cleanup: "true"`: on deletion, release the finalizer without deleting the instance.
pub const SKIP_CLEANUP: &str = "crawl.example.com/skip-cleanup";

/// `crawl.example.com/rotate: <token>`: changing the value forces a replacement (a new instance, so a new IP).
pub const ROTATE: &str = "crawl.example.com/rotate";

/// `crawl.example.com/retry: <token>`: changing the value clears a latched permanent failure.
pub const RETRY: &str = "crawl.example.com/retry";

/// The finalizer the operator puts on every `Proxy` so it can delete the instance before the object goes.
pub const FINALIZER: &str = "crawl.example.com/instance-cleanup";

/// The standard label that marks objects the operator owns (`ProviderHealth`, and provider-created objects).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";

/// The value of [`MANAGED_BY_LABEL`] on objects the operator owns.
pub const MANAGED_BY_VALUE: &str = "egress-operator";

/// Reads an annotation, treating an empty value as absent.
pub fn annotation<'a, K: Resource>(object: &'a K, key: &str) -> Option<&'a str> {
    object
        .meta()
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(key))
        .map(String::as_str)
        .filter(|value| !value.is_empty())
}

/// Whether the object asks for its finalizer to be released without cleanup.
///
/// Only the exact value `"true"` counts, so that a typo such as `"yes"` or `"false"` never leaks an instance.
pub fn skip_cleanup<K: Resource>(object: &K) -> bool {
    annotation(object, SKIP_CLEANUP) == Some("true")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Proxy, ProxyMode, ProxySpec};

    fn with_annotation(key: &str, value: &str) -> Proxy {
        let mut proxy = Proxy::new("p", ProxySpec::new(ProxyMode::External));
        proxy.metadata.annotations = Some([(key.to_owned(), value.to_owned())].into());
        proxy
    }

    #[test]
    fn skip_cleanup_needs_exactly_true() {
        let cases = [("true", true), ("True", false), ("yes", false), ("false", false), ("", false)];
        for (value, expected) in cases {
            assert_eq!(skip_cleanup(&with_annotation(SKIP_CLEANUP, value)), expected, "value {value:?}");
        }
        assert!(!skip_cleanup(&Proxy::new("p", ProxySpec::new(ProxyMode::External))));
    }

    #[test]
    fn empty_annotation_reads_as_absent() {
        assert_eq!(annotation(&with_annotation(ROTATE, ""), ROTATE), None);
        assert_eq!(annotation(&with_annotation(ROTATE, "2"), ROTATE), Some("2"));
        assert_eq!(annotation(&with_annotation(ROTATE, "2"), RETRY), None);
    }
}
