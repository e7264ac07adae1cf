"""The ``tqexport`` command line (typer). Bad input: one line on stderr, exit code 2.

Every argument is checked (:mod:`tqexport.validate`) before any expensive work, usage errors
(a bad type, a missing or unknown option) are one line too, and every user string (paths,
prompts, model names, messages quoting them) is printed literally: the consoles parse no
markup and no emoji codes, and control characters are shown escaped.
"""

from tqexport.cli.root import app, main

__all__ = ["app", "main"]
