"""ktd — an LLM inference daemon for on-prem, air-gapped and edge Linux servers.

Python owns I/O, policy and lifecycle; the native core (``ktd._native``, C++) owns everything
per token. Importing ktd is cheap: nothing heavy runs at import time.
"""

__version__ = "0.1.0"

from ktd._native import GGUFError, ResourceError  # noqa: E402  (native exception types)

__all__ = ["GGUFError", "ResourceError", "__version__"]
