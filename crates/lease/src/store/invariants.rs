//! The store's internal invariants, checked by the property tests after every operation.

use std::collections::{HashMap, HashSet};

use super::{InMemoryLeaseStore, InvariantViolation};

impl InMemoryLeaseStore {
    /// Checks every internal invariant: no proxy above its cap, active counts equal the live leases, no lease on an
    /// unhealthy proxy, no lease granted while its (proxy, target) cooled down, the eligibility index matches the
    /// proxies.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let inner = self.lock();
        let violation = |text: String| Err(InvariantViolation(text));
        let mut counted: HashMap<&str, u32> = HashMap::new();
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
        }
        for (id, proxy) in &inner.proxies {
            let live = counted.get(id.as_str()).copied().unwrap_or(0);
            if proxy.active != live || proxy.leases.len() as u32 != live {
                return violation(format!("proxy {id} counts {} active leases but has {live}", proxy.active));
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
