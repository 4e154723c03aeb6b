//! Bearer-token authentication with `read` and `lease` scopes, from a file that is re-read when it changes.
//!
//! The file has one token per line: `<scope> <token>`, where scope is `read` (list proxies and cooldowns),
//! `lease` (leases too, and proxy credentials in URLs) or `admin` (everything `lease` may, and clearing
//! cooldowns); blank lines and `#` comments are ignored. Tokens are
//! compared in constant time against every entry, so timing does not reveal how much of a guess was right.

use std::path::{Path, PathBuf};
use std::sync::RwLock;
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

/// Parses a token file's content.
pub fn parse_tokens(text: &str, path: &str) -> Result<Vec<(Scope, String)>, TokenFileError> {
    let mut tokens = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fail = |why: &str| TokenFileError { path: path.to_owned(), line: index + 1, why: why.to_owned() };
        let mut parts = line.split_whitespace();
        let scope = match parts.next() {
            Some("read") => Scope::Read,
            Some("lease") => Scope::Lease,
            Some("admin") => Scope::Admin,
            _ => return Err(fail("a line must be `read <token>`, `lease <token>` or `admin <token>`")),
        };
        let token = parts.next().ok_or_else(|| fail("the token is missing"))?;
        if parts.next().is_some() {
            return Err(fail("a token must not contain spaces"));
        }
        if token.len() < 16 {
            return Err(fail("a token must be at least 16 characters"));
        }
        tokens.push((scope, token.to_owned()));
    }
    Ok(tokens)
}

/// Equal-length-independent constant-time comparison of two byte strings.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut difference = u8::from(a.len() != b.len());
    for index in 0..a.len().max(b.len()) {
        difference |= a.get(index).copied().unwrap_or(0) ^ b.get(index).copied().unwrap_or(0);
    }
    difference == 0
}

struct Loaded {
    tokens: Vec<(Scope, String)>,
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

    /// The scope of `token`, if it is known.
    pub fn scope_of(&self, token: &str) -> Option<Scope> {
        self.refresh();
        let loaded = self.loaded.read().expect("token lock");
        let mut found = None;
        // Compare against every entry, without stopping early.
        for (scope, known) in &loaded.0.tokens {
            if constant_time_eq(known.as_bytes(), token.as_bytes()) {
                found = Some(*scope);
            }
        }
        found
    }
}

/// The tokens of a file with their scopes.
type Tokens = Vec<(Scope, String)>;

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
        assert_eq!(
            tokens,
            [(Scope::Read, "a".repeat(16)), (Scope::Lease, "b".repeat(16)), (Scope::Admin, "c".repeat(16))]
        );
        let cases = [
            ("write xxxxxxxxxxxxxxxx", 1, "a line must be"),
            ("read", 1, "missing"),
            ("\nread short", 2, "at least 16"),
            ("read a b", 1, "spaces"),
        ];
        for (text, line, why) in cases {
            let error = parse_tokens(text, "tokens").expect_err(text);
            assert_eq!(error.line, line, "{text:?}");
            assert!(error.why.contains(why), "{text:?}: {}", error.why);
        }
    }

    #[test]
    fn comparison_is_exact() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
