"""python3 -m treeserve: the treeserve-cli command line."""
import sys

from .cli import main

sys.exit(main())
