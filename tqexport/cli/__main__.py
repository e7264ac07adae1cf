"""``python -m tqexport.cli``: the same command line as ``tqexport``."""

from tqexport.cli import main

main()
