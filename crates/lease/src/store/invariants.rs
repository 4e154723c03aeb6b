//! The store's internal invariants, checked by the property tests after every operation.

use std::collections::{HashMap, HashSet};

use super::{InMemoryLeaseStore, InvariantViolation};

impl InMemoryLeaseStore {
    /// Checks every internal invariant: no proxy above its cap, active counts equal the slots of the live leases (one
    /// per lease without a session, one per session and site), no lease on an unhealthy proxy, no lease granted
    /// while its (proxy, target) cooled down, the eligibility index matches the proxies.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let inner = self.lock();
        let violation = |text: String| Err(InvariantViolation(text));
        let mut counted: HashMap<&str, u32> = HashMap::new();
        // The slots of each proxy's live leases: a lease's own (`Err(serial)`), or its session's (`Ok(slot)`).
        let mut sharing: HashMap<&str, HashMap<Result<u64, u64>, u32>> = HashMap::new();
        for (serial, lease) in &inner.leases {
            let Some(proxy) = inner.proxies.get(&lease.proxy) else {
                return violation(format!("lease {serial:x} is on unknown proxy {}", lease.proxy));
            };
            if !proxy.info.healthy {
                return violation(format!("lease {serial:x} is on unhealthy proxy {}", lease.proxy));
            }
            if !proxy.leases.contains(serial) {
                return violation(format!("lease {serial:x} is missing from its proxy's lease set"));
            }
            if let Some(cooldown) = inner.cooldowns.get(&(lease.proxy.clone(), lease.target.clone()))
                && !lease.adopted
                && cooldown.started < lease.sequence
                && cooldown.until > lease.granted_at
            {
                return violation(format!(
                    "lease {serial:x} was granted on {} while it cooled down for {}",
                    lease.proxy, lease.target
                ));
            }
            *counted.entry(lease.proxy.as_str()).or_default() += 1;
            let slot = lease.slot.ok_or(*serial);
            *sharing.entry(lease.proxy.as_str()).or_default().entry(slot).or_default() += 1;
        }
        for (id, proxy) in &inner.proxies {
            let live = counted.get(id.as_str()).copied().unwrap_or(0);
            let slots = sharing.get(id.as_str());
            let taken = slots.map_or(0, HashMap::len) as u32;
            if proxy.active != taken || proxy.leases.len() as u32 != live {
                return violation(format!(
                    "proxy {id} counts {} slots and {} leases but has {taken} and {live}",
                    proxy.active,
                    proxy.leases.len()
                ));
            }
            let shared: HashMap<u64, u32> =
                slots.into_iter().flatten().filter_map(|(slot, leases)| Some(((*slot).ok()?, *leases))).collect();
            if proxy.slots.len() != shared.len()
                || proxy.slots.iter().any(|(slot, leases)| shared.get(slot) != Some(leases))
            {
                return violation(format!("proxy {id} counts its sessions' shared slots wrongly"));
            }
            if proxy.active > proxy.info.max_leases {
                return violation(format!(
                    "proxy {id} has {} leases, above its cap {}",
                    proxy.active, proxy.info.max_leases
                ));
            }
            if proxy.eligible() != inner.available.contains(&proxy.key()) {
                return violation(format!("proxy {id} is indexed as available wrongly"));
            }
        }
        if inner.available.len() != inner.proxies.values().filter(|proxy| proxy.eligible()).count() {
            return violation("the availability index holds stale entries".into());
        }
        if inner.lease_expiries.len() != inner.leases.len() {
            return violation("lease expiries and leases differ in number".into());
        }
        let owned: usize = inner.owners.values().map(HashSet::len).sum();
        if owned != inner.leases.len()
            || inner.owners.iter().any(|(owner, held)| {
                held.is_empty() || held.iter().any(|serial| inner.leases.get(serial).is_none_or(|l| &l.owner != owner))
            })
        {
            return violation("the leases by owner differ from the live leases".into());
        }
        Ok(())
    }
}
