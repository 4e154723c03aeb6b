//! libvirt errors as the operator's error classes.
//!
//! | libvirt | class |
//! | --- | --- |
//! | no such domain / volume | NotFound |
//! | bad XML, unsupported configuration or operation, no such storage pool, access denied | Permanent |
//! | connection lost, RPC, SSH, timeouts, busy, everything else | Transient |
//!
//! A failed dial is Transient unless the host key is unknown or changed, which needs a person (Permanent).

use egress_provider::ProviderError;
use virt::error::{Error, ErrorNumber};

/// The class of a libvirt error from call `op` on `host`, with the call and identifiers in the message.
pub fn classify(error: &Error, op: &str, host: &str, ids: &str) -> ProviderError {
    let class: fn(String) -> ProviderError = match error.code() {
        ErrorNumber::NoDomain | ErrorNumber::NoStorageVolume => ProviderError::not_found,
        ErrorNumber::XmlError
        | ErrorNumber::XmlDetail
        | ErrorNumber::XmlInvalidSchema
        | ErrorNumber::ConfigUnsupported
        | ErrorNumber::NoSupport
        | ErrorNumber::ArgumentUnsupported
        | ErrorNumber::OperationUnsupported
        | ErrorNumber::InvalidArg
        | ErrorNumber::NoStoragePool
        | ErrorNumber::AccessDenied
        | ErrorNumber::OperationDenied
        | ErrorNumber::CpuIncompatible => ProviderError::permanent,
        _ => ProviderError::transient,
    };
    let ids = if ids.is_empty() { String::new() } else { format!(" ({ids})") };
    class(format!("libvirt {op} on host {host}{ids}: {}", error.message())).with_source(error.clone())
}

/// The class of a failed dial: a host-key problem is Permanent (a person must check the key), the rest Transient.
pub fn dial_error(error: &Error, host: &str) -> ProviderError {
    let message = error.message();
    let lower = message.to_ascii_lowercase();
    let host_key = lower.contains("host key") || lower.contains("known_hosts") || lower.contains("knownhost");
    let text = format!("dialling host {host}: {message}");
    if host_key {
        ProviderError::permanent(format!("{text} (check ssh.knownHostsFile: no host key is accepted unchecked)"))
            .with_source(error.clone())
    } else {
        ProviderError::transient(text).with_source(error.clone())
    }
}
