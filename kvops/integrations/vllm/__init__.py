"""kvops inside vLLM: a plugin (entry point ``vllm.general_plugins``, ``kvops = kvops.integrations.vllm:register``).

``register()`` makes two names known to vLLM: ``spec_name="KvopsOffloadingSpec"`` to its ``OffloadingSpecFactory``,
so the OffloadingConnector can keep its host tier as kvops cold pages (``offloading.KvopsOffloadingSpec``), and
``kv_connector="KvopsEvictionConnector"`` to its ``KVConnectorFactory``: TriAttention eviction compacted in place in
vLLM's own cache (``eviction.KvopsEvictionConnector``). Importing this package imports neither vLLM nor torch;
docs/vllm.md says how to turn them on.
"""

SPEC_NAME = "KvopsOffloadingSpec"
CONNECTOR_NAME = "KvopsEvictionConnector"
# the minor releases whose offloading and connector APIs (vllm.v1.kv_offload, KVConnectorBase_V1) and model runner
# (the eviction's patches) this plugin is built on
SUPPORTED_VLLM = ("0.32",)


def check_vllm_version() -> str:
    """The installed vLLM's version; RuntimeError naming it when the plugin does not know that release."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise RuntimeError(f"kvops.integrations.vllm supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}; "
                           f"this is vLLM {version}, whose offloading, connector and model-runner internals it does not know")
    return version


def register() -> None:
    """The vLLM plugin entry point (vLLM calls it once in every process)."""
    check_vllm_version()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    # both factories refuse a name twice
    if SPEC_NAME not in OffloadingSpecFactory._registry:
        OffloadingSpecFactory.register_spec(SPEC_NAME, f"{__name__}.offloading", SPEC_NAME)
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, f"{__name__}.eviction", CONNECTOR_NAME)
