//! An error with every cause in its chain, for a message: hyper's, reqwest's and the SDKs' own words often say only
//! which step failed (`client error (SendRequest)`), and the cause says why (`connection closed before message
//! completed`). The one formatter the provider errors, the discovery client and the gateway share.

use std::error::Error;

/// `error`'s text followed by each of its causes, `: `-separated.
pub fn error_chain(error: &(dyn Error + 'static)) -> String {
    let mut text = error.to_string();
    push_causes(&mut text, error.source());
    text
}

/// Appends `cause` and each of its own causes to `text`, `: `-separated, as [`error_chain`] does. A cause whose text
/// `text` already ends with (a wrapper that repeats its source's words) is not written twice.
pub fn push_causes(text: &mut String, mut cause: Option<&(dyn Error + 'static)>) {
    while let Some(error) = cause {
        let part = error.to_string();
        if !text.ends_with(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
        cause = error.source();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Layer {
        #[error("send failed")]
        Outer(#[source] Box<Layer>),
        #[error("connection reset")]
        Repeating(#[source] Box<Layer>),
        #[error("connection reset")]
        Inner,
    }

    #[test]
    fn every_cause_is_listed_once_in_order() {
        let error = Layer::Outer(Box::new(Layer::Repeating(Box::new(Layer::Inner))));
        assert_eq!(error_chain(&error), "send failed: connection reset");
        let mut text = "creating the instance".to_owned();
        push_causes(&mut text, Some(&error));
        assert_eq!(text, "creating the instance: send failed: connection reset");
        assert_eq!(error_chain(&Layer::Inner), "connection reset");
    }
}
