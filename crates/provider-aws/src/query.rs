//! The AWS Query protocol: a form-encoded POST (`Action=…&Version=…&Param.1=…`), signed with SigV4 when
//! credentials are given, answered with an XML document, or with `<Response><Errors><Error><Code>` and an HTTP
//! status on failure.

use std::fmt;
use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use egress_provider::ProviderError;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

use crate::classify;

/// Everything but the unreserved characters of RFC 3986, which SigV4's canonical form leaves alone.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');

/// How long one call may take, connecting included.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The parameters of one call, in order.
#[derive(Clone, Default)]
pub struct Form {
    pairs: Vec<(String, String)>,
}

impl fmt::Debug for Form {
    /// The parameter names only: values may hold user data or a token.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.pairs.iter().map(|(name, _)| name)).finish()
    }
}

impl Form {
    /// A call of `action` at API `version`.
    pub fn new(action: &str, version: &str) -> Self {
        let mut form = Self::default();
        form.push("Action", action).push("Version", version);
        form
    }

    /// Adds one parameter.
    pub fn push(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.pairs.push((name.into(), value.into()));
        self
    }

    /// Adds `Filter.<n>.Name` with its values, numbering filters from 1 in the order they are added.
    pub fn filter(&mut self, name: &str, values: &[&str]) -> &mut Self {
        let index =
            self.pairs.iter().filter(|(key, _)| key.starts_with("Filter.") && key.ends_with(".Name")).count() + 1;
        self.push(format!("Filter.{index}.Name"), name);
        for (position, value) in values.iter().enumerate() {
            self.push(format!("Filter.{index}.Value.{}", position + 1), *value);
        }
        self
    }

    /// The value of parameter `name`, when set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str())
    }

    /// The `application/x-www-form-urlencoded` body, encoded as botocore encodes it (Python's `urlencode`: a space
    /// is `+`, every other byte but letters, digits and `-_.~` is `%XX`); the signature covers these exact bytes.
    pub fn encode(&self) -> String {
        let mut body = String::new();
        for (name, value) in &self.pairs {
            if !body.is_empty() {
                body.push('&');
            }
            push_encoded(&mut body, name);
            body.push('=');
            push_encoded(&mut body, value);
        }
        body
    }
}

fn push_encoded(body: &mut String, text: &str) {
    for (index, part) in text.split(' ').enumerate() {
        if index > 0 {
            body.push('+');
        }
        body.extend(utf8_percent_encode(part, QUERY_VALUE));
    }
}

/// A call that failed: AWS's answer, or none.
#[derive(Debug)]
pub struct CallError {
    /// The credentials could not be had (a file, STS): their error, already classified.
    pub credentials: Option<ProviderError>,
    /// The HTTP status, when AWS answered.
    pub status: Option<u16>,
    /// The error code (`InvalidInstanceID.NotFound`, `RequestLimitExceeded`), when the answer named one.
    pub code: Option<String>,
    /// AWS's message, or what went wrong on the way.
    pub message: String,
    /// The transport error, when there was no answer.
    pub source: Option<reqwest::Error>,
}

impl CallError {
    /// The provider contract's error for `operation` on `target`, classified by [`classify::class_of`].
    pub fn into_provider_error(self, operation: &str, target: &str) -> ProviderError {
        if let Some(error) = self.credentials {
            return error;
        }
        let class = classify::class_of(self.status, self.code.as_deref());
        let status = self.status.map_or_else(|| "no answer".to_owned(), |status| format!("HTTP {status}"));
        let code = self.code.as_deref().map(|code| format!(" {code}")).unwrap_or_default();
        let error = ProviderError::new(class, format!("{operation} {target}: {status}{code}: {}", self.message));
        match self.source {
            Some(source) => error.with_source(source),
            None => error,
        }
    }

    /// Whether the same call may succeed if sent again soon: throttling, a server error, or no answer.
    pub fn is_retryable(&self) -> bool {
        self.credentials.is_none() && classify::is_retryable(self.status, self.code.as_deref())
    }

    /// The failure to get credentials to sign with.
    pub fn credentials(error: ProviderError) -> Self {
        Self { credentials: Some(error), status: None, code: None, message: String::new(), source: None }
    }

    fn local(message: String) -> Self {
        Self { credentials: None, status: None, code: None, message, source: None }
    }
}

/// Reads `<Errors><Error><Code>…</Code><Message>…</Message>` (EC2) or `<Error><Code>…` (STS) from an answer.
pub fn error_of(status: u16, body: &str) -> CallError {
    let parsed = roxmltree::Document::parse(body).ok();
    let field = |name: &str| {
        parsed.as_ref().and_then(|document| {
            document
                .descendants()
                .find(|node| node.has_tag_name(name) && node.ancestors().any(|above| above.has_tag_name("Error")))
                .and_then(|node| node.text())
                .map(str::to_owned)
        })
    };
    let code = field("Code");
    let message = field("Message").unwrap_or_else(|| {
        if code.is_some() { String::new() } else { format!("an answer without an error code ({} bytes)", body.len()) }
    });
    CallError { credentials: None, status: Some(status), code, message, source: None }
}

