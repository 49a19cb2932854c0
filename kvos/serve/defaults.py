"""The server's limits and timeouts by default: plain constants, importable without the HTTP stack
(the CLI builds its parser from them on machines without uvicorn)."""

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_MAX_HEADER_BYTES = 32 << 10
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
