"""vLLM KV connector over kvxfer.

Load it with::

    --kv-transfer-config '{"kv_connector":"KvxferConnector",
                           "kv_connector_module_path":"kvxfer_vllm","kv_role":"kv_both"}'

libkvxfer.so is found through ``KVXFER_LIB``, next to this package, or the system loader.
"""

from .lib import KvxferError, Lib  # noqa: F401


def __getattr__(name):
    # vLLM is imported only when the connector class is asked for, so that the C bindings
    # work (and are testable) without vLLM.
    if name in ("KvxferConnector", "KvxferConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(name)
