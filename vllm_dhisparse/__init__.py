__version__ = "0.1.0"

from .engine_args import engine_args, server_args  # noqa: E402,F401
