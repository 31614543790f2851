"""tokengate: token-metered gateway for self-hosted LLMs (Python side)."""
