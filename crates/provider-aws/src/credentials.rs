//! The standard credential chain, the part of it an operator in Kubernetes uses, in the SDKs' order:
//!
//! 1. the environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and optionally `AWS_SESSION_TOKEN` (a Secret
//!    mounted as environment variables);
//! 2. web identity: `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN` (and optionally `AWS_ROLE_SESSION_NAME`), as
//!    EKS's IAM roles for service accounts (IRSA) set them: the token file is read afresh and exchanged at STS's
//!    unsigned `AssumeRoleWithWebIdentity` for temporary keys, renewed 5 minutes before they expire;
//! 3. the shared files: the profile (`profile` in the block, `AWS_PROFILE`, or `default`) from
//!    `AWS_SHARED_CREDENTIALS_FILE` (`~/.aws/credentials`), then from `AWS_CONFIG_FILE` (`~/.aws/config`, where the
//!    section is `[profile <name>]` except for `default`), re-read at most once a minute so a rotated Secret is
//!    picked up.
//!
//! Not supported: instance metadata (IMDS: the operator runs in pods, where IRSA is the way), SSO, and
//! `credential_process`. No key, token or secret is ever logged or put into an error message.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use egress_provider::ProviderError;
use tracing::debug;

use crate::query::{self, Form};

/// Where the provider's keys come from, found once when it is built.
pub struct CredentialChain {
    source: Source,
    cached: Mutex<Option<(Credentials, SystemTime)>>,
    http: reqwest::Client,
}

impl std::fmt::Debug for CredentialChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialChain").field("source", &self.describe()).finish_non_exhaustive()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Source {
    /// Keys the environment held when the provider was built (a process's environment does not change).
    Environment(Credentials),
    WebIdentity {
        token_file: PathBuf,
        role_arn: String,
        session_name: String,
        sts_endpoint: String,
    },
    SharedFiles {
        credentials: PathBuf,
        config: PathBuf,
        profile: String,
    },
}

/// Renewed this long before temporary credentials expire.
const RENEW_BEFORE: Duration = Duration::from_secs(300);
/// Shared files are read again after this long.
const FILE_REREAD: Duration = Duration::from_secs(60);
/// The session name STS records for the operator when `AWS_ROLE_SESSION_NAME` is unset.
const DEFAULT_SESSION_NAME: &str = "egress-operator";
/// Where credentials came from, as the signer's provider name.
const PROVIDER_NAME: &str = "egress-operator";

/// The environment the chain reads, as a function so tests need not change the process's.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

impl CredentialChain {
    /// Finds the source from the environment and the shared files.
    ///
    /// # Errors
    /// Half a key pair in the environment, or no source at all (Permanent: neither fixes itself).
    pub fn discover(
        env: Env<'_>,
        profile: Option<&str>,
        sts_endpoint: String,
        http: reqwest::Client,
    ) -> Result<Self, ProviderError> {
        let source = find_source(env, profile, sts_endpoint)?;
        debug!(source = source.describe(), "AWS credentials");
        Ok(Self { source, cached: Mutex::new(None), http })
    }

    /// The chain of the process's environment.
    ///
    /// # Errors
    /// As [`Self::discover`].
    pub fn from_process(
        profile: Option<&str>,
        sts_endpoint: String,
        http: reqwest::Client,
    ) -> Result<Self, ProviderError> {
        Self::discover(&|name| std::env::var(name).ok().filter(|value| !value.is_empty()), profile, sts_endpoint, http)
    }

