//! Bearer-token authentication with scopes and tenants, from a file that is re-read when it changes.
//!
//! The file has one token per line: `<scope> <token> [tenant=<name>] [maxLeases=<n>] [maxLeaseSeconds=<n>]
//! [reportsPerMinute=<n>]`, where scope is `read` (list proxies and cooldowns), `lease` (leases too, and proxy
//! credentials in URLs) or `admin` (everything `lease` may, and clearing cooldowns); blank lines and `#` comments are
//! ignored. Every token belongs to a tenant: the one it names, or else a tenant of its own (`token-` and the first 8
//! hex digits of its SHA-256). Leases, sessions and the cooldowns a tenant's reports made are its own, and any of its
//! tokens may use them. The quotas are the tenant's, from the first line that sets each (lines of one tenant may not
//! disagree). Tokens are compared in constant time against every entry, so timing does not reveal how much of a
//! guess was right.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use tracing::{info, warn};

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// List proxies and cooldowns.
    Read,
    /// Everything `read` may, plus leases, and proxy credentials in URLs.
    Lease,
    /// Everything `lease` may, plus clearing cooldowns.
    Admin,
}

impl Scope {
    /// The word for it in the token file and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Lease => "lease",
            Self::Admin => "admin",
        }
    }
}

/// What a tenant may hold at once and do per minute; `None` is no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    /// Leases held at once.
    pub max_leases: Option<u32>,
    /// The longest TTL a lease may ask for (and its default when shorter than the server's).
    pub max_lease_seconds: Option<u64>,
    /// Reports per minute.
    pub reports_per_minute: Option<u32>,
}

/// Who a valid token speaks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// What it may do.
    pub scope: Scope,
    /// Its tenant: leases, sessions and the cooldowns it caused are the tenant's.
    pub tenant: Arc<str>,
    /// The tenant's quota.
    pub quota: Quota,
}

impl Identity {
    /// Everything, for everyone (`--discovery-auth=none`): one tenant, `anonymous`, without quotas.
    pub fn anonymous() -> Self {
        Self { scope: Scope::Admin, tenant: Arc::from("anonymous"), quota: Quota::default() }
    }
}

/// How requests are authenticated.
#[derive(Debug)]
pub enum Auth {
    /// Every request may do everything (`--discovery-auth=none`).
    Disabled,
    /// Tokens from a file.
    Tokens(TokenFile),
}

/// A problem in the token file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}:{line}: {why}")]
pub struct TokenFileError {
    /// The file.
    pub path: String,
    /// The 1-based line.
    pub line: usize,
    /// What is wrong.
    pub why: String,
}

/// One line of a token file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenEntry {
    /// The token.
    pub token: String,
    /// Who it speaks for.
    pub identity: Identity,
}

/// The tenant of a token that names none: `token-` and the first 8 hex digits of its SHA-256, stable across edits of
/// the file and revealing nothing usable of the token.
fn own_tenant(token: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let hex: String = digest.as_ref()[..4].iter().map(|byte| format!("{byte:02x}")).collect();
    format!("token-{hex}")
}

