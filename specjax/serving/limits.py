"""The server's request limits (`ServerLimits`), validated on construction."""
from __future__ import annotations

import dataclasses

DEFAULT_MAX_WAITING = 512


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Request limits. None: derived from the engine (max_model_len - 1); max_waiting None: unbounded."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    request_timeout_s: float = 600.0
    max_waiting: int | None = DEFAULT_MAX_WAITING

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("max_prompt_tokens", "max_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {v}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {self.max_waiting}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


__all__ = ["DEFAULT_MAX_WAITING", "ServerLimits"]
