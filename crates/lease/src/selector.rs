//! Label selectors, in the equality-based syntax Kubernetes uses: `a=b`, `a==b`, `a!=b`, `a` (exists), `!a`,
//! comma-separated, all of which must hold.

use std::collections::BTreeMap;

/// One requirement.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector(Vec<Requirement>);

/// A selector that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid label selector {selector:?}: {why}")]
pub struct InvalidSelector {
    /// What was given.
    pub selector: String,
    /// What is wrong.
    pub why: String,
}

fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 317
        && key.bytes().all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'/'))
}

fn valid_value(value: &str) -> bool {
    value.len() <= 63 && value.bytes().all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'))
}

impl Selector {
    /// Whether any requirement is about the label `key`.
    pub fn mentions(&self, key: &str) -> bool {
        self.0.iter().any(|requirement| match requirement {
            Requirement::Equals(found, _)
            | Requirement::NotEquals(found, _)
            | Requirement::Exists(found)
            | Requirement::Absent(found) => found == key,
        })
    }

    /// Parses `text`.
    pub fn parse(text: &str) -> Result<Self, InvalidSelector> {
        let fail = |why: String| InvalidSelector { selector: text.to_owned(), why };
        let mut requirements = Vec::new();
        for part in text.split(',').map(str::trim).filter(|part| !part.is_empty()) {
            let requirement = if let Some((key, value)) = part.split_once("!=") {
                Requirement::NotEquals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = part.split_once("==").or_else(|| part.split_once('=')) {
                Requirement::Equals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some(key) = part.strip_prefix('!') {
                Requirement::Absent(key.trim().to_owned())
            } else {
                Requirement::Exists(part.to_owned())
            };
            let (key, value) = match &requirement {
                Requirement::Equals(key, value) | Requirement::NotEquals(key, value) => (key, Some(value)),
                Requirement::Exists(key) | Requirement::Absent(key) => (key, None),
            };
            if !valid_key(key) {
                return Err(fail(format!("{key:?} is not a label key")));
            }
            if let Some(value) = value
                && !valid_value(value)
            {
                return Err(fail(format!("{value:?} is not a label value")));
            }
            requirements.push(requirement);
        }
        Ok(Self(requirements))
    }

    /// Whether `labels` satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|requirement| match requirement {
            Requirement::Equals(key, value) => labels.get(key) == Some(value),
            Requirement::NotEquals(key, value) => labels.get(key) != Some(value),
            Requirement::Exists(key) => labels.contains_key(key),
            Requirement::Absent(key) => !labels.contains_key(key),
        })
    }

    /// Whether this selector has no requirements.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(key, value)| ((*key).to_owned(), (*value).to_owned())).collect()
    }

    #[test]
    fn selectors_match() {
        let eu = labels(&[("region", "eu"), ("tier", "residential")]);
        let cases = [
            ("", true),
            ("region=eu", true),
            ("region==eu", true),
            ("region=us", false),
            ("region!=us", true),
            ("tier", true),
            ("!tier", false),
            ("!owner", true),
            ("region=eu, tier=residential", true),
            ("region=eu,tier=datacenter", false),
        ];
        for (selector, expected) in cases {
            assert_eq!(Selector::parse(selector).expect(selector).matches(&eu), expected, "{selector:?}");
        }
    }

    #[test]
    fn a_selector_says_which_labels_it_is_about() {
        for (selector, mentions) in
            [("a/country=DE", true), ("a/country!=DE", true), ("a/country", true), ("!a/country", true), ("x=1", false)]
        {
            assert_eq!(Selector::parse(selector).expect(selector).mentions("a/country"), mentions, "{selector:?}");
        }
        assert!(!Selector::default().mentions("a/country"));
    }

    #[test]
    fn bad_selectors_are_rejected() {
        for bad in ["=eu", "region=e u", "re gion", "a=b=c", "region=ü"] {
            assert!(Selector::parse(bad).is_err(), "{bad:?}");
        }
    }
}
