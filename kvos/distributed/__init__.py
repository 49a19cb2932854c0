"""Several engines behind one endpoint: engine actors on Ray (``worker``), the routing front end
(``dp_engine``, the server's async engine) and ``DataParallelLLM`` (blocking, for Python).
Ray is imported only when one is made."""
from kvos.distributed.dp_engine import DataParallelEngine
from kvos.distributed.llm import DataParallelLLM

__all__ = ["DataParallelEngine", "DataParallelLLM"]
