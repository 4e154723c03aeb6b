//! Every YAML example in `README.md` and `docs/` is what it says it is: each Kubernetes object passes a server-side
//! dry-run create on the test control plane (with this repository's CRDs), and each providers file passes the
//! operator's own parser. An example the apiserver or the operator would reject fails here, naming its file and line.
//! The code map and the line limit of production files (`docs/architecture.md`) are held here too.

use std::path::{Path, PathBuf};

use egress_provider::config::ProvidersConfig;
use kube::api::{Api, DynamicObject, GroupVersionKind, PostParams};
use kube::discovery::{Scope, pinned_kind};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `README.md` and every Markdown file under `docs/`.
fn documents() -> Vec<PathBuf> {
    let mut found = vec![root().join("README.md")];
    let mut pending = vec![root().join("docs")];
    while let Some(directory) = pending.pop() {
        for entry in std::fs::read_dir(&directory).expect("read docs/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|extension| extension == "md") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The ```` ```yaml ```` blocks of `text`, each with the line its fence is on, dedented by the fence's indentation
/// (a block inside a list item is indented).
fn yaml_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, usize, String)> = None;
    for (index, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        match &mut open {
            None if line.trim_start() == "```yaml" => open = Some((index + 1, indent, String::new())),
            None => {}
            Some((start, _, body)) if line.trim_start() == "```" => {
                blocks.push((*start, std::mem::take(body)));
                open = None;
            }
            Some((_, fence, body)) => {
                body.push_str(line.get(*fence..).unwrap_or_else(|| line.trim_start()));
                body.push('\n');
            }
        }
    }
    assert!(open.is_none(), "a ```yaml block is never closed");
    blocks
}

/// Why the apiserver refused `object` in a server-side dry-run, if it did.
async fn dry_run(client: &kube::Client, namespace: &str, mut object: Value) -> Result<(), String> {
    let api_version = object["apiVersion"].as_str().ok_or("no apiVersion")?.to_owned();
    let kind = object["kind"].as_str().ok_or("no kind")?.to_owned();
    let (group, version) = api_version.split_once('/').unwrap_or(("", &api_version));
    let gvk = GroupVersionKind::gvk(group, version, &kind);
    let (resource, capabilities) =
        pinned_kind(client, &gvk).await.map_err(|error| format!("{api_version} {kind} is unknown: {error}"))?;
    let api: Api<DynamicObject> = if capabilities.scope == Scope::Namespaced {
        // The test's own namespace, whatever the example names: the dry-run checks the object, not the namespace.
        object["metadata"]["namespace"] = Value::from(namespace);
        Api::namespaced_with(client.clone(), namespace, &resource)
    } else {
        Api::all_with(client.clone(), &resource)
    };
    let object: DynamicObject = serde_json::from_value(object).map_err(|error| format!("not an object: {error}"))?;
    let params = PostParams { dry_run: true, ..PostParams::default() };
    api.create(&params, &object).await.map(|_| ()).map_err(|error| error.to_string())
}

#[tokio::test]
async fn every_yaml_example_in_the_docs_is_accepted() {
    let ns = egress_testenv::namespace("docs-examples").await;
    let client = ns.client();
    let (mut objects, mut providers_files, mut refused) = (0, 0, Vec::new());
    let published = std::fs::read_to_string(root().join("docs/providers/providers.schema.json")).expect("the schema");
    let published: Value = serde_json::from_str(&published).expect("the schema is JSON");
    for path in documents() {
        let text = std::fs::read_to_string(&path).expect("read a document");
        let shown = path.strip_prefix(root()).unwrap_or(&path).display().to_string();
        for (line, block) in yaml_blocks(&text) {
            let at = format!("{shown}:{line}");
            for document in block.split("\n---\n").filter(|document| !document.trim().is_empty()) {
                let value: Value = match serde_saphyr::from_str(document) {
                    Ok(value) => value,
                    Err(error) => {
                        refused.push(format!("{at}: not valid YAML: {error}"));
                        continue;
                    }
                };
                if value.get("providers").is_some() {
                    providers_files += 1;
                    if let Err(error) =
                        ProvidersConfig::parse(document, &at, egress_runtime::provider_types().settings())
                    {
                        refused.push(format!("{at}: the operator refuses this providers file: {error}"));
                    }
                    for problem in egress_provider::config::schema::problems(&published, value) {
                        refused.push(format!("{at}: docs/providers/providers.schema.json refuses {problem}"));
                    }
                } else if value["apiVersion"].as_str().is_some_and(|api| api.starts_with("kustomize.config.k8s.io/")) {
                    // An overlay beside deploy/default: what it builds on must be there, and it must build.
                    objects += 1;
                    let mut beside_deploy = true;
                    for field in ["resources", "components"] {
                        for entry in value[field].as_array().into_iter().flatten().filter_map(Value::as_str) {
                            let beside = entry.strip_prefix("../").map(|rest| root().join("deploy").join(rest));
                            if !beside.is_some_and(|path| path.is_dir()) {
                                beside_deploy = false;
                                refused
                                    .push(format!("{at}: {field} names {entry}, which is not a directory of deploy/"));
                            }
                        }
                    }
                    if beside_deploy && let Err(error) = kustomize_beside_deploy(document) {
                        refused.push(format!("{at}: `kubectl kustomize` of this overlay fails: {error}"));
                    }
                } else if value.get("apiVersion").is_some() && value.get("kind").is_some() {
                    objects += 1;
                    if let Err(error) = dry_run(&client, ns.name(), value).await {
                        refused.push(format!("{at}: the apiserver refuses this object: {error}"));
                    }
                } else {
                    refused.push(format!("{at}: neither a Kubernetes object nor a providers file"));
                }
            }
        }
    }
    eprintln!("docs: {objects} Kubernetes objects dry-run and {providers_files} providers files parsed");
    let bad = serde_json::json!({ "providers": [{ "name": "Bad_Name", "type": "kubernetes", "zone": "x" }] });
    assert_eq!(egress_provider::config::schema::problems(&published, bad).len(), 2, "the schema check is not vacuous");
    assert!(refused.is_empty(), "examples that would be refused:\n{}", refused.join("\n"));
    assert!(
        objects >= 4 && providers_files >= 4,
        "the examples were not found: {objects} objects, {providers_files} providers files"
    );
}

#[test]
fn yaml_blocks_are_found_dedented_with_their_line() {
    let text = "intro\n```yaml\na: 1\n```\n- item:\n\n  ```yaml\n  b: 2\n  c: [3]\n  ```\n```sh\nd\n```\n";
    assert_eq!(yaml_blocks(text), [(2, "a: 1\n".to_owned()), (7, "b: 2\nc: [3]\n".to_owned())]);
}

/// The code map in `docs/architecture.md` is the workspace: one section headed `` `path` (package) `` per member
/// of the root `Cargo.toml`, with the path and package name `cargo metadata` gives, and none for a crate that is
/// gone (the clients under `clients/` and the directories of files, such as `crds/` and `deploy/`, are not Cargo
/// packages and are left out of the comparison).
#[test]
fn the_code_map_is_the_workspace() {
    let output = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline", "--locked"])
        .current_dir(root())
        .output()
        .expect("running cargo metadata");
    assert!(output.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&output.stderr));
    let metadata: Value = serde_json::from_slice(&output.stdout).expect("cargo metadata's JSON");
    let workspace = Path::new(metadata["workspace_root"].as_str().expect("workspace_root"));
    let members: std::collections::BTreeSet<(String, String)> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|package| {
            let manifest = Path::new(package["manifest_path"].as_str().expect("manifest_path"));
            let directory = manifest.parent().expect("a manifest's directory").strip_prefix(workspace).expect("inside");
            (directory.display().to_string(), package["name"].as_str().expect("name").to_owned())
        })
        .collect();
    let text = std::fs::read_to_string(root().join("docs/architecture.md")).expect("docs/architecture.md");
    let code_map = text.split("\n## Code map\n").nth(1).expect("a Code map section");
    let code_map = code_map.split("\n## ").next().unwrap_or_default();
    let sections: std::collections::BTreeSet<(String, String)> = code_map
        .lines()
        .filter_map(|line| line.strip_prefix("### `"))
        .filter_map(|heading| {
            let (path, rest) = heading.split_once('`')?;
            let name = rest.trim().strip_prefix('(').and_then(|rest| rest.split([' ', ')']).next()).unwrap_or(path);
            Some((path.to_owned(), name.to_owned()))
        })
        .filter(|(path, _)| !path.starts_with("clients/") && !path.ends_with('/'))
        .collect();
    assert_eq!(sections, members, "the code map's sections (left) against the workspace's packages (right)");
}