/// Whether `name` may name a tenant: 1 to 63 lower-case letters, digits and `-`, starting and ending with a letter
/// or digit (a DNS label, so it is safe as a metric label and in logs).
fn valid_tenant(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name.bytes().all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Parses a token file's content.
pub fn parse_tokens(text: &str, path: &str) -> Result<Vec<TokenEntry>, TokenFileError> {
    let mut entries: Vec<TokenEntry> = Vec::new();
    let mut quotas: BTreeMap<String, (Quota, usize)> = BTreeMap::new();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fail = |why: String| TokenFileError { path: path.to_owned(), line: index + 1, why };
        let mut parts = line.split_whitespace();
        let scope = match parts.next() {
            Some("read") => Scope::Read,
            Some("lease") => Scope::Lease,
            Some("admin") => Scope::Admin,
            _ => return Err(fail("a line must be `read <token>`, `lease <token>` or `admin <token>`".into())),
        };
        let token = parts.next().ok_or_else(|| fail("the token is missing".into()))?;
        if token.len() < 16 {
            return Err(fail("a token must be at least 16 characters".into()));
        }
        if token.contains('=') {
            return Err(fail("a token must not contain '=' (options come after it, as key=value)".into()));
        }
        let mut tenant = None;
        let mut quota = Quota::default();
        for option in parts {
            let Some((key, value)) = option.split_once('=') else {
                return Err(fail(format!(
                    "{option:?} is not an option: after the token come key=value options (tenant, maxLeases, \
                     maxLeaseSeconds, reportsPerMinute); a token must not contain spaces"
                )));
            };
            let number = |max: u64| {
                value
                    .parse::<u64>()
                    .ok()
                    .filter(|number| (1..=max).contains(number))
                    .ok_or_else(|| fail(format!("{key} must be a whole number from 1 to {max}, not {value:?}")))
            };
            match key {
                "tenant" if valid_tenant(value) => tenant = Some(value.to_owned()),
                "tenant" => {
                    return Err(fail(format!(
                        "tenant {value:?} must be 1 to 63 lower-case letters, digits and '-', not starting or \
                         ending with '-'"
                    )));
                }
                "maxLeases" => quota.max_leases = Some(u32::try_from(number(1_000_000)?).unwrap_or(u32::MAX)),
                "maxLeaseSeconds" => quota.max_lease_seconds = Some(number(3600)?),
                "reportsPerMinute" => {
                    quota.reports_per_minute = Some(u32::try_from(number(1_000_000)?).unwrap_or(u32::MAX));
                }
                _ => {
                    return Err(fail(format!(
                        "unknown option {key:?} (known: tenant, maxLeases, maxLeaseSeconds, reportsPerMinute)"
                    )));
                }
            }
        }
        let tenant = tenant.unwrap_or_else(|| own_tenant(token));
        // Every line of a tenant gets the tenant's quota: each limit from the line that set it.
        match quotas.get_mut(&tenant) {
            None => {
                quotas.insert(tenant.clone(), (quota, index + 1));
            }
            Some((known, first)) => {
                let merge = |mine: &mut Option<u64>, theirs: Option<u64>, name: &str| match (*mine, theirs) {
                    (Some(a), Some(b)) if a != b => Err(fail(format!(
                        "{name} for tenant {tenant:?} is {b} here but {a} on line {first}: give it once"
                    ))),
                    (None, Some(b)) => {
                        *mine = Some(b);
                        Ok(())
                    }
                    _ => Ok(()),
                };
                let mut leases = known.max_leases.map(u64::from);
                merge(&mut leases, quota.max_leases.map(u64::from), "maxLeases")?;
                let mut seconds = known.max_lease_seconds;
                merge(&mut seconds, quota.max_lease_seconds, "maxLeaseSeconds")?;
                let mut reports = known.reports_per_minute.map(u64::from);
                merge(&mut reports, quota.reports_per_minute.map(u64::from), "reportsPerMinute")?;
                *known = Quota {
                    max_leases: leases.and_then(|n| u32::try_from(n).ok()),
                    max_lease_seconds: seconds,
                    reports_per_minute: reports.and_then(|n| u32::try_from(n).ok()),
                };
            }
        }
        entries.push(TokenEntry {
            token: token.to_owned(),
            identity: Identity { scope, tenant: Arc::from(tenant), quota },
        });
    }
    for entry in &mut entries {
        if let Some((quota, _)) = quotas.get(&*entry.identity.tenant) {
            entry.identity.quota = *quota;
        }
    }
    Ok(entries)
}

/// Constant-time comparison of two byte strings whose time says nothing of their lengths either: their SHA-256
/// digests (always 32 bytes) are compared with `subtle`.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq as _;
    let a = ring::digest::digest(&ring::digest::SHA256, a);
    let b = ring::digest::digest(&ring::digest::SHA256, b);
    a.as_ref().ct_eq(b.as_ref()).into()
}

struct Loaded {
    tokens: Vec<TokenEntry>,
    modified: Option<SystemTime>,
    checked: Instant,
}

/// Tokens from a file, reloaded when its modification time changes (checked at most once a second).
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    loaded: RwLock<LoadedDebug>,
}

/// `Loaded` without the tokens in its `Debug` output.
struct LoadedDebug(Loaded);

impl std::fmt::Debug for LoadedDebug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} tokens", self.0.tokens.len())
    }
}

impl TokenFile {
    /// Reads the file now; an unreadable or invalid file is an error at start.
    pub fn load(path: impl Into<PathBuf>) -> Result<Self, TokenFileError> {
        let path = path.into();
        let (tokens, modified) = read(&path)?;
        info!(path = %path.display(), tokens = tokens.len(), "discovery tokens loaded");
        Ok(Self { path, loaded: RwLock::new(LoadedDebug(Loaded { tokens, modified, checked: Instant::now() })) })
    }

    fn refresh(&self) {
        {
            let loaded = self.loaded.read().expect("token lock");
            if loaded.0.checked.elapsed() < Duration::from_secs(1) {
                return;
            }
        }
        let modified = std::fs::metadata(&self.path).and_then(|metadata| metadata.modified()).ok();
        let mut loaded = self.loaded.write().expect("token lock");
        loaded.0.checked = Instant::now();
        if modified == loaded.0.modified {
            return;
        }
        match read(&self.path) {
            Ok((tokens, modified)) => {
                info!(path = %self.path.display(), tokens = tokens.len(), "discovery tokens reloaded");
                loaded.0.tokens = tokens;
                loaded.0.modified = modified;
            }
            // Keep serving with the last good tokens rather than locking every client out.
            Err(error) => warn!(%error, "the changed token file is invalid; keeping the previous tokens"),
        }
    }

