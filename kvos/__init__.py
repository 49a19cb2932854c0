"""kvos: an LLM inference engine built around the KV cache as virtual memory."""
from kvos.core.outputs import CompletionOutput, RequestOutput
from kvos.core.sampling_params import SamplingParams
from kvos.core.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # torch is imported only when the engine is used
        from kvos.engine.llm import LLM

        return LLM
    raise AttributeError(name)
