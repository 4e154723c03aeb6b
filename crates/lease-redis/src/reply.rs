//! What the state script is sent and what it answers: arguments formatted, replies parsed (a reply the script never
//! gives is [`LeaseError::StateUnavailable`], naming what was asked).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use egress_lease::{Claims, Cooldown, CooldownPolicy, LeaseError, ProxyId};
use redis::Value;

/// Whether a command failed before the server could have seen it: written to a connection already closed. The
/// client keeps the I/O error's kind private; its text is the kind's own.
pub(crate) fn never_sent(error: &redis::RedisError) -> bool {
    let text = error.to_string();
    error.is_connection_dropped()
        && [std::io::ErrorKind::BrokenPipe, std::io::ErrorKind::NotConnected]
            .iter()
            .any(|kind| text.contains(&kind.to_string()))
}

/// What the scripts that take a lease ID are told of it: serial owner proxy target expiry, and the proxy's health and
/// endpoint in this replica's view (to adopt it, or refuse it as revoked).
pub(crate) fn id_args(claims: &Claims, owner: &str, healthy: bool, endpoint: &str) -> Vec<String> {
    vec![
        claims.serial.to_string(),
        owner.to_owned(),
        claims.proxy.to_string(),
        claims.target.clone(),
        ms(claims.expires_at),
        if healthy { "1" } else { "0" }.to_owned(),
        endpoint.to_owned(),
    ]
}

pub(crate) fn ms(time: SystemTime) -> String {
    time.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis()).to_string()
}

pub(crate) fn policy_args(policy: CooldownPolicy) -> [String; 3] {
    [policy.base.as_millis().to_string(), policy.factor.to_string(), policy.max.as_millis().to_string()]
}

/// A reply the scripts never give: the server runs another script under the same name, or a bug.
pub(crate) fn malformed(what: &str) -> LeaseError {
    LeaseError::StateUnavailable(format!("the state store answered {what} with something unexpected"))
}

/// The items of a script's array reply, as strings (integers formatted).
pub(crate) fn strings(value: Value, what: &str) -> Result<Vec<String>, LeaseError> {
    let Value::Array(items) = value else { return Err(malformed(what)) };
    items
        .into_iter()
        .map(|item| match item {
            Value::BulkString(bytes) => String::from_utf8(bytes).map_err(|_| malformed(what)),
            Value::SimpleString(text) => Ok(text),
            Value::Int(number) => Ok(number.to_string()),
            Value::Nil => Ok(String::new()),
            _ => Err(malformed(what)),
        })
        .collect()
}

pub(crate) fn integer(value: Value, what: &str) -> Result<u64, LeaseError> {
    match value {
        Value::Int(number) => u64::try_from(number).map_err(|_| malformed(what)),
        _ => Err(malformed(what)),
    }
}

/// A time in milliseconds from a reply; `None` for an empty field.
pub(crate) fn time(field: &str, what: &str) -> Result<Option<SystemTime>, LeaseError> {
    if field.is_empty() {
        return Ok(None);
    }
    let millis: u64 = field.parse().map_err(|_| malformed(what))?;
    Ok(Some(UNIX_EPOCH + Duration::from_millis(millis)))
}

pub(crate) fn number<T: std::str::FromStr>(field: &str, what: &str) -> Result<T, LeaseError> {
    field.parse().map_err(|_| malformed(what))
}

pub(crate) fn proxy_id(field: &str, what: &str) -> Result<ProxyId, LeaseError> {
    field.parse().map_err(|_| malformed(what))
}

/// Cooldowns from five-field groups (proxy target until streak reporters).
pub(crate) fn cooldown_list(fields: Vec<String>, what: &str) -> Result<Vec<Cooldown>, LeaseError> {
    fields
        .chunks(5)
        .map(|group| {
            let [proxy, target, until, streak, reporters] = group else { return Err(malformed(what)) };
            Ok(Cooldown {
                proxy: proxy_id(proxy, what)?,
                target: target.clone(),
                until: time(until, what)?.ok_or_else(|| malformed(what))?,
                streak: number(streak, what)?,
                reporters: reporters.split('\n').filter(|who| !who.is_empty()).map(str::to_owned).collect(),
            })
        })
        .collect()
}
