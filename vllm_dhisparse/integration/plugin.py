"""``vllm.general_plugins`` entry point (setup.py: ``dhisparse``).

vLLM calls :func:`register` in every process it starts (engine core, workers, API
server) via ``vllm.plugins.load_general_plugins``, so it is idempotent and cheap, and
it never raises: a piece that cannot apply is recorded, and an engine that uses the
connector stops at start-up with it (extension_points.py).
"""


def register() -> None:
    from .extension_points import apply_all

    apply_all()
