//! Self-verifying lease identifiers.
//!
//! A lease ID carries what a store needs to take the lease over when it has never seen it (after a restart or a
//! change of leader): a serial, the expiry, the proxy and the target, authenticated by an HMAC-SHA256 under a key
//! all replicas share. The MAC also covers the identity of the token that took the lease, which the ID does not
//! carry, so an ID shown with another token does not verify, exactly like one that was never issued.
//!
//! Layout: `l1.` + base64url(serial u64 BE, expiry u64 BE seconds, proxy length u16 BE, proxy, target) + `.` +
//! base64url(the MAC). Renewing changes the expiry and so the ID; a store keys its leases by
//! serial, so every ID of one lease names the same lease.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use egress_fleet::ProxyId;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

const PREFIX: &str = "l1.";
/// Domain separation: these MACs mean nothing anywhere else.
const CONTEXT: &[u8] = b"egress-operator lease v1\0";
/// The shortest key accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 32;

/// The shared key lease IDs are signed with. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct LeaseKey(hmac::Key);

impl fmt::Debug for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseKey(..)")
    }
}

/// A key shorter than [`MIN_KEY_BYTES`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a lease key needs at least {MIN_KEY_BYTES} bytes; this one has {0}")]
pub struct ShortKey(pub usize);

impl LeaseKey {
    /// A key from secret bytes (at least [`MIN_KEY_BYTES`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ShortKey> {
        if bytes.len() < MIN_KEY_BYTES {
            return Err(ShortKey(bytes.len()));
        }
        Ok(Self(hmac::Key::new(hmac::HMAC_SHA256, bytes)))
    }

    /// Fresh random key bytes from the operating system, for a caller that stores them (for example in a Secret).
    pub fn generate_bytes() -> [u8; MIN_KEY_BYTES] {
        let mut bytes = [0_u8; MIN_KEY_BYTES];
        SystemRandom::new().fill(&mut bytes).expect("the operating system's random source failed");
        bytes
    }

    /// A random key of this process only: IDs it signs are not adoptable by any other process.
    pub fn ephemeral() -> Self {
        Self::from_bytes(&Self::generate_bytes()).expect("a generated key is long enough")
    }

    /// What the MAC covers: the context, the owner (length-prefixed) and the payload.
    fn message(payload: &[u8], owner: &str) -> Vec<u8> {
        let mut message = Vec::with_capacity(CONTEXT.len() + 8 + owner.len() + payload.len());
        message.extend_from_slice(CONTEXT);
        message.extend_from_slice(&(owner.len() as u64).to_be_bytes());
        message.extend_from_slice(owner.as_bytes());
        message.extend_from_slice(payload);
        message
    }

    /// A 64-bit digest of `parts` (each length-prefixed) under this key, in a context of its own: the same in every
    /// process with the key, and telling nothing of the parts to anyone without it.
    pub fn digest(&self, parts: &[&[u8]]) -> u64 {
        let mut context = hmac::Context::with_key(&self.0);
        context.update(b"egress-operator digest v1");
        for part in parts {
            context.update(&(part.len() as u64).to_be_bytes());
            context.update(part);
        }
        let tag = context.sign();
        u64::from_be_bytes(tag.as_ref()[..8].try_into().expect("an HMAC is longer than eight bytes"))
    }

    /// The ID for `claims`, bound to `owner` (the identity of the token that took the lease).
    pub fn sign(&self, claims: &Claims, owner: &str) -> String {
        let payload = claims.encode();
        let tag = hmac::sign(&self.0, &Self::message(&payload, owner));
        format!("{PREFIX}{}.{}", URL_SAFE_NO_PAD.encode(&payload), URL_SAFE_NO_PAD.encode(tag.as_ref()))
    }

    /// The claims of an ID this key signed for `owner`; `None` for anything else (malformed, forged, another
    /// key's, another owner's), without saying which.
    pub fn verify(&self, id: &str, owner: &str) -> Option<Claims> {
        let (payload, mac) = id.strip_prefix(PREFIX)?.split_once('.')?;
        let payload = URL_SAFE_NO_PAD.decode(payload).ok()?;
        let mac = URL_SAFE_NO_PAD.decode(mac).ok()?;
        // ring compares in constant time: the answer does not tell a forger how many bytes were right.
        hmac::verify(&self.0, &Self::message(&payload, owner), &mac).ok()?;
        Claims::decode(&payload)
    }
}