    /// Which source the chain uses, for logs and the docs (never a key).
    pub fn describe(&self) -> &'static str {
        self.source.describe()
    }

    /// Keys to sign with now.
    ///
    /// # Errors
    /// A token file or shared file that cannot be read or holds no keys (Permanent), or STS refusing or not
    /// answering (classified as any AWS answer).
    pub async fn current(&self) -> Result<Credentials, ProviderError> {
        let now = SystemTime::now();
        if let Some((credentials, valid_until)) = self.cached.lock().expect("credentials lock").as_ref()
            && now < *valid_until
        {
            return Ok(credentials.clone());
        }
        let (credentials, valid_until) = match &self.source {
            Source::Environment(credentials) => (credentials.clone(), now + Duration::from_secs(365 * 86_400)),
            Source::SharedFiles { credentials, config, profile } => {
                (from_shared_files(credentials, config, profile).await?, now + FILE_REREAD)
            }
            Source::WebIdentity { token_file, role_arn, session_name, sts_endpoint } => {
                let credentials =
                    assume_role_with_web_identity(&self.http, sts_endpoint, token_file, role_arn, session_name).await?;
                let renew_at = credentials
                    .expiry()
                    .map_or(now + FILE_REREAD, |expiry| expiry.checked_sub(RENEW_BEFORE).unwrap_or(now));
                (credentials, renew_at)
            }
        };
        *self.cached.lock().expect("credentials lock") = Some((credentials.clone(), valid_until));
        Ok(credentials)
    }
}

impl Source {
    fn describe(&self) -> &'static str {
        match self {
            Self::Environment(_) => "environment (AWS_ACCESS_KEY_ID)",
            Self::WebIdentity { .. } => "web identity (AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN)",
            Self::SharedFiles { .. } => "shared credentials and config files",
        }
    }
}

fn find_source(env: Env<'_>, profile: Option<&str>, sts_endpoint: String) -> Result<Source, ProviderError> {
    match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
        (Some(key), Some(secret)) => {
            let token = env("AWS_SESSION_TOKEN");
            return Ok(Source::Environment(Credentials::new(key, secret, token, None, PROVIDER_NAME)));
        }
        (Some(_), None) => {
            return Err(ProviderError::permanent("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"));
        }
        (None, Some(_)) => {
            return Err(ProviderError::permanent("AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not"));
        }
        (None, None) => {}
    }
    match (env("AWS_WEB_IDENTITY_TOKEN_FILE"), env("AWS_ROLE_ARN")) {
        (Some(token_file), Some(role_arn)) => {
            return Ok(Source::WebIdentity {
                token_file: token_file.into(),
                role_arn,
                session_name: env("AWS_ROLE_SESSION_NAME").unwrap_or_else(|| DEFAULT_SESSION_NAME.to_owned()),
                sts_endpoint,
            });
        }
        (Some(_), None) => {
            return Err(ProviderError::permanent("AWS_WEB_IDENTITY_TOKEN_FILE is set but AWS_ROLE_ARN is not"));
        }
        (None, Some(_)) => {
            return Err(ProviderError::permanent("AWS_ROLE_ARN is set but AWS_WEB_IDENTITY_TOKEN_FILE is not"));
        }
        (None, None) => {}
    }
    let home = env("HOME").map(PathBuf::from);
    let file = |variable: &str, default: &str| {
        env(variable).map(PathBuf::from).or_else(|| home.as_ref().map(|home| home.join(".aws").join(default)))
    };
    let credentials = file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
    let config = file("AWS_CONFIG_FILE", "config");
    let profile = profile.map(str::to_owned).or_else(|| env("AWS_PROFILE")).unwrap_or_else(|| "default".to_owned());
    match (credentials, config) {
        (Some(credentials), Some(config)) if credentials.is_file() || config.is_file() => {
            Ok(Source::SharedFiles { credentials, config, profile })
        }
        _ => Err(ProviderError::permanent(
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (from a Secret), use IAM roles for \
             service accounts (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN), or mount a shared credentials file \
             (AWS_SHARED_CREDENTIALS_FILE)",
        )),
    }
}

