"""``vllm.general_plugins`` entry point (setup.py: ``dhisparse``).

vLLM calls :func:`register` in every process it starts (engine core,
workers, API server) via ``vllm.plugins.load_general_plugins``, so it must be
idempotent and cheap.
"""

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

CONNECTOR_NAME = "DHiSparseConnector"
CONNECTOR_MODULE = "vllm_dhisparse.integration.connector"
CONNECTOR_CLASS = "DHiSparseConnector"


def register() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_dhisparse.compat import apply_cpu_compat

        apply_cpu_compat()
    _register_connector()
    _install_kv_spec()
    _install_draft_ring()
    _install_budget()


def _install_budget() -> None:
    # The hierarchy's device pools are counted inside vLLM's KV budget (worker process).
    from .pool_sizing import install_budget

    install_budget()


def _install_kv_spec() -> None:
    # The windowed c4a spec must be known in the engine-core process (scheduler)
    # and the worker; it only takes effect when DHiSparseConnector is configured.
    from .kv_spec import install

    install()


def _install_draft_ring() -> None:
    # DSpark / DFlash2 drafter layers get the window-bounded draft ring (scheduler: the
    # spec's manager; worker: Model Runner V2's spec of the drafter's layers).
    from .draft_ring import install

    install()


def _register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # register_connector raises ValueError on a duplicate name; register()
    # runs once per load_general_plugins() call, several times per process.
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    # Lazy: only the module path is stored; it is imported on first use.
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS
    )
    logger.debug("Registered KV connector %s -> %s", CONNECTOR_NAME, CONNECTOR_MODULE)
