"""pdserve: disaggregated prefill/decode LLM serving."""

from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
