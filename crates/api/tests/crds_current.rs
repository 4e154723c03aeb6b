//! The committed CRD YAML under `crds/` must be what the Rust types generate: the test control plane and the
//! deployment install those files, so a stale file would test and ship an old schema.

use std::path::Path;

#[test]
fn committed_crds_match_the_rust_types() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../crds");
    for file in egress_api::crdgen::files().expect("the CRDs render") {
        let path = dir.join(&file.file_name);
        let committed =
            std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
        assert!(
            committed == file.contents,
            "{} is stale: run `cargo xtask crdgen` and commit the result",
            path.display()
        );
    }
}

#[test]
fn proxy_crd_has_the_promised_shape() {
    let proxy = egress_api::crdgen::files()
        .expect("the CRDs render")
        .into_iter()
        .find(|file| file.file_name.contains("proxies"))
        .expect("the Proxy CRD");
    let yaml = proxy.contents;
    assert!(yaml.matches("rule:").count() >= 8, "at least 8 CEL rules");
    assert!(yaml.contains("shortNames:\n    - px\n"), "short name px");
    assert!(yaml.contains("categories:\n    - egress\n"), "category egress");
    assert!(yaml.contains("subresources:\n      status: {}"), "status subresource");
}

#[test]
fn proxy_pool_crd_has_the_promised_shape() {
    let pool = egress_api::crdgen::files()
        .expect("the CRDs render")
        .into_iter()
        .find(|file| file.file_name.contains("proxypools"))
        .expect("the ProxyPool CRD");
    let yaml = pool.contents;
    assert!(yaml.contains("shortNames:\n    - pxp\n"), "short name pxp");
    assert!(yaml.contains("categories:\n    - egress\n"), "category egress");
    assert!(
        yaml.contains(
            "subresources:\n      scale:\n        labelSelectorPath: .status.selector\n        specReplicasPath: \
             .spec.replicas\n        statusReplicasPath: .status.replicas\n      status: {}"
        ),
        "scale and status subresources"
    );
    assert!(yaml.matches("rule:").count() >= 9, "every bound has its CEL rule");
}