    /// Who `token` speaks for, if it is known.
    pub fn identify(&self, token: &str) -> Option<Identity> {
        self.refresh();
        let loaded = self.loaded.read().expect("token lock");
        let mut found = None;
        // Compare against every entry, without stopping early.
        for entry in &loaded.0.tokens {
            if constant_time_eq(entry.token.as_bytes(), token.as_bytes()) {
                found = Some(&entry.identity);
            }
        }
        found.cloned()
    }

    /// Every tenant the file names now, with its quota.
    pub fn tenants(&self) -> BTreeMap<String, Quota> {
        self.refresh();
        let loaded = self.loaded.read().expect("token lock");
        loaded.0.tokens.iter().map(|entry| (entry.identity.tenant.to_string(), entry.identity.quota)).collect()
    }
}

/// The tokens of a file with who they speak for.
type Tokens = Vec<TokenEntry>;

fn read(path: &Path) -> Result<(Tokens, Option<SystemTime>), TokenFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|error| TokenFileError {
        path: shown.clone(),
        line: 0,
        why: format!("cannot be read: {error}"),
    })?;
    let tokens = parse_tokens(&text, &shown)?;
    let modified = std::fs::metadata(path).and_then(|metadata| metadata.modified()).ok();
    Ok((tokens, modified))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lines_parse_with_their_errors() {
        let tokens =
            parse_tokens("# comment\n\nread aaaaaaaaaaaaaaaa\nlease bbbbbbbbbbbbbbbb\nadmin cccccccccccccccc\n", "t")
                .expect("valid");
        let scopes: Vec<(Scope, &str)> =
            tokens.iter().map(|entry| (entry.identity.scope, entry.token.as_str())).collect();
        assert_eq!(
            scopes,
            [
                (Scope::Read, "a".repeat(16).as_str()),
                (Scope::Lease, "b".repeat(16).as_str()),
                (Scope::Admin, "c".repeat(16).as_str())
            ]
        );
        let cases = [
            ("write xxxxxxxxxxxxxxxx", 1, "a line must be"),
            ("read", 1, "missing"),
            ("\nread short", 2, "at least 16"),
            ("read aaaaaaaaaaaaaaaa b", 1, "not an option"),
            ("read aaaaaaaaaaaaaaaa color=red", 1, "unknown option \"color\""),
            ("read aaaaaaaaaaaaaaaa tenant=Team_A", 1, "lower-case"),
            ("read aaaaaaaaaaaaaaaa tenant=-a", 1, "starting or"),
            ("lease aaaaaaaaaaaaaaaa maxLeases=0", 1, "from 1 to"),
            ("lease aaaaaaaaaaaaaaaa maxLeaseSeconds=3601", 1, "from 1 to 3600"),
            ("lease aaaaaaaaaaaaaaaa reportsPerMinute=x", 1, "whole number"),
            ("lease aaaaaaaa=aaaaaaaa", 1, "'='"),
            ("lease aaaaaaaaaaaaaaaa tenant=a maxLeases=3\nlease bbbbbbbbbbbbbbbb tenant=a maxLeases=4", 2, "line 1"),
        ];
        for (text, line, why) in cases {
            let error = parse_tokens(text, "tokens").expect_err(text);
            assert_eq!(error.line, line, "{text:?}");
            assert!(error.why.contains(why), "{text:?}: {}", error.why);
        }
    }

    #[test]
    fn tenants_share_their_quota_and_tokens_without_one_are_their_own() {
        let text = "lease aaaaaaaaaaaaaaaa tenant=team-a maxLeases=3\n\
                    read bbbbbbbbbbbbbbbb tenant=team-a reportsPerMinute=60\n\
                    lease cccccccccccccccc\nlease dddddddddddddddd\n";
        let tokens = parse_tokens(text, "t").expect("valid");
        let quota = Quota { max_leases: Some(3), max_lease_seconds: None, reports_per_minute: Some(60) };
        assert_eq!((&*tokens[0].identity.tenant, tokens[0].identity.quota), ("team-a", quota));
        assert_eq!((&*tokens[1].identity.tenant, tokens[1].identity.quota), ("team-a", quota));
        assert!(tokens[2].identity.tenant.starts_with("token-") && tokens[2].identity.tenant.len() == 14);
        assert_ne!(tokens[2].identity.tenant, tokens[3].identity.tenant, "a tenant of its own each");
        assert_eq!(tokens[2].identity.tenant, parse_tokens(text, "t").expect("valid")[2].identity.tenant, "stable");
        assert!(!tokens[2].identity.tenant.contains("cccc"), "the tenant shows nothing of the token");
    }

    #[test]
    fn comparison_is_exact() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
