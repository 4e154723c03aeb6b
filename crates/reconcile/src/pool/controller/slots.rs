//! A pool's slots: the member spec each spread entry asks for, and where its members run.

use egress_api::pool::slot_of;
use egress_api::{ProxyPool, ProxySpec};

/// The member spec one spread entry asks for, and the provider and zone that tell its members apart.
pub(super) struct SlotSpec {
    pub(super) spec: ProxySpec,
    pub(super) provider: Option<String>,
    pub(super) zone: Option<String>,
}

impl SlotSpec {
    /// Whether a member with `spec` runs where this entry asks.
    pub(super) fn holds(&self, spec: &ProxySpec) -> bool {
        let (provider, zone) = slot_of(spec);
        self.provider.as_deref() == provider && self.zone.as_deref() == zone
    }
}

/// The member spec each spread entry asks for.
pub(super) fn slot_specs(pool: &ProxyPool) -> Vec<SlotSpec> {
    pool.spec
        .slots()
        .iter()
        .map(|slot| {
            let spec = pool.spec.member_spec(slot);
            let (provider, zone) = slot_of(&spec);
            let (provider, zone) = (provider.map(str::to_owned), zone.map(str::to_owned));
            SlotSpec { spec, provider, zone }
        })
        .collect()
}
