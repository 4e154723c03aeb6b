"""The client as a user installs it: `python -m build` makes a wheel and an sdist, and the wheel installs into a
clean venv (from the test venv's wheelhouse, with no index) and imports, typed."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

WHEELHOUSE = os.environ.get("EGRESS_WHEELHOUSE", "")

pytestmark = pytest.mark.skipif(not WHEELHOUSE, reason="needs the test venv's wheelhouse: run through `cargo xtask test`")


def run(*command: str, cwd: pathlib.Path) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def test_the_built_wheel_installs_into_a_clean_venv_and_imports() -> None:
    project = pathlib.Path(__file__).parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        dist = pathlib.Path(tmp) / "dist"
        run(sys.executable, "-m", "build", "--wheel", "--sdist", "--no-isolation", "--outdir", str(dist), ".", cwd=project)
        wheels = sorted(dist.glob("egress_operator_client-*.whl"))
        assert wheels and sorted(dist.glob("egress_operator_client-*.tar.gz")), list(dist.iterdir())
        clean = pathlib.Path(tmp) / "clean"
        run(sys.executable, "-m", "venv", str(clean), cwd=project)
        run(
            str(clean / "bin/pip"), "install", "--quiet", "--no-index", "--find-links", WHEELHOUSE, str(wheels[0]),
            cwd=pathlib.Path(tmp),
        )
        out = run(
            str(clean / "bin/python"),
            "-c",
            "import importlib.resources, egress_client; "
            "print(egress_client.__version__, egress_client.DiscoveryClient.__name__, "
            "importlib.resources.files('egress_client').joinpath('py.typed').is_file())",
            cwd=pathlib.Path(tmp),
        )
        assert out.split() == ["0.1.0", "DiscoveryClient", "True"], out


def test_the_documented_install_from_a_checkout_works_in_a_clean_venv() -> None:
    """`pip install "./clients/python[scrapy]"`, as docs/clients.md says (the package is not on an index): pip builds
    it with its declared backend and installs Scrapy with it; here with no index, from the wheelhouse."""
    project = pathlib.Path(__file__).parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        clean = pathlib.Path(tmp) / "clean"
        run(sys.executable, "-m", "venv", str(clean), cwd=pathlib.Path(tmp))
        # A copy, so the build leaves nothing in the checkout.
        checkout = pathlib.Path(tmp) / "python"
        subprocess.run(["cp", "-r", str(project), str(checkout)], check=True)
        run(
            str(clean / "bin/pip"), "install", "--quiet", "--no-index", "--find-links", WHEELHOUSE, f"{checkout}[scrapy]",
            cwd=pathlib.Path(tmp),
        )
        out = run(
            str(clean / "bin/python"),
            "-c",
            "import scrapy, egress_client.scrapy as m; print(m.EgressProxyMiddleware.__name__, scrapy.__version__)",
            cwd=pathlib.Path(tmp),
        )
        name, version = out.split()
        major, minor = (int(part) for part in version.split(".")[:2])
        assert name == "EgressProxyMiddleware" and (major, minor) >= (2, 13), out
