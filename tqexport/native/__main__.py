"""``python -m tqexport.native [--sanitize]``: build the native ONNX Runtime kernels.

Without ONNX Runtime's headers it says so in one line and exits 0: the function bodies run.
"""

from __future__ import annotations

import sys

from tqexport.errors import TQExportError
from tqexport.native.build import build


def main(argv: list[str]) -> int:
    sanitize = "--sanitize" in argv
    try:
        built = build(sanitize=sanitize)
    except TQExportError as e:
        print(f"warning: native kernels not built: {str(e).splitlines()[0]}", file=sys.stderr)
        return 0
    print(f"native kernels: {built.library} ({built.source_hash})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