/// Sends one call; `signing` is the credentials, region and service to sign with, or none for an unsigned call.
///
/// # Errors
/// AWS's error answer, or a transport failure.
pub async fn post(
    http: &reqwest::Client,
    endpoint: &str,
    body: String,
    signing: Option<(&Credentials, &str)>,
    service: &str,
) -> Result<String, CallError> {
    let url = if endpoint.ends_with('/') { endpoint.to_owned() } else { format!("{endpoint}/") };
    let content_type = "application/x-www-form-urlencoded; charset=utf-8";
    let mut request = http.post(&url).header(http::header::CONTENT_TYPE, content_type);
    if let Some((credentials, region)) = signing {
        for (name, value) in signature_headers(credentials, region, service, &url, content_type, &body)? {
            request = request.header(name, value);
        }
    }
    let transport = |error: reqwest::Error| CallError {
        credentials: None,
        status: None,
        code: None,
        message: if error.is_timeout() { "timed out".to_owned() } else { "no answer".to_owned() },
        source: Some(error),
    };
    let answer = request.body(body).timeout(CALL_TIMEOUT).send().await.map_err(transport)?;
    let status = answer.status().as_u16();
    let text = answer.text().await.map_err(transport)?;
    if (200..300).contains(&status) { Ok(text) } else { Err(error_of(status, &text)) }
}

/// The SigV4 headers (`authorization`, `x-amz-date`, `x-amz-security-token`) for a POST of `body` to `url`.
fn signature_headers(
    credentials: &Credentials,
    region: &str,
    service: &str,
    url: &str,
    content_type: &str,
    body: &str,
) -> Result<Vec<(&'static str, String)>, CallError> {
    let failed = CallError::local;
    let identity = credentials.clone().into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(service)
        .time(SystemTime::now())
        .settings(SigningSettings::default())
        .build()
        .map_err(|error| failed(format!("signing parameters: {error}")))?
        .into();
    let request = SignableRequest::new(
        "POST",
        url,
        [("content-type", content_type)].into_iter(),
        SignableBody::Bytes(body.as_bytes()),
    )
    .map_err(|error| failed(format!("signing {url}: {error}")))?;
    let (instructions, _signature) =
        sign(request, &params).map_err(|error| failed(format!("signing {url}: {error}")))?.into_parts();
    let (headers, _params) = instructions.into_parts();
    Ok(headers.into_iter().map(|header| (header.name(), header.value().to_owned())).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_encode_in_order_with_numbered_filters() {
        let mut form = Form::new("DescribeInstances", "2016-11-15");
        form.filter("tag:egress-cluster", &["c 1"]).filter("instance-state-name", &["pending", "running"]);
        assert_eq!(
            form.encode(),
            "Action=DescribeInstances&Version=2016-11-15&Filter.1.Name=tag%3Aegress-cluster&Filter.1.Value.1=c+1&\
             Filter.2.Name=instance-state-name&Filter.2.Value.1=pending&Filter.2.Value.2=running"
        );
        assert_eq!(form.get("Filter.2.Value.2"), Some("running"));
        let mut secret = Form::new("RunInstances", "2016-11-15");
        secret.push("UserData", "c2VjcmV0");
        assert!(!format!("{secret:?}").contains("c2VjcmV0"), "values never reach Debug");
    }

    #[test]
    fn error_answers_name_their_code_and_message() {
        let ec2 = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>InvalidInstanceID.NotFound</Code><Message>The instance ID 'i-1' does not exist</Message></Error></Errors><RequestID>r</RequestID></Response>"#;
        let error = error_of(400, ec2);
        assert_eq!(error.code.as_deref(), Some("InvalidInstanceID.NotFound"));
        assert_eq!(error.message, "The instance ID 'i-1' does not exist");
        let sts = r#"<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>Sender</Type><Code>InvalidIdentityToken</Code><Message>bad token</Message></Error></ErrorResponse>"#;
        assert_eq!(error_of(400, sts).code.as_deref(), Some("InvalidIdentityToken"));
        let html = error_of(502, "<html>bad gateway</html>");
        assert_eq!((html.code, html.status), (None, Some(502)));
        assert!(html.message.contains("without an error code"), "{}", html.message);
    }

    #[test]
    fn a_signed_call_carries_a_sigv4_authorization_for_the_service_and_region() {
        let credentials = Credentials::new("AKIDEXAMPLE", "secret", Some("token".into()), None, "test");
        let headers = signature_headers(
            &credentials,
            "eu-west-1",
            "ec2",
            "https://ec2.eu-west-1.amazonaws.com/",
            "application/x-www-form-urlencoded; charset=utf-8",
            "Action=DescribeRegions&Version=2016-11-15",
        )
        .unwrap();
        let get = |name: &str| headers.iter().find(|(key, _)| *key == name).map(|(_, value)| value.as_str());
        let authorization = get("authorization").expect("authorization");
        assert!(authorization.starts_with("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/"), "{authorization}");
        assert!(authorization.contains("/eu-west-1/ec2/aws4_request"), "{authorization}");
        assert!(authorization.contains("content-type"), "the content type is signed: {authorization}");
        assert!(!authorization.contains("secret"));
        assert_eq!(get("x-amz-security-token"), Some("token"));
        assert!(get("x-amz-date").is_some());
    }
}
