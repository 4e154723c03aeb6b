//! Where the control-plane binaries live, and which Kubernetes version they are.
//!
//! `cargo xtask envtest` builds them into this directory and the tests start them from it; both ask this module,
//! so the two can never disagree about the path.

use std::env;
use std::path::PathBuf;

/// The Kubernetes release the test control plane is built from. It matches the `k8s-openapi` feature the workspace
/// enables (`v1_36`) and the version pinned in `xtask/envtest/go.mod` (a test checks both).
pub const KUBERNETES_VERSION: &str = "v1.36.3";

/// Overrides the directory holding `kube-apiserver`, `kube-controller-manager` and `etcd`.
pub const BIN_DIR_ENV: &str = "EGRESS_ENVTEST_BIN_DIR";

/// Overrides the root of every cache the project keeps (default `$HOME/.cache/egress-operator`).
pub const CACHE_DIR_ENV: &str = "EGRESS_CACHE_DIR";

/// The root of the project's caches outside the checkout.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os(CACHE_DIR_ENV).filter(|dir| !dir.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = env::var_os("HOME").filter(|home| !home.is_empty()).map(PathBuf::from).unwrap_or_else(env::temp_dir);
    home.join(".cache").join("egress-operator")
}

/// The directory holding the control-plane binaries: `$EGRESS_ENVTEST_BIN_DIR`, else
/// `<cache>/envtest/<kubernetes version>`.
pub fn bin_dir() -> PathBuf {
    match env::var_os(BIN_DIR_ENV).filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => cache_dir().join("envtest").join(KUBERNETES_VERSION),
    }
}

/// The helm release built for the chart's tests; `xtask/helm/go.mod` requires the same (a test checks both).
pub const HELM_VERSION: &str = "v4.3.2";

/// The path of the helm binary (`<cache>/helm/<helm version>/helm`), built by `cargo xtask test` from its Go module.
pub fn helm() -> PathBuf {
    cache_dir().join("helm").join(HELM_VERSION).join("helm")
}

/// The path of the kube-apiserver binary.
pub fn kube_apiserver() -> PathBuf {
    bin_dir().join("kube-apiserver")
}

/// The path of the etcd binary.
pub fn etcd() -> PathBuf {
    bin_dir().join("etcd")
}

/// The path of the kube-controller-manager binary.
pub fn kube_controller_manager() -> PathBuf {
    bin_dir().join("kube-controller-manager")
}

/// The path of the kubectl binary built with the control plane (the tests and the quickstart use it for `apply -k`).
pub fn kubectl() -> PathBuf {
    bin_dir().join("kubectl")
}
