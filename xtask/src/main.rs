//! `cargo xtask`: the project's automation, written in Rust so it runs wherever cargo does.
//!
//! Each subcommand lives in its own module; this file only parses the command line and dispatches.

mod bench;
mod crdgen;
mod e2e;
mod envtest;
mod guest;
mod helm;
mod image;
mod leftovers;
mod node;
mod podnet;
mod process;
mod python;
mod quickstart;
mod test;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use xtask_bootstrap::packages;

/// Project automation for egress-operator.
#[derive(Parser)]
#[command(name = "cargo xtask", about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write the generated files (CRD YAML under crds/, docs/discovery-openapi.json, the providers file's schema), or
    /// check that they are current.
    Crdgen {
        /// Do not write: exit non-zero and name each stale file when crds/ differs from the Rust types.
        #[arg(long)]
        check: bool,
    },
    /// Build the test control plane (kube-apiserver and etcd) into the cache directory, or keep one running.
    Envtest {
        /// Start a control plane with the CRDs installed, print its kubeconfig path, and keep it up until Ctrl-C.
        #[arg(long)]
        up: bool,
        /// With --up: also write the kubeconfig to this path.
        #[arg(long, requires = "up")]
        kubeconfig: Option<PathBuf>,
        /// With --up: do not create the sample Proxies.
        #[arg(long, requires = "up")]
        no_sample: bool,
        /// With --up: also run the reconciler with a kubernetes provider `pods` and the local node agent (needs
        /// Squid), so Managed Proxies run for real.
        #[arg(long, requires = "up")]
        controller: bool,
    },
    /// Build the kvm boot test's Debian guest image into the cache (nothing when the recipe's image is there) and
    /// print its path.
    GuestImage,
    /// Build the OCI images into the cache with mmdebstrap and umoci, no registry or Docker daemon needed: the
    /// operator's (the release binary on Debian's libvirt0 and CA roots, no shell) and Squid's (Debian trixie's
    /// Squid 6); each is rebuilt only when what it is built from changes. Prints where they are.
    Image,
    /// Run the end-to-end suite: the operator binary under the shipped RBAC against the local control plane.
    E2e {
        /// Run it on a kind cluster (`egress-e2e`, created when missing) instead; needs Docker, kind and kubectl, and
        /// root to route the pod network.
        #[arg(long)]
        kind: bool,
        /// Arguments passed to `cargo test` (for example a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        cargo_test_args: Vec<String>,
    },
    /// Run the whole product on a local control plane with three sample Proxies, lease one and fetch through it.
    Quickstart {
        /// Stop after the demo instead of running until Ctrl-C.
        #[arg(long)]
        exit: bool,
        /// Internal: run the demo in this network namespace, reporting through this directory.
        #[arg(long, hide = true)]
        inside: Option<PathBuf>,
        /// Internal: the operator is built already (by `cargo xtask test`'s test build); skip set-up and build.
        #[arg(long, hide = true)]
        built: bool,
    },
    /// Run the benchmarks (health, lease, discovery, gateway, fleet; all without a name) and print their figures.
    Bench {
        /// Which benchmark.
        name: Option<String>,
        /// The fleet benchmark's sizes (Proxy counts; default 100 and 1000).
        sizes: Vec<String>,
    },
    /// Install what is missing, then run formatting, lints, the CRD drift check and every test.
    Test {
        /// Arguments passed to `cargo test` after the workspace selection (for example a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        cargo_test_args: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Crdgen { check } => crdgen::run(check),
        Command::Envtest { up: false, .. } => envtest::ensure_built().map(|dir| println!("{}", dir.display())),
        Command::Envtest { up: true, kubeconfig, no_sample, controller } => {
            envtest::up(kubeconfig, !no_sample, controller)
        }
        Command::GuestImage => guest::ensure_built().map(|path| println!("{}", path.display())),
        Command::Image => image::ensure_built(),
        Command::Test { cargo_test_args } => test::run_all(&cargo_test_args),
        Command::Quickstart { exit, inside, built: false } => quickstart::run(exit, inside),
        Command::Quickstart { exit, inside, built: true } => quickstart::run_built(exit, inside),
        Command::E2e { kind, cargo_test_args } => e2e::run_suite(kind, &cargo_test_args),
        Command::Bench { name, sizes } => bench::run_benches(name.as_deref(), &sizes),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: xtask's manifest sits one level below it.
fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().map(PathBuf::from).unwrap_or(manifest_dir)
}
