"""vLLM KV connector over kvxfer.

Load it with::

    --kv-transfer-config '{"kv_connector":"KvxferConnector",
                           "kv_connector_module_path":"kvxfer_vllm","kv_role":"kv_both"}'

libkvxfer.so is the one ``pip install`` bundled next to this package, or ``KVXFER_LIB`` (an
override), or the system loader's. It is loaded at import, so a missing or unloadable library
is an ImportError that says what to install.
"""

from .lib import KvxferError, Lib  # noqa: F401

Lib.get()


def __getattr__(name):
    # vLLM is imported only when the connector class is asked for, so that the C bindings
    # work (and are testable) without vLLM.
    if name in ("KvxferConnector", "KvxferConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(name)
