"""One typed error family for the whole project.

Every error carries a stable ``code`` string and an ``exit_code`` used by the CLI, plus an optional
``path`` and byte ``offset`` where they apply. Parsers never let ``ValueError``/``KeyError``/... escape:
they wrap them in one of these.
"""

from __future__ import annotations


class PolyError(Exception):
    """Base of every error raised on purpose by poly, entity and lucy."""

    code = "poly_error"
    exit_code = 1

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None):
        super().__init__(message)
        self.message = message
        self.path = None if path is None else str(path)
        self.offset = offset

    def __str__(self) -> str:
        where = ""
        if self.path is not None:
            where = (
                f" [{self.path}" + (f" @ {self.offset}" if self.offset is not None else "") + "]"
            )
        return f"{self.message}{where}"


# --- configuration of objects built in code -------------------------------------------------


class DTypeError(PolyError, ValueError):
    code = "bad_dtype"
    exit_code = 2


class LayerConfigError(PolyError, ValueError):
    code = "bad_layer_config"
    exit_code = 2


class TensorParallelError(LayerConfigError):
    """A model cannot be split over the asked number of ranks (heads, blocks), or the ranks
    disagree (world size, model)."""

    code = "tensor_parallel"


class PeerLostError(TensorParallelError):
    """A rank of a tensor-parallel job died or stopped answering: a collective (or the idle
    heartbeat) outlived its deadline, or a watchdog saw the process gone."""

    code = "rank_lost"
    exit_code = 1


class UsageError(PolyError, ValueError):
    """A bad argument given to the CLI or the menu."""

    code = "usage"
    exit_code = 2


class ModelNotFoundError(PolyError):
    code = "not_found"
    exit_code = 3


class NoNetworkError(ModelNotFoundError):
    """A download failed: the Hub or the package index cannot be reached (offline machine,
    HF_HUB_OFFLINE, a proxy). A ModelNotFoundError too: the model is not here either."""

    code = "no_network"
    exit_code = 10


# --- checkpoints (reading, converting, writing) ----------------------------------------------


class CheckpointError(PolyError):
    code = "checkpoint_error"
    exit_code = 4


class UnsafeFormatError(CheckpointError):
    """A format that can run code (pickle, remote code); never loaded."""

    code = "unsafe_format"


class FormatError(CheckpointError):
    code = "bad_format"


class SafetensorsFormatError(FormatError):
    code = "bad_safetensors"


class GGUFFormatError(FormatError):
    code = "bad_gguf"


class EntityFormatError(FormatError):
    code = "bad_entity"


class ConfigError(FormatError):
    code = "bad_config"


class TokenizerError(FormatError):
    code = "bad_tokenizer"


class TemplateError(FormatError):
    code = "bad_template"


class TemplateSecurityError(TemplateError):
    """A chat template tried to reach Python internals; nothing was run."""

    code = "unsafe_template"


class WeightMappingError(FormatError):
    """A tensor is missing, unexpected, or has the wrong shape."""

    code = "weight_mapping"


class StateFileError(FormatError):
    """A saved KV state file (Transformer.save_state) is damaged, truncated or not one."""

    code = "bad_state"


class StateMismatchError(StateFileError):
    """A saved KV state belongs to another model (architecture, weights, KV dtype, context)."""

    code = "state_mismatch"


class LimitExceededError(CheckpointError):
    code = "limit_exceeded"


class IntegrityError(CheckpointError):
    """Checksums or sizes do not match: the file is damaged."""

    code = "integrity"
    exit_code = 6


class ModelFileChangedError(IntegrityError):
    """A loaded model's file was rewritten or truncated on disk since it was loaded (``cp`` over
    it, a truncation): the bytes still on it are not the model's; restart to load it again."""

    code = "file_changed"


class UnsupportedError(CheckpointError):
    code = "unsupported"
    exit_code = 5


class ConversionError(CheckpointError):
    code = "conversion_failed"


class OutputExistsError(CheckpointError):
    code = "output_exists"
    exit_code = 7


class InsufficientSpaceError(CheckpointError):
    code = "no_space"
    exit_code = 9


class OutputPathError(CheckpointError):
    code = "bad_output_path"
    exit_code = 9


# --- inference ---------------------------------------------------------------------------------


class GenerationError(PolyError):
    code = "generation_error"
    exit_code = 8


class ContextOverflowError(GenerationError):
    code = "context_overflow"


class InvalidTokenError(GenerationError):
    code = "invalid_token"


class NumericalError(GenerationError):
    code = "numerical"


class ModelBusyError(GenerationError):
    code = "model_busy"


class QueueFullError(GenerationError):
    """The serving scheduler's queue is full: retry later (HTTP 429/503)."""

    code = "queue_full"


class SamplingParamsError(PolyError, ValueError):
    code = "bad_sampling_params"
    exit_code = 2


class SpeculationError(SamplingParamsError):
    """Speculative decoding options: N out of range, a draft whose vocabulary differs."""

    code = "bad_speculation"


# Exit codes documented for the CLI (docs/lucy.md).
EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "other error",
    2: "bad usage, option or parameter",
    3: "model or file not found",
    4: "bad or corrupt input file (format, config, tokenizer, template, weights)",
    5: "unsupported architecture, dtype or feature",
    6: "integrity check failed (checksum, size)",
    7: "output exists (use --force)",
    8: "generation error (context overflow, invalid token, NaN logits, busy)",
    9: "cannot write output (disk full, read-only, missing dir)",
    10: "download failed: no network (the Hub or PyPI cannot be reached)",
    130: "interrupted",
}
