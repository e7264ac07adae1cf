"""The spec's schema version, the bounds on every size a spec may hold, and its error type."""

from __future__ import annotations

from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import MODEL_DTYPES
from tqexport.validate import MAX_LAYERS

SCHEMA_VERSION = 1

# Bounds on every size a spec may hold: generous for any real model, small enough that nothing
# derived from a spec (codec tables, graph I/O lists, messages) can take unbounded time or memory.
# MAX_HEAD_SIZE lives with the codecs (every codec checks it), MAX_BLOCK_SIZE, MAX_LAYERS and
# MAX_RECENT_WINDOW with the argument checks of the command line (the same rules at build time).
#: bytes of a tqexport.json (a 1024-layer spec with a recent window is about 3 MiB)
MAX_SPEC_BYTES = 16 * 1024 * 1024
#: query heads and kv heads of a layer (the largest models have 128 query heads)
MAX_HEADS = 1024
MAX_KV_HEADS = 1024
#: sliding-window tokens (more than any model's context)
MAX_WINDOW = 1 << 24
#: the model's position limit, its config's max_position_embeddings (the longest contexts are
#: ~10M tokens)
MAX_POSITIONS = 1 << 40
#: vocabulary entries (0 = unknown; the largest vocabularies have ~260k)
MAX_VOCAB_SIZE = 1 << 24
#: characters of a name, path or version string
MAX_TEXT = 4096
#: ONNX opset the graph was exported with
MAX_OPSET = 99
#: digits of a JSON integer (Python would otherwise parse, and refuse to print, 10^5000)
MAX_INT_DIGITS = 40
#: cache groups: one per window of the layers' own caches, one per recent window
MAX_GROUPS = 2 * MAX_LAYERS
MODEL_DTYPE_NAMES = tuple(MODEL_DTYPES)

#: how every message about a damaged or inconsistent spec ends
REBUILD = "; rebuild the artifact"
INCONSISTENT = "; the spec is inconsistent, rebuild the artifact"


class SpecError(TQExportError):
    """A spec file that cannot be used as it is."""
