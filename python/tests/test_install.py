"""The plugin as a user installs it: one pip command into a fresh venv builds and bundles
libkvxfer.so, and vLLM's factory finds the connector by module path with no KVXFER_LIB; a
library that cannot be loaded is an ImportError that says what to install."""

import os
import subprocess
import sys
import sysconfig
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("KVXFER_LIB", "KVXFER_SKIP_NATIVE", "PYTHONPATH")}
    env.update(extra)
    return env


def test_one_pip_install_then_vllm_finds_the_connector_without_kvxfer_lib(tmp_path):
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # The one command. The release build goes to target/pip (reused across runs).
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", os.path.join(ROOT, "python")],
        check=True,
        env=_env(KVXFER_BUILD_TARGET_DIR=os.path.join(ROOT, "target", "pip")),
    )
    # vLLM itself (9 GB) comes from the development venv through a path entry, after the
    # fresh venv's own site-packages, so kvxfer_vllm is the freshly installed one.
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    with open(os.path.join(site, "zz_vllm_from_dev_venv.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    script = textwrap.dedent(f"""
        import os, sys
        assert "KVXFER_LIB" not in os.environ
        sys.path.insert(0, {HERE!r})
        import helpers as h
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        import kvxfer_vllm
        cls = KVConnectorFactory.get_connector_class(h.vllm_config().kv_transfer_config)
        print("CLASS", cls.__module__, cls.__name__)
        print("PACKAGE", kvxfer_vllm.__file__)
        print("LIB", kvxfer_vllm.Lib.get().path, kvxfer_vllm.Lib.get().version())
    """)
    out = subprocess.run([str(py), "-c", script], capture_output=True, text=True, env=_env(), cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(l.split(" ", 1) for l in out.stdout.splitlines() if l.split(" ", 1)[0] in ("CLASS", "PACKAGE", "LIB"))
    assert lines["CLASS"] == "kvxfer_vllm.connector KvxferConnector", out.stdout
    assert lines["PACKAGE"].startswith(str(venv)), out.stdout
    assert lines["LIB"].startswith(os.path.join(site, "kvxfer_vllm", "libkvxfer.so")), out.stdout


def test_an_unloadable_library_is_an_import_error_naming_what_to_install():
    out = subprocess.run(
        [sys.executable, "-c", "import kvxfer_vllm"],
        capture_output=True, text=True, env=_env(KVXFER_LIB="/nonexistent/libkvxfer.so"),
    )
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "cannot load libkvxfer" in out.stderr, out.stderr
    assert "pip install" in out.stderr and "libucx-dev" in out.stderr, out.stderr
