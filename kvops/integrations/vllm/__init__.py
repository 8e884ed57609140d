"""kvops inside vLLM: a plugin (entry point ``vllm.general_plugins``, ``kvops = kvops.integrations.vllm:register``).

``register()`` makes ``spec_name="KvopsOffloadingSpec"`` known to vLLM's ``OffloadingSpecFactory``, so the
OffloadingConnector can keep its host tier as kvops cold pages (``offloading.KvopsOffloadingSpec``). Importing this
package imports neither vLLM nor torch; docs/vllm.md says how to turn it on.
"""

SPEC_NAME = "KvopsOffloadingSpec"
SUPPORTED_VLLM = ("0.32",)  # the minor releases whose offloading API (vllm.v1.kv_offload) this plugin is built on


def check_vllm_version() -> str:
    """The installed vLLM's version; RuntimeError naming it when the plugin does not know that release."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise RuntimeError(f"kvops.integrations.vllm supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}; "
                           f"this is vLLM {version}, whose offloading API it does not know")
    return version


def register() -> None:
    """The vLLM plugin entry point (vLLM calls it once in every process)."""
    check_vllm_version()
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if SPEC_NAME not in OffloadingSpecFactory._registry:  # register_spec refuses a name twice
        OffloadingSpecFactory.register_spec(SPEC_NAME, f"{__name__}.offloading", SPEC_NAME)
