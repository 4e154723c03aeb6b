//! Turning EC2 and STS error answers into the provider contract's classes, by the error code first and the HTTP
//! status second: EC2 answers throttling with 503 and a code, and most mistakes with 400 and a code.

use egress_provider::ErrorClass;

/// Codes of a request rate limit: the same call succeeds after a pause.
const THROTTLING: &[&str] = &["RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException"];

/// Codes of an account limit or of capacity: more instances will not start until the user acts or AWS has room.
const LIMITS: &[&str] = &[
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "MaxSpotInstanceCountExceeded",
    "AddressLimitExceeded",
    "SecurityGroupLimitExceeded",
    "RulesPerSecurityGroupLimitExceeded",
    "ResourceLimitExceeded",
];

/// Codes that pass by themselves: a state in transition, an expired signature or token (renewed on the next
/// call), AWS's own failures.
const PASSING: &[&str] = &[
    "InternalError",
    "InternalFailure",
    "ServiceUnavailable",
    "Unavailable",
    "IncorrectInstanceState",
    "IncorrectState",
    "DependencyViolation",
    "ExpiredToken",
    "RequestExpired",
    "IDPCommunicationError",
];

/// The class of an error answer: `InvalidInstanceID.NotFound` → NotFound (other `.NotFound` codes name a subnet,
/// image or group from the config: Permanent); throttling, limit and capacity codes, and 429 → QuotaExceeded; codes
/// that pass by themselves, 5xx and no answer → Transient; every other 4xx (`AuthFailure`, `UnauthorizedOperation`,
/// `InvalidParameterValue`…) → Permanent.
pub fn class_of(status: Option<u16>, code: Option<&str>) -> ErrorClass {
    if let Some(code) = code {
        if code == "InvalidInstanceID.NotFound" {
            return ErrorClass::NotFound;
        }
        if THROTTLING.contains(&code) || LIMITS.contains(&code) {
            return ErrorClass::QuotaExceeded;
        }
        if PASSING.contains(&code) {
            return ErrorClass::Transient;
        }
    }
    match status {
        Some(429) => ErrorClass::QuotaExceeded,
        Some(status) if (400..500).contains(&status) => ErrorClass::Permanent,
        _ => ErrorClass::Transient,
    }
}

/// Whether the call is worth sending again within the same operation: throttling and what passes by itself, not an
/// account limit (which waits for the reconciler's longer backoff).
pub fn is_retryable(status: Option<u16>, code: Option<&str>) -> bool {
    match code {
        Some(code) if THROTTLING.contains(&code) => true,
        Some(code) if LIMITS.contains(&code) || code == "IncorrectInstanceState" => false,
        _ => class_of(status, code) == ErrorClass::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_table() {
        let table = [
            (Some(400), Some("InvalidInstanceID.NotFound"), ErrorClass::NotFound, false),
            (Some(400), Some("InvalidInstanceID.Malformed"), ErrorClass::Permanent, false),
            (Some(400), Some("InvalidSubnetID.NotFound"), ErrorClass::Permanent, false),
            (Some(400), Some("InvalidAMIID.NotFound"), ErrorClass::Permanent, false),
            (Some(503), Some("RequestLimitExceeded"), ErrorClass::QuotaExceeded, true),
            (Some(400), Some("Throttling"), ErrorClass::QuotaExceeded, true),
            (Some(400), Some("InstanceLimitExceeded"), ErrorClass::QuotaExceeded, false),
            (Some(400), Some("VcpuLimitExceeded"), ErrorClass::QuotaExceeded, false),
            (Some(500), Some("InsufficientInstanceCapacity"), ErrorClass::QuotaExceeded, false),
            (Some(429), None, ErrorClass::QuotaExceeded, false),
            (Some(401), Some("AuthFailure"), ErrorClass::Permanent, false),
            (Some(403), Some("UnauthorizedOperation"), ErrorClass::Permanent, false),
            (Some(403), Some("SignatureDoesNotMatch"), ErrorClass::Permanent, false),
            (Some(400), Some("InvalidParameterValue"), ErrorClass::Permanent, false),
            (Some(400), Some("IncorrectInstanceState"), ErrorClass::Transient, false),
            (Some(400), Some("ExpiredToken"), ErrorClass::Transient, true),
            (Some(500), Some("InternalError"), ErrorClass::Transient, true),
            (Some(503), Some("Unavailable"), ErrorClass::Transient, true),
            (Some(502), None, ErrorClass::Transient, true),
            (None, None, ErrorClass::Transient, true),
        ];
        for (status, code, class, retryable) in table {
            assert_eq!(class_of(status, code), class, "{status:?} {code:?}");
            assert_eq!(is_retryable(status, code), retryable, "{status:?} {code:?}");
        }
    }
}
