//! The backends this binary runs.

use egress_provider::registry::ProviderTypes;
use egress_provider_kubernetes::KubernetesProvider;

/// The provider types this binary can run, by `type` in the providers file: each backend's settings block and
/// constructor.
pub fn provider_types() -> ProviderTypes {
    ProviderTypes::new()
        .register::<KubernetesProvider>()
        .register::<egress_provider_gcp::GcpProvider>()
        .register::<egress_provider_aws::AwsProvider>()
        .register::<egress_provider_kvm::KvmProvider>()
}
