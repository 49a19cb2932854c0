"""Several engines behind one endpoint: engine actors on Ray (``worker``) and the routing front
end (``dp_engine``). Ray is imported only when a ``DataParallelEngine`` is made."""
from kvos.distributed.dp_engine import DataParallelEngine

__all__ = ["DataParallelEngine"]