/// What a lease ID says about its lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claims {
    /// Unique per lease; the same for every ID of one lease.
    pub serial: u64,
    /// When the lease expires unless renewed, to the second.
    pub expires_at: SystemTime,
    /// The proxy.
    pub proxy: ProxyId,
    /// The normalised target.
    pub target: String,
}

impl Claims {
    fn encode(&self) -> Vec<u8> {
        let seconds = self.expires_at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_secs());
        let proxy = self.proxy.as_str().as_bytes();
        let proxy_len = u16::try_from(proxy.len()).unwrap_or(u16::MAX);
        let mut out = Vec::with_capacity(18 + proxy.len() + self.target.len());
        out.extend_from_slice(&self.serial.to_be_bytes());
        out.extend_from_slice(&seconds.to_be_bytes());
        out.extend_from_slice(&proxy_len.to_be_bytes());
        out.extend_from_slice(&proxy[..usize::from(proxy_len)]);
        out.extend_from_slice(self.target.as_bytes());
        out
    }

    fn decode(payload: &[u8]) -> Option<Self> {
        let serial = u64::from_be_bytes(payload.get(..8)?.try_into().ok()?);
        let seconds = u64::from_be_bytes(payload.get(8..16)?.try_into().ok()?);
        let proxy_len = usize::from(u16::from_be_bytes(payload.get(16..18)?.try_into().ok()?));
        let proxy = std::str::from_utf8(payload.get(18..18 + proxy_len)?).ok()?.parse().ok()?;
        let target = std::str::from_utf8(payload.get(18 + proxy_len..)?).ok()?.to_owned();
        Some(Self { serial, expires_at: UNIX_EPOCH + Duration::from_secs(seconds), proxy, target })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Claims {
        Claims {
            serial: 0x0123_4567_89ab_cdef,
            expires_at: UNIX_EPOCH + Duration::from_secs(1_800_000_000),
            proxy: ProxyId::new("crawl", "px-1"),
            target: "example.com".into(),
        }
    }

    #[test]
    fn an_id_verifies_with_its_key_and_owner_only() {
        let key = LeaseKey::ephemeral();
        let id = key.sign(&claims(), "token-a");
        assert!(id.starts_with("l1.") && id.len() < 130, "{id}");
        assert_eq!(key.verify(&id, "token-a"), Some(claims()));
        assert_eq!(key.verify(&id, "token-b"), None, "another token's");
        assert_eq!(key.verify(&id, ""), None);
        assert_eq!(LeaseKey::ephemeral().verify(&id, "token-a"), None, "another key's");
    }

    #[test]
    fn a_changed_or_malformed_id_does_not_verify() {
        let key = LeaseKey::from_bytes(&[7; 32]).expect("key");
        let id = key.sign(&claims(), "");
        let (payload, mac) = id.strip_prefix(PREFIX).and_then(|rest| rest.split_once('.')).expect("layout");
        let mut bytes = URL_SAFE_NO_PAD.decode(payload).expect("base64");
        bytes[15] ^= 1; // one second more
        let forged = format!("{PREFIX}{}.{mac}", URL_SAFE_NO_PAD.encode(&bytes));
        assert_eq!(key.verify(&forged, ""), None, "a changed expiry");
        for malformed in
            ["", "l1.", "l1..", "l-0123456789abcdef1", "l1.AAAA.AAAA", &id[..id.len() - 1], &format!("{id}A")]
        {
            assert_eq!(key.verify(malformed, ""), None, "{malformed:?}");
        }
    }

    #[test]
    fn keys_are_long_enough_and_never_shown() {
        assert_eq!(LeaseKey::from_bytes(&[1; 31]).unwrap_err(), ShortKey(31));
        let key = LeaseKey::from_bytes(&[1; 32]).expect("key");
        assert_eq!(format!("{key:?}"), "LeaseKey(..)");
        assert_ne!(LeaseKey::generate_bytes(), LeaseKey::generate_bytes());
    }
}