/// The longest a production source file may be (`docs/architecture.md`, "Architecture invariants").
const MAX_PRODUCTION_LINES: usize = 800;

/// Every production source file: every `.rs` file under a `src/` of `crates/` and `bins/`, but for the test-support
/// crate `egress-testenv` and unit-test modules in files of their own (`tests.rs`).
fn production_files() -> Vec<PathBuf> {
    let mut pending: Vec<PathBuf> = ["crates", "bins"]
        .iter()
        .flat_map(|top| std::fs::read_dir(root().join(top)).expect("a workspace directory"))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|package| package.file_name().is_some_and(|name| name != "testenv"))
        .map(|package| package.join("src"))
        .filter(|src| src.is_dir())
        .collect();
    let mut files = Vec::new();
    while let Some(directory) = pending.pop() {
        for entry in std::fs::read_dir(&directory).expect("read a source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|extension| extension == "rs")
                && path.file_name().is_some_and(|name| name != "tests.rs")
            {
                files.push(path);
            }
        }
    }
    assert!(files.len() > 100, "only {} production files found: is the walk looking in the right place?", files.len());
    files
}

/// No production source file is longer than [`MAX_PRODUCTION_LINES`]. A file that grows past it is split by
/// concern, as the controllers and the gateway's server were.
#[test]
fn no_production_file_is_over_800_lines() {
    let mut over = Vec::new();
    for path in production_files() {
        let lines = std::fs::read_to_string(&path).expect("a source file").lines().count();
        if lines > MAX_PRODUCTION_LINES {
            over.push(format!("{} ({lines} lines)", path.strip_prefix(root()).unwrap_or(&path).display()));
        }
    }
    assert!(over.is_empty(), "production files over {MAX_PRODUCTION_LINES} lines: {over:?}");
}

