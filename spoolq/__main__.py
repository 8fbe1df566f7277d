"""``python -m spoolq``: the same command line as the ``spoolq`` executable."""

from .entry import main

main()
