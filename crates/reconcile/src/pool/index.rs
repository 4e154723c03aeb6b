//! Which Proxies carry which pool's label: kept from the Proxy feed's changes, so a member's change costs one lookup
//! and wakes exactly its pool, whatever the fleet's size.

use std::collections::{BTreeSet, HashMap};

use egress_api::pool::POOL_LABEL;
use kube::Resource;
use kube::runtime::reflector::ObjectRef;

use crate::feed::{GuardedPool, GuardedProxy};

/// The pool a Proxy's label names (in the Proxy's namespace), valid object or not: a candidate member, which
/// [`egress_api::pool::member_of`] confirms or not (the index wakes a pool for every Proxy labelled for it, its
/// own or one that took a member's name).
pub fn pool_of(proxy: &GuardedProxy) -> Option<ObjectRef<GuardedPool>> {
    let metadata = proxy.meta();
    let name = metadata.labels.as_ref()?.get(POOL_LABEL)?;
    let mut reference = ObjectRef::new(name);
    reference.namespace = metadata.namespace.clone();
    Some(reference)
}

/// Proxies by the pool their label names, and the reverse.
#[derive(Default, Debug)]
pub struct MemberIndex {
    pool_of: HashMap<ObjectRef<GuardedProxy>, ObjectRef<GuardedPool>>,
    members: HashMap<ObjectRef<GuardedPool>, BTreeSet<String>>,
}

impl MemberIndex {
    /// Records that `proxy` is labelled for `pool` (or for none, or is gone). Returns the pools whose members
    /// changed: the previous one and the new one.
    pub fn set(
        &mut self,
        proxy: &ObjectRef<GuardedProxy>,
        pool: Option<ObjectRef<GuardedPool>>,
    ) -> Vec<ObjectRef<GuardedPool>> {
        let previous = match pool.clone() {
            Some(pool) => self.pool_of.insert(proxy.clone(), pool),
            None => self.pool_of.remove(proxy),
        };
        if let Some(previous) = &previous
            && Some(previous) != pool.as_ref()
            && let Some(members) = self.members.get_mut(previous)
        {
            members.remove(&proxy.name);
            if members.is_empty() {
                self.members.remove(previous);
            }
        }
        if let Some(pool) = &pool {
            self.members.entry(pool.clone()).or_default().insert(proxy.name.clone());
        }
        let mut touched: Vec<ObjectRef<GuardedPool>> = previous.into_iter().collect();
        if let Some(pool) = pool
            && !touched.contains(&pool)
        {
            touched.push(pool);
        }
        touched
    }

    /// The names of the Proxies labelled for `pool`.
    pub fn members_of(&self, pool: &ObjectRef<GuardedPool>) -> Vec<String> {
        self.members.get(pool).map(|names| names.iter().cloned().collect()).unwrap_or_default()
    }

    /// Every pool that has a labelled Proxy.
    pub fn pools(&self) -> Vec<ObjectRef<GuardedPool>> {
        self.members.keys().cloned().collect()
    }

    /// Starts again from `proxies` (after a relist).
    pub fn rebuild<'a>(&mut self, proxies: impl IntoIterator<Item = &'a GuardedProxy>) {
        *self = Self::default();
        for proxy in proxies {
            let reference = crate::feed::reference_of(proxy);
            self.set(&reference, pool_of(proxy));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxy(name: &str) -> ObjectRef<GuardedProxy> {
        ObjectRef::new(name).within("ns")
    }

    fn pool(name: &str) -> ObjectRef<GuardedPool> {
        ObjectRef::new(name).within("ns")
    }

    #[test]
    fn a_member_moves_between_pools_and_leaves() {
        let mut index = MemberIndex::default();
        assert_eq!(index.set(&proxy("eu-0"), Some(pool("eu"))), [pool("eu")]);
        assert_eq!(index.set(&proxy("eu-1"), Some(pool("eu"))), [pool("eu")]);
        assert_eq!(index.members_of(&pool("eu")), ["eu-0", "eu-1"]);
        // Relabelled: both pools hear of it.
        assert_eq!(index.set(&proxy("eu-1"), Some(pool("us"))), [pool("eu"), pool("us")]);
        assert_eq!(index.members_of(&pool("eu")), ["eu-0"]);
        assert_eq!(index.members_of(&pool("us")), ["eu-1"]);
        // Gone.
        assert_eq!(index.set(&proxy("eu-0"), None), [pool("eu")]);
        assert!(index.members_of(&pool("eu")).is_empty());
        assert_eq!(index.pools(), [pool("us")]);
        // Not a member and never was: nobody to tell.
        assert!(index.set(&proxy("loose"), None).is_empty());
    }
}
