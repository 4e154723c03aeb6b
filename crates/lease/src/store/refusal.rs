//! Why a lease was refused: worked out only on refusal, so it may look at every proxy.

use std::time::SystemTime;

use super::state::{Inner, ProxyState};
use crate::{LeaseError, LeaseRequest};

/// Why no proxy was eligible. Only reached on refusal, so it may look at every proxy.
pub(super) fn explain_refusal(inner: &Inner, request: &LeaseRequest, target: &str, now: SystemTime) -> LeaseError {
    let matching: Vec<&ProxyState> = inner
        .proxies
        .values()
        .filter(|proxy| proxy.info.healthy && proxy.info.max_leases > 0 && request.admits(&proxy.info))
        .collect();
    if matching.is_empty() {
        return LeaseError::NoneHealthy;
    }
    // Proxies with room that only their pace holds back: the first slot is the answer.
    let paced = matching
        .iter()
        .filter(|proxy| {
            proxy.active < proxy.info.max_leases && inner.cooling_until(&proxy.info.id, target, now).is_none()
        })
        .filter_map(|proxy| inner.paced_until(&proxy.info.id, target, now))
        .min();
    if let Some(until) = paced {
        return LeaseError::Paced { until, proxy: None };
    }
    let cooling: Vec<SystemTime> = matching
        .iter()
        .filter(|proxy| proxy.active < proxy.info.max_leases)
        .filter_map(|proxy| inner.cooling_until(&proxy.info.id, target, now))
        .collect();
    if let Some(until) = cooling.iter().min() {
        let at_capacity = matching.iter().filter(|proxy| proxy.active >= proxy.info.max_leases).count();
        return LeaseError::AllCoolingDown {
            until: *until,
            cooling: u32::try_from(cooling.len()).unwrap_or(u32::MAX),
            at_capacity: u32::try_from(at_capacity).unwrap_or(u32::MAX),
        };
    }
    let retry_at = matching
        .iter()
        .flat_map(|proxy| proxy.leases.iter())
        .filter_map(|id| inner.leases.get(id).map(|lease| lease.expires_at))
        .min();
    LeaseError::AllAtCapacity { retry_at }
}
