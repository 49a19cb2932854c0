"""Several engines behind one endpoint: engines as Ray actors or local processes (``engines``,
``worker``), the routing front end (``dp_engine``, the server's async engine) and
``DataParallelLLM`` (blocking, for Python). Ray is imported only when its transport is used."""
from kvos.distributed.dp_engine import DataParallelEngine
from kvos.distributed.llm import DataParallelLLM

__all__ = ["DataParallelEngine", "DataParallelLLM"]
