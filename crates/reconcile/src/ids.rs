//! The one place where Kubernetes objects and their references become the kube-free identities the lease store,
//! the discovery API, the journal and metrics use ([`ProxyId`], [`PoolId`]), and back.

pub use egress_fleet::{PoolId, ProxyId};

use egress_fleet::NamespacedName;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use crate::feed::{GuardedPool, GuardedProxy};

fn namespaced_name<K: Resource>(object: &K) -> NamespacedName {
    NamespacedName::new(object.meta().namespace.as_deref().unwrap_or_default(), &object.name_any())
}

fn namespaced_name_of_ref<K: Resource>(reference: &ObjectRef<K>) -> NamespacedName {
    NamespacedName::new(reference.namespace.as_deref().unwrap_or_default(), &reference.name)
}

/// The identity of a Proxy (or of its guarded form, as the stores keep it).
pub fn proxy_id<K: Resource<DynamicType = ()>>(proxy: &K) -> ProxyId {
    debug_assert_eq!(K::kind(&()), "Proxy");
    namespaced_name(proxy).into()
}

/// The identity of the Proxy a store reference names.
pub fn proxy_id_of(reference: &ObjectRef<GuardedProxy>) -> ProxyId {
    namespaced_name_of_ref(reference).into()
}

/// The store reference of a Proxy.
pub fn proxy_ref(id: &ProxyId) -> ObjectRef<GuardedProxy> {
    ObjectRef::new(id.name()).within(id.namespace())
}

/// The identity of a ProxyPool (or of its guarded form).
pub fn pool_id<K: Resource<DynamicType = ()>>(pool: &K) -> PoolId {
    debug_assert_eq!(K::kind(&()), "ProxyPool");
    namespaced_name(pool).into()
}

/// The identity of the ProxyPool a store reference names.
pub fn pool_id_of(reference: &ObjectRef<GuardedPool>) -> PoolId {
    namespaced_name_of_ref(reference).into()
}

/// The store reference of a ProxyPool.
pub fn pool_ref(id: &PoolId) -> ObjectRef<GuardedPool> {
    ObjectRef::new(id.name()).within(id.namespace())
}

#[cfg(test)]
mod tests {
    use egress_api::{Proxy, ProxySpec};

    use super::*;

    #[test]
    fn objects_and_references_meet_in_one_identity() {
        let mut proxy = Proxy::new("eu-0", ProxySpec::external("203.0.113.7", 3128));
        proxy.metadata.namespace = Some("crawl".into());
        let id = proxy_id(&proxy);
        assert_eq!(id, ProxyId::new("crawl", "eu-0"));
        let reference = proxy_ref(&id);
        assert_eq!((reference.name.as_str(), reference.namespace.as_deref()), ("eu-0", Some("crawl")));
        assert_eq!(proxy_id_of(&reference), id);
        let pool = pool_ref(&PoolId::new("crawl", "eu"));
        assert_eq!((pool.name.as_str(), pool.namespace.as_deref()), ("eu", Some("crawl")));
        assert_eq!(pool_id_of(&pool), PoolId::new("crawl", "eu"));
    }
}