/// The sections of an INI file (`[name]`, `key = value`, `#` and `;` comments), keys lowercased.
pub fn parse_ini(text: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut sections: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')) {
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            sections.entry(name.clone()).or_default();
            current = Some(name);
        } else if let (Some(section), Some((key, value))) = (&current, line.split_once('=')) {
            sections
                .entry(section.clone())
                .or_default()
                .insert(key.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    sections
}

/// The keys of `profile` in one file's sections, when it has them.
fn keys_in(
    sections: &BTreeMap<String, BTreeMap<String, String>>,
    section: &str,
    path: &std::path::Path,
) -> Result<Option<Credentials>, ProviderError> {
    let Some(entries) = sections.get(section) else { return Ok(None) };
    match (entries.get("aws_access_key_id"), entries.get("aws_secret_access_key")) {
        (Some(key), Some(secret)) => Ok(Some(Credentials::new(
            key.clone(),
            secret.clone(),
            entries.get("aws_session_token").cloned(),
            None,
            PROVIDER_NAME,
        ))),
        (None, None) => Ok(None),
        _ => Err(ProviderError::permanent(format!(
            "[{section}] in {} has only one of aws_access_key_id and aws_secret_access_key",
            path.display()
        ))),
    }
}

async fn read_optional(path: &std::path::Path) -> Result<Option<String>, ProviderError> {
    match tokio::fs::read_to_string(path).await {
        Ok(text) => Ok(Some(text)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(ProviderError::permanent(format!("reading {}", path.display())).with_source(error)),
    }
}

async fn from_shared_files(
    credentials: &std::path::Path,
    config: &std::path::Path,
    profile: &str,
) -> Result<Credentials, ProviderError> {
    if let Some(text) = read_optional(credentials).await?
        && let Some(keys) = keys_in(&parse_ini(&text), profile, credentials)?
    {
        return Ok(keys);
    }
    let section = if profile == "default" { "default".to_owned() } else { format!("profile {profile}") };
    if let Some(text) = read_optional(config).await?
        && let Some(keys) = keys_in(&parse_ini(&text), &section, config)?
    {
        return Ok(keys);
    }
    Err(ProviderError::permanent(format!(
        "the profile {profile:?} has no aws_access_key_id and aws_secret_access_key in {} or {} (SSO, \
         credential_process and role chaining are not supported)",
        credentials.display(),
        config.display()
    )))
}

async fn assume_role_with_web_identity(
    http: &reqwest::Client,
    endpoint: &str,
    token_file: &std::path::Path,
    role_arn: &str,
    session_name: &str,
) -> Result<Credentials, ProviderError> {
    let token = tokio::fs::read_to_string(token_file).await.map_err(|error| {
        ProviderError::permanent(format!("reading the web identity token {}", token_file.display())).with_source(error)
    })?;
    let mut form = Form::new("AssumeRoleWithWebIdentity", "2011-06-15");
    form.push("RoleArn", role_arn).push("RoleSessionName", session_name).push("WebIdentityToken", token.trim());
    // Unsigned: the token is the proof.
    let document = query::post(http, endpoint, form.encode(), None, "sts")
        .await
        .map_err(|error| error.into_provider_error("AssumeRoleWithWebIdentity", role_arn))?;
    let root = roxmltree::Document::parse(&document)
        .map_err(|error| ProviderError::transient("STS answered with XML that does not parse").with_source(error))?;
    let field = |name: &str| {
        root.descendants().find(|node| node.has_tag_name(name)).and_then(|node| node.text()).map(str::to_owned)
    };
    let (Some(key), Some(secret), Some(session)) =
        (field("AccessKeyId"), field("SecretAccessKey"), field("SessionToken"))
    else {
        return Err(ProviderError::transient("STS's AssumeRoleWithWebIdentity answer holds no credentials"));
    };
    let expiry = field("Expiration").and_then(|text| text.parse::<jiff::Timestamp>().ok()).map(SystemTime::from);
    debug!(role_arn, expires = ?expiry, "assumed the role with the web identity token");
    Ok(Credentials::new(key, secret, Some(session), expiry, PROVIDER_NAME))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| pairs.iter().find(|(key, _)| *key == name).map(|(_, value)| (*value).to_owned())
    }

    #[test]
    fn the_chain_prefers_the_environment_then_web_identity_then_files() {
        let both = env_of(&[
            ("AWS_ACCESS_KEY_ID", "AKIA"),
            ("AWS_SECRET_ACCESS_KEY", "s"),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", "/t"),
            ("AWS_ROLE_ARN", "arn"),
        ]);
        assert_eq!(
            find_source(&both, None, "http://sts".into()).unwrap(),
            Source::Environment(Credentials::new("AKIA", "s", None, None, PROVIDER_NAME))
        );
        let irsa = env_of(&[("AWS_WEB_IDENTITY_TOKEN_FILE", "/t"), ("AWS_ROLE_ARN", "arn"), ("HOME", "/nowhere")]);
        assert_eq!(
            find_source(&irsa, None, "http://sts".into()).unwrap(),
            Source::WebIdentity {
                token_file: "/t".into(),
                role_arn: "arn".into(),
                session_name: "egress-operator".into(),
                sts_endpoint: "http://sts".into()
            }
        );
    }

    #[test]
    fn half_a_source_or_none_is_a_permanent_error_naming_what_is_missing() {
        let cases: [(&'static [(&'static str, &'static str)], &str); 4] = [
            (&[("AWS_ACCESS_KEY_ID", "AKIA")], "AWS_SECRET_ACCESS_KEY is not"),
            (&[("AWS_SECRET_ACCESS_KEY", "s")], "AWS_ACCESS_KEY_ID is not"),
            (&[("AWS_ROLE_ARN", "arn")], "AWS_WEB_IDENTITY_TOKEN_FILE is not"),
            (&[("HOME", "/nowhere")], "no AWS credentials"),
        ];
        for (pairs, expected) in cases {
            let error = find_source(&env_of(pairs), None, "http://sts".into()).unwrap_err();
            assert_eq!(error.class(), egress_provider::ErrorClass::Permanent);
            assert!(error.to_string().contains(expected), "{error}");
        }
    }

    #[test]
    fn ini_sections_and_keys() {
        let text = "# comment\n[default]\naws_access_key_id = AKIA1\nAWS_Secret_Access_Key=s1\n\n[profile  crawl]\n\
                    ; another\naws_access_key_id=AKIA2\n";
        let sections = parse_ini(text);
        assert_eq!(sections["default"]["aws_secret_access_key"], "s1");
        assert_eq!(sections["profile crawl"]["aws_access_key_id"], "AKIA2");
        let half = keys_in(&sections, "profile crawl", std::path::Path::new("/config")).unwrap_err();
        assert!(half.to_string().contains("only one of"), "{half}");
        assert!(keys_in(&sections, "other", std::path::Path::new("/config")).unwrap().is_none());
    }

    #[tokio::test]
    async fn a_profile_is_read_from_the_credentials_file_then_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let credentials = dir.path().join("credentials");
        let config = dir.path().join("config");
        std::fs::write(&credentials, "[default]\naws_access_key_id=AKIADEFAULT\naws_secret_access_key=d\n").unwrap();
        std::fs::write(
            &config,
            "[profile crawl]\naws_access_key_id=AKIACRAWL\naws_secret_access_key=c\naws_session_token=t\n",
        )
        .unwrap();
        let default = from_shared_files(&credentials, &config, "default").await.unwrap();
        assert_eq!(default.access_key_id(), "AKIADEFAULT");
        let crawl = from_shared_files(&credentials, &config, "crawl").await.unwrap();
        assert_eq!((crawl.access_key_id(), crawl.session_token()), ("AKIACRAWL", Some("t")));
        let missing = from_shared_files(&credentials, &config, "other").await.unwrap_err();
        assert!(missing.to_string().contains("\"other\" has no aws_access_key_id"), "{missing}");
        assert!(!missing.to_string().contains("AKIA"), "no key in a message: {missing}");
    }
}
