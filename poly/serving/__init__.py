"""Serving: a continuous-batching scheduler over one model, without HTTP (``lucy serve`` is the
HTTP front end). See docs/serve.md."""

from poly.serving.handle import Choice, Completion, RequestDone, RequestFailed, RequestHandle, Usage
from poly.serving.params import SamplingParams
from poly.serving.scheduler import Scheduler
from poly.serving.sequence import TokenLogprob, TokenOut

__all__ = [
    "Choice",
    "Completion",
    "RequestDone",
    "RequestFailed",
    "RequestHandle",
    "SamplingParams",
    "Scheduler",
    "TokenLogprob",
    "TokenOut",
    "Usage",
]