/// No production module glob-imports another (`use super::*`, `use child::*`, `pub use child::*`): a file says by
/// name what it takes from its parent and siblings, so a reader sees what it uses (conventions; #45). Test modules
/// inside a file are indented, and test modules in files of their own are not production files.
#[test]
fn no_production_module_glob_imports_another() {
    let mut globs = Vec::new();
    for path in production_files() {
        let text = std::fs::read_to_string(&path).expect("a source file");
        for (number, line) in text.lines().enumerate() {
            let import = line.strip_prefix("pub ").or_else(|| line.strip_prefix("pub(crate) ")).unwrap_or(line);
            if import.starts_with("use ") && import.trim_end().ends_with("::*;") {
                globs.push(format!("{}:{}: {line}", path.strip_prefix(root()).unwrap_or(&path).display(), number + 1));
            }
        }
    }
    assert!(globs.is_empty(), "glob imports between production modules: {globs:#?}");
}

/// `docs/benchmarks.md`'s table names every benchmark `cargo xtask bench` runs, by its name and its package and
/// target, and no other: the list in `xtask/src/bench.rs` (`BENCHES`) is the truth.
#[test]
fn the_benchmarks_page_lists_what_cargo_xtask_bench_runs() {
    let source = std::fs::read_to_string(root().join("xtask/src/bench.rs")).expect("xtask/src/bench.rs");
    let list = source.split_once("const BENCHES").expect("the BENCHES list").1;
    let list = &list[..list.find("];").expect("the end of the BENCHES list")];
    let quoted = |text: &str| -> Vec<String> { text.split('"').skip(1).step_by(2).map(str::to_owned).collect() };
    let mut run: Vec<(String, String, String)> = list
        .lines()
        .map(str::trim)
        .filter(|line| line.starts_with("(\""))
        .map(|line| match quoted(line).as_slice() {
            [name, package, target] => (name.clone(), package.clone(), target.clone()),
            other => panic!("a BENCHES entry of three strings, not {other:?}"),
        })
        .collect();
    assert!(run.len() >= 6, "only {} benchmarks read from xtask/src/bench.rs", run.len());
    let page = std::fs::read_to_string(root().join("docs/benchmarks.md")).expect("docs/benchmarks.md");
    let ticked = |cell: &str| -> Vec<String> { cell.split('`').skip(1).step_by(2).map(str::to_owned).collect() };
    let table = page.split_once("| --- |").expect("the figures table").1;
    let mut listed: Vec<(String, String, String)> = table
        .lines()
        .skip(1)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            match (ticked(cells[1]).as_slice(), ticked(cells[2]).as_slice()) {
                ([name], [package, target]) => (name.clone(), package.clone(), target.clone()),
                other => panic!("a row names `bench` and `package`, `target`: {line} ({other:?})"),
            }
        })
        .collect();
    run.sort();
    listed.sort();
    assert_eq!(listed, run, "docs/benchmarks.md's table and cargo xtask bench's list differ");
}

/// Builds the overlay `kustomization` (whose `../` entries name directories of `deploy/`) with the real
/// `kubectl kustomize`, from a directory of its own; the error kustomize prints when it fails.
fn kustomize_beside_deploy(kustomization: &str) -> Result<(), String> {
    let dir = tempfile::Builder::new().prefix("egress-docs-overlay-").tempdir().map_err(|error| error.to_string())?;
    let deploy = std::fs::canonicalize(root().join("deploy")).map_err(|error| error.to_string())?;
    let relative = egress_testenv::install::relative_path(dir.path(), &deploy);
    let text = kustomization.replace("- ../", &format!("- {}/", relative.display()));
    std::fs::write(dir.path().join("kustomization.yaml"), text).map_err(|error| error.to_string())?;
    let output = std::process::Command::new(egress_testenv::assets::kubectl())
        .arg("kustomize")
        .arg(dir.path())
        .output()
        .map_err(|error| error.to_string())?;
    if output.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&output.stderr).trim().to_owned()) }
}
