"""An OpenAI-compatible gateway in front of a rollway engine: external agent programs call it, and every
call is captured token-exact and recorded in the log before it is answered."""

from rollway.gateway.capture import EpisodeCapture
from rollway.gateway.protocol import RequestError
from rollway.gateway.recorder import CallRecorder, KafkaRecorder, MemoryRecorder, RecordFailed, RecordTooLarge
from rollway.gateway.server import EpisodeHandle, Gateway
from rollway.gateway.trajectory import CallLogError, Segment, rebuild_segments

__all__ = ["CallLogError", "CallRecorder", "EpisodeCapture", "EpisodeHandle", "Gateway", "KafkaRecorder",
           "MemoryRecorder", "RecordFailed", "RecordTooLarge", "RequestError", "Segment", "rebuild_segments"]
