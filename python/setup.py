"""Builds libkvxfer.so (the C ABI crate, ../kvxfer-capi) with cargo and bundles it into the
package, so that ``pip install <kvxfer>/python`` (or a wheel from ``pip wheel``) gives a
working ``kv_connector_module_path: kvxfer_vllm`` with no environment variable.

Why a cargo call from setuptools and not maturin or PyO3: the plugin is plain Python over the
C ABI through ctypes, the same ABI C users link; the library is not a Python extension module,
so there is nothing for PyO3 to generate, and maturin wants the Python project at the crate's
root. Building needs cargo, pkg-config, libclang-dev and UCX's headers (Debian: libucx-dev),
as any kvxfer build does. ``KVXFER_FEATURES=etcd pip install ./python`` builds etcd discovery
in (it needs protoc too: Debian's protobuf-compiler). ``KVXFER_LIB`` still overrides the
bundled library at run time.
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        if os.environ.get("KVXFER_SKIP_NATIVE") == "1":
            # kvxfer's own development venv: the tests point KVXFER_LIB at a debug build.
            print("kvxfer: KVXFER_SKIP_NATIVE=1: libkvxfer.so not built or bundled")
            return
        manifest = os.path.join(ROOT, "kvxfer-capi", "Cargo.toml")
        if not os.path.exists(manifest):
            raise RuntimeError(f"kvxfer: {manifest} not found: build the plugin from a kvxfer checkout")
        if shutil.which("cargo") is None:
            raise RuntimeError("kvxfer: cargo is needed to build libkvxfer.so (https://rustup.rs)")
        target = os.environ.get("KVXFER_BUILD_TARGET_DIR", os.path.join(ROOT, "target", "pip"))
        env = dict(os.environ, CARGO_TARGET_DIR=target)
        # KVXFER_FEATURES=etcd (comma-separated) builds those features in: etcd discovery
        # (the plugin's "discovery" key; building it needs protoc, Debian's protobuf-compiler).
        features = [f.strip() for f in os.environ.get("KVXFER_FEATURES", "").split(",") if f.strip()]
        known = {"etcd", "cuda"}
        if set(features) - known:
            raise RuntimeError(f"kvxfer: KVXFER_FEATURES names {sorted(set(features) - known)}; known: {sorted(known)}")
        extra = ["--features", ",".join(features)] if features else []
        subprocess.run(
            ["cargo", "build", "--release", "--locked", "-p", "kvxfer-capi", "--manifest-path", os.path.join(ROOT, "Cargo.toml")] + extra,
            check=True,
            env=env,
        )
        dest = os.path.join(self.build_lib, "kvxfer_vllm")
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(os.path.join(target, "release", "libkvxfer.so"), os.path.join(dest, "libkvxfer.so"))


class PlatformWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False  # it carries a native library

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": PlatformWheel})
