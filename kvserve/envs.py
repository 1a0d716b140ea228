"""Every environment variable kvserve reads, each read when its function is called (never at import)."""
from __future__ import annotations

import os


def api_keys() -> tuple[str, ...]:
    """KVSERVE_API_KEY: API keys the server accepts when --api-key is not given (comma-separated)."""
    return tuple(k.strip() for k in os.environ.get("KVSERVE_API_KEY", "").split(",") if k.strip())
